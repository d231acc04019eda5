"""Served steps while ``start_warmup``'s background compiles run, before and after two changes: the
compiles' scheduling priority (the compile thread at nice 10 with XLA's compile helper threads at
normal priority, against both at idle priority: ``scv_jax.graph.idle_priority``) and the prefill's
first bucket (the largest batch, every arrival's rows padded to it, against batch 1 with an arrival's
rows split over calls of it: ``ExecutableCache.split_dims``). The floor is the largest buckets with no
compile running. Groups of ``--arrivals`` requests arrive together and decode ``--max-tokens`` tokens
each, again and again for ``--seconds``; until their buckets compile, decode steps run padded to the
largest (batch 8, 32 blocks). Reports decode steps (p50 / p90 / max), the steps that admit a group
(their prefill and a decode: the stall a running stream sees when requests arrive) and how many
background compiles finished. Demo pair, draft model k = 4; each mode in a fresh engine from an empty
persistent cache, in one process.

    python benchmarks/bench_background.py --append

``--dry-run``: a few seconds a mode, nothing appended (a check that the script runs).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scv_jax import DecoderConfig, Engine, SamplingParams  # noqa: E402
from scv_jax.demo.report import append_markdown, results_header  # noqa: E402
from scv_jax.graph import idle_priority  # noqa: E402
from scv_jax.graph.persistent_cache import enable_persistent_cache  # noqa: E402
from scv_jax.models import load_demo  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
MAX_BATCH, MAX_LEN = 8, 512
NICE_BEFORE = 10        # the compile thread's priority before idle_priority


def run_mode(mode: str, target, draft, args) -> dict[str, float]:
    """One mode's figures: ``before`` / ``padded`` / ``idle`` compile in the background; ``floor`` has only the
    largest buckets, compiled before the timed steps."""
    enable_persistent_cache(tempfile.mkdtemp(prefix="scv_jax_bench_background_"))
    jax.clear_caches()
    floor = mode == "floor"
    config = DecoderConfig(k=4, batch_buckets=(MAX_BATCH,) if floor else (1, 2, 4, MAX_BATCH),
                           context_buckets=(MAX_LEN // 16,) if floor else None, max_seq_len=MAX_LEN,
                           num_blocks=MAX_BATCH * MAX_LEN // 16)
    engine = Engine(target, draft, config=config)
    may_restore = idle_priority.may_restore
    if mode == "before":        # no idle priority: the compile thread reniced below instead
        idle_priority.may_restore = lambda: False
    if mode in ("before", "padded", "floor"):   # the largest prefill first, a prefill's rows padded to it
        engine.runner.prefill_executable.split_dims = ()
    try:
        compiler = engine.start_warmup(MAX_BATCH, MAX_LEN)
        if floor:
            compiler.wait()
        for thread in threading.enumerate() if mode == "before" else ():
            if thread.name.startswith(compiler.name):
                os.setpriority(os.PRIO_PROCESS, thread.native_id, NICE_BEFORE)
        figures = time_steps(engine, compiler, args)
    finally:
        idle_priority.may_restore = may_restore
    return figures


def time_steps(engine: Engine, compiler, args) -> dict[str, float]:
    """Groups of requests for ``args.seconds``; the figures (stops ``compiler``)."""
    pending = compiler.pending
    prompt = list(b"def fibonacci(n):\n    ")
    decode, admit = [], []
    start = time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        for _ in range(args.arrivals):
            engine.add_request(prompt, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
        first = True
        while engine.has_unfinished():
            begin = time.perf_counter()
            engine.step()
            (admit if first else decode).append(time.perf_counter() - begin)
            first = False
    compiled = pending - compiler.pending
    compiler.stop()
    decode_ms, admit_ms = np.array(decode) * 1e3, np.array(admit) * 1e3
    return {"p50": np.median(decode_ms), "p90": np.percentile(decode_ms, 90), "max": decode_ms.max(),
            "admit": np.median(admit_ms), "admit_max": admit_ms.max(), "groups": len(admit_ms),
            "compiled": compiled, "pending": pending}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=40.0, help="timed steps per mode")
    parser.add_argument("--arrivals", type=int, default=3, help="requests arriving together")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    if args.dry_run:
        args.seconds, args.max_tokens = 3.0, 16
    target, draft = load_demo()
    names = {"before": "compile thread at nice 10, XLA's helpers normal, prefill rows padded (before)",
             "padded": "compile thread and XLA's helpers at idle priority, prefill rows padded",
             "idle": "idle priority, prefill rows split over the compiled batch-1 bucket (now)",
             "floor": "floor: the largest buckets only, no compile running (prefill rows padded)"}
    rows = []
    for mode in ("before", "padded", "idle", "floor"):
        figures = run_mode(mode, target, draft, args)
        print(f"{mode}: {figures}", file=sys.stderr, flush=True)
        done = "-" if mode == "floor" else f"{figures['compiled']} of {figures['pending']}"
        rows.append(f"| {names[mode]} | {figures['p50']:.1f} | {figures['p90']:.1f} | {figures['max']:.0f} | "
                    f"{figures['admit']:.0f} | {figures['admit_max']:.0f} | {done} |")
    table = ("| background compiles | decode step p50 ms | p90 ms | max ms | admitting step median ms | max ms | "
             "compiles done |\n|---|---|---|---|---|---|---|\n" + "\n".join(rows))
    text = (f"Groups of {args.arrivals} requests ({args.max_tokens} tokens each) for {args.seconds:.0f} s right "
            f"after `Engine.start_warmup({MAX_BATCH}, {MAX_LEN})` returned (demo pair, draft model k = 4, cold "
            f"persistent cache, nothing else running).\n\n{table}\n")
    print(text)
    if args.append and not args.dry_run:
        append_markdown(RESULTS, results_header(
            "Steps during background compiles, by their priority (bench_background.py)",
            "python benchmarks/bench_background.py " + " ".join(sys.argv[1:])) + text)


if __name__ == "__main__":
    main()
