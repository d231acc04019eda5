"""Structured output's cost and effect: output tokens/s and mean accepted length of requests with a
constraint vs none, autoregressive vs speculative (n-gram drafts, the demo draft model with and without its
drafting automaton, the demo EAGLE-3 head), at batch 1 and 8, in one process on the demo pair; two
workloads: a five-field JSON schema, and tool calls (``tool_choice`` "required" over 3 functions, the
constraint the server builds); and the host's grammar work: compiling the schema, the masks of one step
(``Grammars.step_masks`` along a chain of k drafts) per request and per verified position, and the
drafting automata's tables (``grammar_automaton``): states, token classes, bytes; and the host's check of
a step verified with the automaton's masks (``Grammars.agreeing_prefix``).

Run: ``JAX_PLATFORMS=cpu python benchmarks/bench_structured.py [--batches 1 8] [--max-tokens 96]
[--tokenizer tokenizer.json] [--repeats 3]`` (``--tokenizer``: also size the automata over that vocabulary).
Each batch size B decodes 8 greedy requests, at most B running; compiles are excluded (a warm-up pass
first); greedy outputs are checked equal across modes. "draft model, free drafts" is the draft model
without its automaton (``grammar_automaton.MAX_STATES`` set to 0: its drafts are cut by the host's
masks at their first invalid token), the A/B of the automaton; "draft model, split steps" is the draft
model with every constrained step split (``scheduler.VERIFY_WITH_AUTOMATA`` False: drafts masked by the
host before they are verified), the A/B of verifying with the automaton's masks in one call
(and "EAGLE-3 head, split steps" the head's); "... tree": EAGLE-2 trees (``TreeConfig()``), verified with
the automaton's masks. Each row is the best of ``--repeats`` timed runs (this CPU is shared).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from scv_jax import (DecoderConfig, Engine, SamplingParams, SpeculativeDecoder, StructuredOutputsParams,  # noqa: E402
                     TreeConfig)
from scv_jax.decoding import grammar_automaton, scheduler  # noqa: E402
from scv_jax.decoding.grammar import Grammars  # noqa: E402
from scv_jax.decoding.proposers.base import path_trie  # noqa: E402
from scv_jax.demo.hf_export import write_tokenizer  # noqa: E402
from scv_jax.models import load_demo, load_demo_head, load_tokenizer  # noqa: E402
from scv_jax.serving.tools import ToolSet  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "id", "tags", "size", "valid"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "id": {"type": "integer", "minimum": 0},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
                         "size": {"enum": ["small", "medium", "large"]}, "valid": {"type": "boolean"}}}
TOOLS = ToolSet({
    "get_weather": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}},
    "search": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "maxLength": 24},
                                         "limit": {"type": "integer", "minimum": 1, "maximum": 20}},
        "required": ["query", "limit"], "additionalProperties": False}},
    "add": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"], "additionalProperties": False}}}, "required", parallel=False, legacy=False)
PROMPTS = ["record = ", "def parse(data):\n    return ", "config = {'name': ", "# JSON\nvalue = ",
           "import json\nx = json.loads(", "item = dict(", "row = ", "payload = "]
REQUESTS = 8
MODES = ("autoregressive", "n-gram", "draft model", "draft model, split steps", "draft model, free drafts",
         "EAGLE-3 head", "EAGLE-3 head, split steps", "draft model tree", "EAGLE-3 head tree")


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list, int, int]:
    """(seconds, outputs, tokens, steps) of decoding ``prompts`` to the end."""
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, str(i))
    outputs, steps, start = {}, 0, time.perf_counter()
    while engine.has_unfinished():
        steps += 1
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    seconds = time.perf_counter() - start
    return seconds, [outputs[str(i)] for i in range(len(prompts))], sum(len(o.token_ids) for o in outputs.values()), steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each row (the best is kept)")
    parser.add_argument("--tokenizer", help="a tokenizer.json to size the drafting automata over (optional)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="the modes to run")
    args = parser.parse_args()
    folder = pathlib.Path(tempfile.mkdtemp())
    write_tokenizer(folder)
    tokenizer = load_tokenizer(folder)
    target, draft = load_demo()
    head = load_demo_head(target, dtype="float32")
    prompts = [tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i in range(REQUESTS)]
    workloads = {"JSON schema": StructuredOutputsParams(json=SCHEMA), "tool calls": TOOLS.constraint()}
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, demo pair, {REQUESTS} greedy requests, "
          f"max_tokens {args.max_tokens}, k = {args.k}")
    print("| batch | mode | constraint | output tok/s | mean accepted length | steps | valid JSON |")
    print("|---:|---|---|---:|---:|---:|---:|")
    for batch in args.batches:
        config = dict(max_seq_len=256, batch_buckets=(batch,), num_blocks=256)
        drafters = dict(zip(MODES, (None, "ngram", draft, draft, draft, head, head, draft, head)))
        reference = {}
        for mode in args.modes:
            tree = TreeConfig() if mode.endswith("tree") else None
            k = 0 if drafters[mode] is None else tree.max_depth if tree else args.k
            drafter, cfg = drafters[mode], DecoderConfig(k=k, tree=tree, **config)
            grammar_automaton.MAX_STATES = 0 if mode.endswith("free drafts") else grammar_automaton.TABLE_STATES
            scheduler.VERIFY_WITH_AUTOMATA = not mode.endswith("split steps")
            engine = Engine(SpeculativeDecoder(target, drafter, config=cfg), tokenizer=tokenizer, max_num_seqs=batch)
            for kind, constraint in {"none": None, **workloads}.items():
                if kind == "none" and mode.endswith(("free drafts", "split steps")):
                    continue
                params = SamplingParams(max_tokens=args.max_tokens, structured_outputs=constraint)
                run(engine, prompts, params)                         # compiles
                seconds, outputs, produced, steps = min((run(engine, prompts, params) for _ in range(args.repeats)),
                                                        key=lambda timed: timed[0])
                ids = [o.token_ids for o in outputs]
                assert reference.setdefault(kind, ids) == ids, f"{mode}, {kind}: outputs differ from autoregressive"
                accepted = sum(o.num_accepted_tokens for o in outputs)
                valid = "-" if kind == "none" else \
                    f"{sum(_parses(tokenizer.decode(i)) for i in ids)}/{len(ids)}"
                print(f"| {batch} | {mode} | {kind} | {produced / seconds:.0f} | "
                      f"{produced / max(produced - accepted, 1):.2f} | {steps} | {valid} |", flush=True)
    grammar_automaton.MAX_STATES, scheduler.VERIFY_WITH_AUTOMATA = grammar_automaton.TABLE_STATES, True
    host_work(tokenizer, target.config.vocab_size, workloads, reference["JSON schema"], args.k)
    if args.tokenizer:
        text = pathlib.Path(args.tokenizer).read_text()
        import tokenizers
        vocab = tokenizers.Tokenizer.from_str(text).get_vocab_size(with_added_tokens=True)
        table_sizes(Grammars(text, vocab, ()), workloads, vocab, args.tokenizer)


def host_work(tokenizer, vocab_size: int, workloads: dict, outputs: list, k: int) -> None:
    """The host's grammar work per step: compiling, masks along chains of the requests' own outputs."""
    grammars = Grammars(tokenizer.to_json(), vocab_size, ())
    constraint = workloads["JSON schema"]
    start = time.perf_counter()
    for _ in range(20):
        grammars.matcher(constraint)
    compile_ms = (time.perf_counter() - start) / 20 * 1e3
    per_step, positions = [], 0
    for text in outputs:
        matcher = grammars.matcher(constraint)
        for j in range(len(text) - 1):
            chain = path_trie(list(text[j:j + k]))
            start = time.perf_counter()
            (cut,), _ = grammars.step_masks([matcher], [chain], k + 1)
            per_step.append(time.perf_counter() - start)
            positions += len(cut.tokens) + 1
            matcher.consume_token(text[j])
    print(f"\nhost grammar work: compiling the schema {compile_ms:.2f} ms; masks of one request's step "
          f"(k = {k}, chains from its own output) {np.median(per_step) * 1e6:.0f} us median, "
          f"{sum(per_step) / positions * 1e6:.0f} us per verified position ({len(per_step)} steps); "
          f"a step of 64 such requests: {64 * np.median(per_step) * 1e3:.1f} ms")
    automaton = grammar_automaton.automaton_for(constraint, grammar_automaton.AutomatonBuilder(
        grammars.token_bytes(), grammars.eos_ids))
    checks = []
    for text in outputs:                  # a one-call step's check: k + 1 emitted tokens from each position
        matcher, state = grammars.matcher(constraint), automaton.initial
        for j in range(len(text) - 1):
            start = time.perf_counter()
            grammars.agreeing_prefix(matcher, automaton, state, list(text[j:j + k + 1]), greedy=True)
            checks.append(time.perf_counter() - start)
            matcher.consume_token(text[j])
            state = automaton.advance(state, [int(text[j])])
    print(f"host check of a step verified with the automaton (Grammars.agreeing_prefix, {k + 1} tokens): "
          f"{np.median(checks) * 1e6:.0f} us median ({len(checks)} steps); 64 such requests: "
          f"{64 * np.median(checks) * 1e3:.1f} ms")
    table_sizes(grammars, workloads, vocab_size, "the demo tokenizer")


def table_sizes(grammars: Grammars, workloads: dict, vocab_size: int, name: str) -> None:
    """The drafting automata of the workloads over a vocabulary: states, classes, bytes, build time."""
    builder = grammar_automaton.AutomatonBuilder(grammars.token_bytes(), grammars.eos_ids)
    tables = grammar_automaton.DraftTables(vocab_size)
    for kind, constraint in workloads.items():
        start = time.perf_counter()
        automaton = grammar_automaton.automaton_for(constraint, builder)
        seconds = time.perf_counter() - start
        if automaton is None:
            print(f"drafting automaton of the {kind} over {name} (V = {vocab_size}): none (see the log)")
            continue
        states, classes = automaton.next_state.shape
        print(f"drafting automaton of the {kind} over {name} (V = {vocab_size}): {states} states, {classes} "
              f"token classes, {automaton.next_state.nbytes / states:.0f} B per state, "
              f"{automaton.nbytes / 1e3:.0f} kB with the class map; built in {seconds:.2f} s")
    print(f"the device tables (DraftTables, fixed): {(tables.next_state.nbytes + tables.token_class.nbytes) / 1e6:.1f} "
          f"MB ({grammar_automaton.TABLE_STATES} states x {tables.next_state.shape[1]} classes, "
          f"{grammar_automaton.MAX_GRAMMARS} class maps of V)")


def _parses(text: str) -> bool:
    import json
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    main()
