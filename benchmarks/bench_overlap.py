"""One step in flight, measured without a model's cost: the engine's decode steps stand in for a device step
of a fixed D ms (``DeviceClock``: a step is ready D ms after the device took it, the device taking steps
in order as a GPU stream does; the real executables run on micro models, a small fraction of D), so a
step's period over D is what the host's work between steps costs. With one step in flight
(``DecoderConfig.overlap``) the host works while the next step runs: the period tends to max(D, host);
without, it is D + host.

    python benchmarks/bench_overlap.py --append            # D = 2, 10 ms; batch 1, 16, 64, 256
    python benchmarks/bench_overlap.py --quick --json rows.json
    python benchmarks/bench_overlap.py --demo --append      # the demo pair end to end, no stand-in
    python benchmarks/bench_overlap.py --constrained --append   # constrained requests: sit out vs synchronous
    python benchmarks/bench_overlap.py --admissions --append    # prefills behind the step in flight: wait or not

Rows: drafters "autoregressive", "draft" (a draft model, k = 4), "eagle3" (an EAGLE-3 head, k = 4), "ngram"
(k = 4) and "suffix" (k = 4), in modes "off" (``overlap=False``), "on" (the default; host drafters' steps
stay synchronous) and, for the host drafters, "ahead" (``draft_ahead``: their chains drafted past the step
in flight's drafts, assumed accepted, so a step may emit other tokens: the table gives tokens per step and
tokens/s over "off"; ``--json`` rows carry ``overlap`` and ``mode``),
each with plain requests and with a quarter of the rows using penalties, a JSON schema (a string of 400 to
480 characters: the request never ends while timed) and logprobs, overlap on and off in the same process. The two CPU cores are shared by the host loop and XLA:CPU running
the micro models: what the stand-in device computes competes with the host work it should hide.

``--constrained``: with one step in flight, constrained requests (the controls above) sit out every other
step while they are at most a quarter of the batch (``Scheduler.may_run_ahead``). The A/B against the
loop before, where any constrained request made the batch synchronous ("sync"), with a quarter and half
of the requests constrained (the engine picks "sync" at half: both are timed, with
``CONSTRAINED_SIT_OUT_SHARE`` set to 1 or 0), in ms per emitted token per request.

``--admissions``: requests arriving as others end, so that most steps admit and prefill one. A prefill
dispatched while a step is in flight queues behind it; the host no longer waits for it (the loop before
did, holding the next step's dispatch until both ran): tokens/s with and without that wait.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import logging
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scv_jax import DecoderConfig, Engine, SamplingParams, SpeculativeDecoder, SuffixDrafter  # noqa: E402
from scv_jax.sampling_params import StructuredOutputsParams  # noqa: E402
from scv_jax.demo.report import append_markdown, results_header  # noqa: E402
from scv_jax.models import Transformer, TransformerConfig  # noqa: E402
from scv_jax.models.eagle3 import Eagle3Head  # noqa: E402
from scv_jax.decoding import scheduler  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
DRAFTERS = ("autoregressive", "draft", "eagle3", "ngram", "suffix")
TARGET = TransformerConfig(vocab_size=256, num_layers=1, d_model=32, num_heads=2, num_kv_heads=1, head_dim=16,
                           ffn_dim=64)
DRAFT = TransformerConfig(vocab_size=256, num_layers=1, d_model=16, num_heads=2, num_kv_heads=1, head_dim=8,
                          ffn_dim=32)
PROMPT_LEN, MAX_SEQ_LEN, BLOCK = 8, 512, 16
SCHEMA = StructuredOutputsParams(json={"type": "string", "minLength": 400, "maxLength": 480})


def byte_tokenizer():
    """A tokenizer of the micro models' 256 ids: one byte each (no merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())},
                                     merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


class DeviceClock:
    """Makes an engine's decode steps take ``device_ms`` each: a dispatched step starts when the device is
    free (the step before done) and is ready ``device_ms`` later; its fetch waits until then. A prefill
    waited for (``StepRunner.prefill``'s ``wait``; always with ``wait_prefills``: the loop before prefills
    queued behind a step in flight) waits for the steps dispatched before it. Wraps the runner's
    ``dispatch``, ``fetch`` and ``prefill`` on the instance, as a context (engines of one decoder share
    its runner: each measurement restores it, so no clock outlives its own)."""

    def __init__(self, engine: Engine, device_ms: float, wait_prefills: bool = False):
        runner = engine.runner
        self.seconds, self.free_at, self.ready = device_ms / 1e3, 0.0, []
        dispatch, fetch, prefill = runner.dispatch, runner.fetch, runner.prefill

        def until(moment: float) -> None:
            while time.perf_counter() < moment:
                time.sleep(max(moment - time.perf_counter() - 2e-4, 0))

        def timed_dispatch(*args, **kwargs):
            pending = dispatch(*args, **kwargs)
            self.free_at = max(time.perf_counter(), self.free_at) + self.seconds
            self.ready.append(self.free_at)
            return pending

        def timed_fetch(pending, *args, **kwargs):
            until(self.ready.pop(0))
            return fetch(pending, *args, **kwargs)

        def timed_prefill(*args, wait: bool = True, **kwargs):
            wait = wait or wait_prefills
            prefill(*args, wait=wait, **kwargs)
            if wait:
                until(self.free_at)

        self._runner = runner
        runner.dispatch, runner.fetch, runner.prefill = timed_dispatch, timed_fetch, timed_prefill

    def __enter__(self) -> "DeviceClock":
        return self

    def __exit__(self, *exc) -> None:
        for name in ("dispatch", "fetch", "prefill"):
            vars(self._runner).pop(name)             # the class's methods again


MODES = {"off": dict(overlap=False), "on": dict(overlap=True), "ahead": dict(overlap=True, draft_ahead=True)}
HOST_DRAFTERS = ("ngram", "suffix")


def modes_of(drafter: str) -> tuple[str, ...]:
    """The ``MODES`` a drafter is measured in ("ahead" for host drafters only)."""
    return ("off", "on", "ahead") if drafter in HOST_DRAFTERS else ("off", "on")


def decoder(drafter: str, mode: str, batches: list[int], target, draft) -> SpeculativeDecoder:
    """The micro target with ``drafter`` at k = 4 (none: k = 0), batch buckets ``batches``, in ``mode``
    (``MODES``: one step in flight off, on (the default), on with host chains drafted ahead)."""
    blocks = max(batches) * (-(-MAX_SEQ_LEN // BLOCK)) + 16
    config = DecoderConfig(k=0 if drafter == "autoregressive" else 4, block_size=BLOCK, num_blocks=blocks,
                           max_seq_len=MAX_SEQ_LEN, prefill_chunk=PROMPT_LEN, batch_buckets=tuple(batches),
                           context_buckets=(MAX_SEQ_LEN // BLOCK,), enable_prefix_caching=False, **MODES[mode])
    drafters = {"autoregressive": None, "draft": draft, "ngram": "ngram", "suffix": SuffixDrafter()}
    return SpeculativeDecoder(target, micro_head(target) if drafter == "eagle3" else drafters[drafter], config=config)


def micro_head(target: Transformer) -> Eagle3Head:
    """An EAGLE-3 head for the micro target (one layer of its width, its one layer's input tapped thrice)."""
    from flax import nnx
    config = dataclasses.replace(TARGET, num_layers=1, tie_embeddings=False)
    return Eagle3Head(config, target.embed, draft_vocab_size=TARGET.vocab_size, draft_to_target=None,
                      aux_layers=(0, 0, 0), norm_before_residual=False, rngs=nnx.Rngs(2))


def period_ms(spec: SpeculativeDecoder, batch: int, device_ms: float, controls: bool, steps: int, seed: int,
              every: int = 4) -> tuple[float, float]:
    """Mean ms between steps of ``batch`` running requests (all prefilled, none ending) on a ``device_ms``
    device, and the tokens a step emits per request (host chains drafted ahead verify other drafts);
    ``controls``: one request in ``every`` with penalties, logprobs and a JSON schema."""
    engine = Engine(spec, max_num_batched_tokens=batch * PROMPT_LEN + 64, tokenizer=byte_tokenizer())
    rng = np.random.default_rng(seed)
    for i in range(batch):
        controlled = controls and i % every == 0
        params = SamplingParams(max_tokens=MAX_SEQ_LEN - PROMPT_LEN, temperature=0.0,
                                presence_penalty=0.5 if controlled else 0.0,
                                frequency_penalty=0.3 if controlled else 0.0, logprobs=2 if controlled else None,
                                structured_outputs=SCHEMA if controlled else None)
        engine.add_request(rng.integers(0, 256, PROMPT_LEN).tolist(), params)
    with DeviceClock(engine, device_ms):
        for _ in range(4):                    # prefill, compile, fill the pipeline
            engine.step()
        start, emitted = time.perf_counter(), 0
        for _ in range(steps):
            emitted += sum(len(out.new_token_ids) for out in engine.step())
        period = (time.perf_counter() - start) / steps * 1e3
        engine.abort_all()
        while engine.has_unfinished():
            engine.step()
    return period, emitted / steps / batch


def demo_rows(batches: list[int], drafters: list[str], max_tokens: int) -> list[dict]:
    """The demo pair end to end on this machine (no stand-in step): tokens per second of greedy requests
    of ``max_tokens`` at each batch, per drafter, in each mode (one process, one warm-up run per decoder
    first); raises if a mode's tokens differ from "off"'s."""
    from scv_jax.demo.e2e import benchmark_prompts
    from scv_jax.models import load_demo, load_demo_head
    target, draft = load_demo()
    kinds = {"autoregressive": None, "draft": draft, "eagle3": load_demo_head(target, dtype="float32"),
             "ngram": "ngram", "suffix": None}
    rows = []
    for drafter in drafters:
        modes = modes_of(drafter)
        for batch in batches:
            prompts, tokens = benchmark_prompts(batch), {}
            for mode in modes:
                config = DecoderConfig(k=0 if drafter == "autoregressive" else 4, batch_buckets=(batch,),
                                       num_blocks=batch * 16 + 16, max_seq_len=256, **MODES[mode])
                spec = SpeculativeDecoder(target, SuffixDrafter() if drafter == "suffix" else kinds[drafter],
                                          config=config)
                spec.generate(prompts, max_tokens)                  # compiles
                start = time.perf_counter()
                out = spec.generate(prompts, max_tokens)
                seconds = time.perf_counter() - start
                tokens[mode] = out.tokens
                if out.tokens != tokens["off"]:
                    raise AssertionError(f"{drafter} batch {batch}: {mode}'s greedy tokens differ from off's")
                rows.append(dict(drafter=drafter, batch=batch, mode=mode, overlap=mode != "off",
                                 tokens_per_s=round(sum(map(len, out.tokens)) / seconds, 1)))
                print(f"demo {drafter:>14} batch {batch:>3} {mode:>5}: {rows[-1]['tokens_per_s']:8.1f} tokens/s",
                      flush=True)
    return rows


def demo_table(rows: list[dict]) -> list[str]:
    lines = ["| drafter | batch | tokens/s: off | on | ahead | on / off | ahead / off |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        if row["mode"] == "off":
            same = {r["mode"]: r["tokens_per_s"] for r in rows if (r["drafter"], r["batch"]) == (row["drafter"], row["batch"])}
            cells = [f"{same[m]:.1f}" if m in same else "" for m in MODES]
            cells += [f"{same[m] / same['off']:.2f}" if m in same else "" for m in ("on", "ahead")]
            lines.append(f"| {row['drafter']} | {row['batch']} | " + " | ".join(cells) + " |")
    return lines


def stand_in_rows(drafters: list[str], device_ms: list[float], batches: list[int], steps: int) -> list[dict]:
    """The micro models on the stand-in device step: each drafter's period and tokens per step per mode."""
    from flax import nnx
    target, draft = Transformer(TARGET, rngs=nnx.Rngs(0)), Transformer(DRAFT, rngs=nnx.Rngs(1))
    rows = []
    for drafter in drafters:
        modes = modes_of(drafter)
        specs = {mode: decoder(drafter, mode, sorted(set(batches)), target, draft) for mode in modes}
        for d in device_ms:
            for batch in batches:
                for controls in (False, True):
                    for mode in modes:
                        period, per_step = period_ms(specs[mode], batch, d, controls, steps, seed=batch)
                        rows.append(dict(drafter=drafter, batch=batch, controls=controls, overlap=mode != "off", mode=mode,
                                         device_ms=d, period_ms=round(period, 3), tokens_per_step=round(per_step, 3)))
                        print(f"{drafter:>14} D={d:>4} ms batch {batch:>3} controls {controls!s:>5} "
                              f"{mode:>5}: period {period:7.2f} ms = {period / d:.3f} D, "
                              f"{per_step:.2f} tokens per step", flush=True)
    return rows


@contextlib.contextmanager
def constrained_share(share: float):
    """Inside: steps overlap while at most ``share`` of the running requests are constrained (0: any
    constrained request makes them synchronous, the loop before; 1: they always sit out steps)."""
    default = scheduler.CONSTRAINED_SIT_OUT_SHARE
    scheduler.CONSTRAINED_SIT_OUT_SHARE = share
    try:
        yield
    finally:
        scheduler.CONSTRAINED_SIT_OUT_SHARE = default


def constrained_rows(drafters: list[str], device_ms: list[float], batches: list[int], steps: int) -> list[dict]:
    """Constrained requests sitting out steps ("sit out") vs synchronous batches ("sync"), one in 4 and one
    in 2 requests constrained: ms per emitted token per request, the better of two runs each."""
    from flax import nnx
    target, draft = Transformer(TARGET, rngs=nnx.Rngs(0)), Transformer(DRAFT, rngs=nnx.Rngs(1))
    rows = []
    for drafter in [d for d in drafters if d not in HOST_DRAFTERS]:
        spec = decoder(drafter, "on", sorted(set(batches)), target, draft)
        for d, batch, every in itertools.product(device_ms, batches, (4, 2)):
            times = {"sit out": [], "sync": []}
            for _ in range(2):
                for mode, share in (("sync", 0.0), ("sit out", 1.0)):
                    with constrained_share(share):
                        period, per_step = period_ms(spec, batch, d, True, steps, seed=batch, every=every)
                    times[mode].append(period / per_step)
            row = dict(drafter=drafter, device_ms=d, batch=batch, constrained=f"1/{every}",
                       **{mode: round(min(t), 3) for mode, t in times.items()})
            rows.append(row)
            print(f"{drafter:>14} D={d:>4} ms batch {batch:>3} constrained {row['constrained']}: ms per token per "
                  f"request: sit out {row['sit out']:.3f}, sync {row['sync']:.3f}", flush=True)
    return rows


def admitting_tokens_per_second(spec: SpeculativeDecoder, batch: int, device_ms: float, steps: int,
                                wait_prefills: bool) -> float:
    """Tokens/s of ``batch`` running greedy requests of 8 to 16 tokens, each replaced by a new one as it
    ends (most steps admit and prefill one), on a ``device_ms`` device."""
    engine = Engine(spec, max_num_batched_tokens=batch * PROMPT_LEN + 64, tokenizer=byte_tokenizer())
    rng = np.random.default_rng(batch)

    def arrive() -> None:
        engine.add_request(rng.integers(0, 256, PROMPT_LEN).tolist(),
                           SamplingParams(max_tokens=int(rng.integers(8, 17)), temperature=0.0))

    for _ in range(2 * batch):
        arrive()
    with DeviceClock(engine, device_ms, wait_prefills):
        for _ in range(6):                    # prefill, compile, fill the pipeline
            engine.step()
        start, emitted = time.perf_counter(), 0
        for _ in range(steps):
            for out in engine.step():
                emitted += len(out.new_token_ids)
                if out.finished:
                    arrive()
        seconds = time.perf_counter() - start
        engine.abort_all()
        while engine.has_unfinished():
            engine.step()
    return emitted / seconds


def admission_rows(drafters: list[str], device_ms: list[float], batches: list[int], steps: int) -> list[dict]:
    """Requests arriving as others end, with one step in flight: prefills queued behind the step in flight
    ("queued", the default) vs waited for ("waited", the loop before), the better of two runs each."""
    from flax import nnx
    target, draft = Transformer(TARGET, rngs=nnx.Rngs(0)), Transformer(DRAFT, rngs=nnx.Rngs(1))
    rows = []
    for drafter in [d for d in drafters if d not in HOST_DRAFTERS]:
        spec = decoder(drafter, "on", sorted(set(batches)), target, draft)
        for d, batch in itertools.product(device_ms, batches):
            rates = {"waited": [], "queued": []}
            for _ in range(2):
                for mode in rates:
                    rates[mode].append(admitting_tokens_per_second(spec, batch, d, steps, mode == "waited"))
            row = dict(drafter=drafter, device_ms=d, batch=batch, **{m: round(max(r), 1) for m, r in rates.items()})
            rows.append(row)
            print(f"{drafter:>14} D={d:>4} ms batch {batch:>3}: tokens/s prefills waited {row['waited']:.0f}, "
                  f"queued {row['queued']:.0f}", flush=True)
    return rows


def admission_table(rows: list[dict]) -> list[str]:
    lines = ["| drafter | D ms | batch | tokens/s: prefills waited | queued | queued over waited |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['drafter']} | {r['device_ms']:g} | {r['batch']} | {r['waited']:.0f} | {r['queued']:.0f} | "
              f"{r['queued'] / r['waited']:.2f} |" for r in rows]
    return lines


def constrained_table(rows: list[dict]) -> list[str]:
    lines = ["| drafter | D ms | batch | constrained | ms per token per request: sit out | sync "
             "| tokens/s sit out over sync |", "|---|---:|---:|---|---:|---:|---:|"]
    lines += [f"| {r['drafter']} | {r['device_ms']:g} | {r['batch']} | {r['constrained']} | {r['sit out']:.3f} | "
              f"{r['sync']:.3f} | {r['sync'] / r['sit out']:.2f} |" for r in rows]
    return lines


def stand_in_table(rows: list[dict]) -> list[str]:
    lines = ["| drafter | D ms | batch | controls | period / D: off | on | ahead | tokens per step: off | on "
             "| ahead | tokens/s over off: on | ahead |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        if row["mode"] != "off":
            continue
        same = {r["mode"]: r for r in rows if all(r[f] == row[f] for f in ("drafter", "batch", "controls", "device_ms"))}
        rate = {mode: r["tokens_per_step"] / r["period_ms"] for mode, r in same.items()}
        cells = [[f"{same[m]['period_ms'] / row['device_ms']:.3f}" if m in same else "" for m in MODES],
                 [f"{same[m]['tokens_per_step']:.2f}" if m in same else "" for m in MODES],
                 [f"{rate[m] / rate['off']:.2f}" if m in same else "" for m in ("on", "ahead")]]
        lines.append(f"| {row['drafter']} | {row['device_ms']:g} | {row['batch']} | "
                     f"{'yes' if row['controls'] else 'no'} | " + " | ".join(sum(cells, [])) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="D = 10 ms at batch 16 and 64 only (under 5 minutes)")
    parser.add_argument("--device-ms", type=float, nargs="+", default=None, help="stand-in step times (2 10)")
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="batch sizes (1 16 64 256)")
    parser.add_argument("--drafters", nargs="+", choices=DRAFTERS, default=list(DRAFTERS))
    parser.add_argument("--steps", type=int, default=40, help="steps timed per row")
    parser.add_argument("--demo", action="store_true",
                        help="the demo pair end to end instead (batch 1, 16, 64; greedy; tokens/s per mode)")
    parser.add_argument("--constrained", action="store_true",
                        help="constrained requests sitting out steps vs synchronous batches (device drafters)")
    parser.add_argument("--admissions", action="store_true",
                        help="requests arriving as others end: prefills behind the step in flight waited for or not")
    parser.add_argument("--max-tokens", type=int, default=128, help="--demo: tokens per request")
    parser.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    parser.add_argument("--append", action="store_true", help=f"append a table to {RESULTS}")
    args = parser.parse_args(argv)
    logging.getLogger("scv_jax").setLevel(logging.ERROR)      # (first-use compiles are expected here)
    if args.steps < 1 or args.steps * 5 > MAX_SEQ_LEN - PROMPT_LEN - 32:
        parser.error(f"--steps must be in [1, {(MAX_SEQ_LEN - PROMPT_LEN - 32) // 5}] (requests must not end)")
    device_ms = args.device_ms or ([10.0] if args.quick else [2.0, 10.0])
    batches = args.batches or ([16, 64] if args.quick else [1, 16, 64, 256])
    if min(batches) < 1 or min(device_ms) <= 0:
        parser.error("--batches must be >= 1 and --device-ms > 0")
    if args.demo:
        rows = demo_rows(args.batches or [1, 16, 64], args.drafters, args.max_tokens)
        title, details = ("the demo pair end to end", "Greedy requests; tokens identical in every mode (checked); "
                          "host and XLA share the two cores. ")
        table = demo_table(rows)
    elif args.admissions:
        rows = admission_rows(args.drafters, device_ms, args.batches or [16, 64], args.steps)
        title, details = ("prefills behind the step in flight, waited for or not",
                          "Greedy requests of 8 to 16 tokens, each replaced by a new one as it ends (most steps "
                          "admit and prefill); waited = the host waits for a prefill queued behind the step in "
                          "flight (the loop before); queued = it does not (the default). The better of two runs "
                          "of 40 steps each. ")
        table = admission_table(rows)
    elif args.constrained:
        rows = constrained_rows(args.drafters, device_ms, args.batches or [16, 64, 256], args.steps)
        title, details = ("constrained requests sitting out steps vs synchronous batches",
                          "Requests constrained (a JSON schema, penalties, logprobs): 1 in 4 or 1 in 2. sit out = "
                          "the default (each runs every other step while at most a quarter are constrained; "
                          "forced here at 1/2 too); sync = any constrained request makes the step synchronous "
                          "(the loop before). The better of two runs of 40 steps each. ")
        table = constrained_table(rows)
    else:
        rows = stand_in_rows(args.drafters, device_ms, batches, args.steps)
        title, details = ("step period over a stand-in device step of D ms",
                          "Modes: off = `overlap=False`; on = the default (host drafters synchronous); ahead = "
                          "`draft_ahead=True`. Controls: a quarter of the requests with penalties, logprobs and a "
                          "JSON schema. ")
        table = stand_in_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    if args.append:
        header = results_header(f"One step in flight: {title}",
                                "python benchmarks/bench_overlap.py " + " ".join(argv or sys.argv[1:]), details)
        append_markdown(RESULTS, "\n".join([header.rstrip("\n") + "\n", *table]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
