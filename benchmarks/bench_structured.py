"""Structured output's cost and effect: output tokens/s and mean accepted length of requests with a JSON
schema vs none, autoregressive vs speculative (n-gram drafts, the demo draft model), in one process on
the demo pair; and the host's grammar work: compiling the schema, and the masks of one step per
request and per verified position (``Grammars.step_masks`` on the chains the n-gram drafter proposed).

Run: ``JAX_PLATFORMS=cpu python benchmarks/bench_structured.py [--requests 8] [--max-tokens 96]``.
Every mode decodes the same greedy requests (``--requests`` prompts, all at once, at most 4 running);
the compiles are excluded (a warm-up pass first). Greedy outputs are checked to be equal across modes.
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

from scv_jax import DecoderConfig, Engine, SamplingParams, SpeculativeDecoder, StructuredOutputsParams  # noqa: E402
from scv_jax.decoding.grammar import Grammars  # noqa: E402
from scv_jax.demo.hf_export import write_tokenizer  # noqa: E402
from scv_jax.models import load_demo, load_tokenizer  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "id", "tags", "size", "valid"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "id": {"type": "integer", "minimum": 0},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
                         "size": {"enum": ["small", "medium", "large"]}, "valid": {"type": "boolean"}}}
PROMPTS = ["record = ", "def parse(data):\n    return ", "config = {'name': ", "# JSON\nvalue = ",
           "import json\nx = json.loads(", "item = dict(", "row = ", "payload = "]


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
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()
    folder = pathlib.Path(tempfile.mkdtemp())
    write_tokenizer(folder)
    tokenizer = load_tokenizer(folder)
    target, draft = load_demo()
    prompts = [tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i in range(args.requests)]
    config = dict(max_seq_len=256, batch_buckets=(4,), num_blocks=256)
    modes = {"autoregressive": (None, DecoderConfig(k=0, **config)),
             f"n-gram, k={args.k}": ("ngram", DecoderConfig(k=args.k, **config)),
             f"draft model, k={args.k}": (draft, DecoderConfig(k=args.k, **config))}
    constraint = StructuredOutputsParams(json=SCHEMA)
    kinds = {"none": SamplingParams(max_tokens=args.max_tokens),
             "JSON schema": SamplingParams(max_tokens=args.max_tokens, structured_outputs=constraint)}
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, demo pair, {args.requests} greedy requests, "
          f"max_tokens {args.max_tokens}, at most 4 running")
    print("| mode | constraint | output tok/s | mean accepted length | steps | valid JSON |")
    print("|---|---|---:|---:|---:|---:|")
    reference = {}
    for mode, (drafter, cfg) in modes.items():
        engine = Engine(SpeculativeDecoder(target, drafter, config=cfg), tokenizer=tokenizer, max_num_seqs=4)
        for kind, params in kinds.items():
            run(engine, prompts, params)                         # compiles
            seconds, outputs, produced, steps = run(engine, prompts, params)
            texts = [tokenizer.decode(o.token_ids) for o in outputs]
            ids = [o.token_ids for o in outputs]
            assert reference.setdefault(kind, ids) == ids, f"{mode}, {kind}: outputs differ from autoregressive"
            drafted = sum(o.num_accepted_tokens for o in outputs)
            valid = "-"
            if kind != "none":
                valid = f"{sum(_parses(t) for t in texts)}/{len(texts)}"
            print(f"| {mode} | {kind} | {produced / seconds:.0f} | {(produced) / max(produced - drafted, 1):.2f} "
                  f"| {steps} | {valid} |", flush=True)
    grammars = Grammars(tokenizer.to_json(), target.config.vocab_size, ())
    start = time.perf_counter()
    for _ in range(20):
        grammars.matcher(constraint)
    compile_ms = (time.perf_counter() - start) / 20 * 1e3
    texts = [tokenizer.encode(t) for t in texts]              # the constrained outputs of the last mode
    per_step, positions = [], 0
    for text in texts:
        matcher = grammars.matcher(constraint)
        for j in range(len(text) - 1):
            chain = text[j:j + args.k]
            start = time.perf_counter()
            (cut,), _ = grammars.step_masks([matcher], [chain], args.k + 1)
            per_step.append(time.perf_counter() - start)
            positions += len(cut) + 1
            matcher.consume_token(text[j])
    print(f"\nhost grammar work: compiling the schema {compile_ms:.2f} ms; masks of one request's step "
          f"(k = {args.k}, chains from its own output) {np.median(per_step) * 1e6:.0f} us median, "
          f"{sum(per_step) / positions * 1e6:.0f} us per verified position ({len(per_step)} steps)")


def _parses(text: str) -> bool:
    import json
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    main()
