"""Graph mode vs plain jax.jit for the verify step over a realistic sequence of batch shapes.

Measures, in one process:
  * per-step host time of graph mode (bucketed AOT executables, warmed up) vs ``jax.jit`` on
    unpadded shapes, on a first pass over the sequence (jit compiles every new shape: included) and
    a second pass (everything compiled: pure dispatch); plus the step time including the one fetch;
  * the cost of computing a bucket key on the host;
  * warm-up time of the default bucket set (``verify_step_cache()``), sequential and threaded.

Run: ``JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_graph_mode.py [--steps 60] [--append]``
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from harness import append_results, results_header  # noqa: E402
from scv_jax import Buckets, PagedKVCache, fetch_step_output, verify_step, verify_step_cache  # noqa: E402

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, VOCAB = 2, 512, 16, 2, 32, 1000
MAX_BATCH = 48


def make_cache(num_blocks: int = BLOCKS) -> PagedKVCache:
    return PagedKVCache.create(LAYERS, num_blocks, BLOCK_SIZE, HEADS, HEAD_DIM, dtype="bfloat16")


def shape_sequence(num_steps: int, seed: int = 0) -> list[tuple[int, int, np.ndarray]]:
    """(batch size, k, draft counts) per step: requests arrive and finish (a random walk of the batch
    size), k switches between 2 and 4 now and then, and ~10% of requests draft fewer than k tokens."""
    rng = np.random.default_rng(seed)
    batch, k, steps = 8, 4, []
    for _ in range(num_steps):
        batch = int(np.clip(batch + rng.integers(-3, 4), 1, MAX_BATCH))
        if rng.random() < 0.05:
            k = 6 - k
        counts = np.where(rng.random(batch) < 0.1, rng.integers(0, k + 1, batch), k)
        steps.append((batch, k, counts))
    return steps


def step_args(batch: int, k: int, counts: np.ndarray, rng: np.random.Generator) -> dict:
    cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    num_slots = int(cu[-1])
    drafts = rng.integers(0, VOCAB, num_slots).astype(np.int32)
    kv = rng.standard_normal((2, LAYERS, num_slots, HEADS, HEAD_DIM)).astype(np.float32)
    return dict(new_keys=kv[0], new_values=kv[1],
                slot_mapping=rng.permutation(BLOCKS * BLOCK_SIZE)[:num_slots].astype(np.int32),
                draft_token_ids=drafts, cu_num_draft_tokens=cu,
                bonus_token_ids=rng.integers(0, VOCAB, batch).astype(np.int32),
                target_token_ids=np.where(rng.random(num_slots) < 0.7, drafts, 0).astype(np.int32),
                max_spec_len=k, backend="xla")


def count_compiles() -> list[int]:
    counter = [0]

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            counter[0] += 1
    jax.monitoring.register_event_duration_secs_listener(listener)
    return counter


def run_pass(step, inputs, cache, *, fetch: bool):
    """Host seconds per call (dispatch only, or dispatch + the one fetch)."""
    times = []
    for batch, args in inputs:
        start = time.perf_counter()
        cache, out = step(cache, **args)
        if fetch:
            fetch_step_output(out, batch)
        times.append(time.perf_counter() - start)
    jax.block_until_ready(cache)
    return np.array(times), cache


def summarize(name, times, compiles):
    us = times * 1e6
    return (f"| {name} | {times.sum():.2f} | {np.median(us):.0f} | {np.percentile(us, 99):.0f} | "
            f"{us.max():.0f} | {compiles} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    parser.add_argument("--skip-default-warmup", action="store_true")
    opts = parser.parse_args()
    compiles = count_compiles()
    rng = np.random.default_rng(1)
    sequence = shape_sequence(opts.steps)
    inputs = [(batch, step_args(batch, k, counts, rng)) for batch, k, counts in sequence]
    print(f"{opts.steps} steps, batch 1..{MAX_BATCH}, "
          f"{len({(b, a['draft_token_ids'].size, a['max_spec_len']) for b, a in inputs})} distinct "
          f"unpadded shapes", file=sys.stderr)

    graph = verify_step_cache(batch_buckets=Buckets.pow2_then_linear(MAX_BATCH, linear_step=16),
                              spec_lens=(2, 4))
    start = time.perf_counter()
    report = graph.warmup(make_cache(), **inputs[0][1], max_workers=2)
    warm_seconds = time.perf_counter() - start
    plain = jax.jit(verify_step, static_argnames=("max_spec_len", "kv_layout", "backend"),
                    donate_argnames=("kv_cache",))

    rows = []
    for name, step in (("graph mode (ExecutableCache)", graph), ("jax.jit, unpadded shapes", plain)):
        cache = jax.block_until_ready(make_cache())
        before = compiles[0]
        print(f"{name}: pass 1 (cold)", file=sys.stderr, flush=True)
        cold, cache = run_pass(step, inputs, cache, fetch=False)
        cold_compiles = compiles[0] - before
        print(f"{name}: pass 2 (warm)", file=sys.stderr, flush=True)
        warm, cache = run_pass(step, inputs, cache, fetch=False)
        fetched, cache = run_pass(step, inputs, cache, fetch=True)
        rows.append(summarize(f"{name}, 1st pass (incl. compiles)", cold, cold_compiles))
        rows.append(summarize(f"{name}, 2nd pass (dispatch only)", warm, 0))
        rows.append(summarize(f"{name}, 2nd pass (dispatch + fetch)", fetched, 0))

    plan_us = []
    for batch, args in inputs:
        start = time.perf_counter()
        graph.plan(None, **args)
        plan_us.append((time.perf_counter() - start) * 1e6)

    default_rows = []
    if not opts.skip_default_warmup:
        for workers in (1, 2):
            print(f"default bucket set warm-up, {workers} thread(s)", file=sys.stderr, flush=True)
            default = verify_step_cache()
            # A cache size of its own per run, so that no run reuses another's compilations.
            r = default.warmup(make_cache(BLOCKS * (1 + workers)), **inputs[0][1], max_workers=workers,
                               progress=False)
            default_rows.append(f"| default `verify_step_cache()` ({r.buckets} buckets: batch "
                                f"{default.dims['batch'].sizes[0]}..{default.dims['batch'].largest}, k in "
                                f"{default.bucketed_statics['max_spec_len'].sizes}), {workers} thread(s) | "
                                f"{r.wall_seconds:.1f} | {r.compile_seconds:.1f} |")

    stats = graph.stats
    lines = [
        results_header("Graph mode: bucketed AOT executables vs jax.jit",
                       f"JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_graph_mode.py --steps {opts.steps}"),
        f"Verify step (greedy, XLA path, bf16 paged cache {LAYERS}x{BLOCKS}x{BLOCK_SIZE}x{HEADS}x{HEAD_DIM}) "
        f"over {opts.steps} steps whose batch size walks in 1..{MAX_BATCH} with k in {{2, 4}} and ragged "
        f"drafts. Graph mode buckets: batch {graph.dims['batch'].sizes}, k (2, 4), tokens = batch * k; "
        f"warm-up {report.compiled} executables in {warm_seconds:.1f}s (2 threads, before the passes). "
        f"Padding: batch x{stats.padding_ratio('batch'):.2f}, tokens x{stats.padding_ratio('tokens'):.2f}.",
        "",
        "| strategy | total s | p50 us/step | p99 us/step | max us/step | backend compiles |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"Host key computation (`ExecutableCache.plan`): median {np.median(plan_us):.1f} us.",
    ]
    if default_rows:
        lines += ["", "| warm-up | wall s | summed compile s |", "|---|---|---|", *default_rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if opts.append:
        append_results(text)


if __name__ == "__main__":
    main()
