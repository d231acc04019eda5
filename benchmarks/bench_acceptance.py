"""Acceptance ops: Pallas kernels vs the XLA reference, greedy and rejection sampling.

Greedy: B in {1, 8, 64, 256} requests x k in {1, 4, 8} drafts each. Rejection sampling: the same
batches at V in {32k, 152k} (fp32 probabilities); reports the bandwidth of reading p and q once.
On CPU only the XLA path is timed (use --quick for sizes a CPU finishes).

Run: ``python benchmarks/bench_acceptance.py [--quick] [--append]``.
``run_greedy(...)`` / ``run_rejection(...)`` return rows for benchmarks/gpu_suite.py.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

import scv_jax
from harness import append_results, median_seconds, results_header
from scv_jax.ops.registry import cuda_available

BATCHES = (1, 8, 64, 256)
SPEC_LENS = (1, 4, 8)
VOCABS = (32_768, 151_936)
L2_BYTES = 60 << 20   # H200's L2; rotating input sets exceed it twice over


def default_backends() -> tuple[str, ...]:
    return ("pallas", "xla") if cuda_available() else ("xla",)


def _greedy_inputs(batch: int, k: int, seed: int):
    key = jax.random.key(seed)
    t = batch * k
    draft = jax.random.randint(key, (t,), 0, 32_000, jnp.int32)
    mismatch = jax.random.uniform(jax.random.fold_in(key, 1), (t,)) < 0.3
    target = jnp.where(mismatch, (draft + 1) % 32_000, draft)
    cu = jnp.arange(batch + 1, dtype=jnp.int32) * k
    bonus = jnp.zeros((batch,), jnp.int32)
    return draft, cu, target, bonus


def _probs(key, shape):
    logits = jax.random.normal(key, shape, jnp.float32) * 2
    return jax.nn.softmax(logits, axis=-1)


def _rejection_inputs(batch: int, k: int, vocab: int, seed: int):
    key = jax.random.key(seed)
    t = batch * k
    q = _probs(jax.random.fold_in(key, 1), (t, vocab))
    p = _probs(jax.random.fold_in(key, 2), (t, vocab))
    draft = jax.random.categorical(jax.random.fold_in(key, 3), jnp.log(q)).astype(jnp.int32)
    cu = jnp.arange(batch + 1, dtype=jnp.int32) * k
    return draft, cu, q, p, jnp.zeros((batch,), jnp.int32), jax.random.split(jax.random.fold_in(key, 4), batch)


def _time_rotating(fn: Callable, input_sets: list, repeats: int, inner: int) -> float:
    position = [0]

    def once():
        position[0] = (position[0] + 1) % len(input_sets)
        return fn(*input_sets[position[0]])
    return median_seconds(once, repeats, inner)


def run_greedy(batches: Sequence[int] = BATCHES, spec_lens: Sequence[int] = SPEC_LENS,
               backends: Sequence[str] | None = None, *, repeats: int = 15, inner: int = 20,
               progress: Callable[[str], None] | None = print) -> list[dict]:
    """Median seconds per greedy acceptance call for each (B, k, backend)."""
    rows = []
    configs = [(b, k, be) for b in batches for k in spec_lens for be in backends or default_backends()]
    for i, (batch, k, backend) in enumerate(configs):
        if progress:
            progress(f"[greedy {i + 1}/{len(configs)}] B={batch} k={k} {backend}")
        fn = jax.jit(functools.partial(scv_jax.accept_greedy, max_spec_len=k, backend=backend))
        seconds = _time_rotating(fn, [_greedy_inputs(batch, k, s) for s in range(2)], repeats, inner)
        rows.append(dict(op="greedy", batch=batch, k=k, backend=backend, seconds=seconds))
    return rows


def run_rejection(batches: Sequence[int] = BATCHES, spec_lens: Sequence[int] = SPEC_LENS,
                  vocabs: Sequence[int] = VOCABS, backends: Sequence[str] | None = None, *,
                  repeats: int = 10, inner: int = 5, progress: Callable[[str], None] | None = print
                  ) -> list[dict]:
    """Median seconds per rejection-sampling call for each (B, k, V, backend), with the bandwidth of
    reading p and q (2 * T * V * 4 bytes) once."""
    rows = []
    configs = [(b, k, v, be) for b in batches for k in spec_lens for v in vocabs
               for be in backends or default_backends()]
    for i, (batch, k, vocab, backend) in enumerate(configs):
        if progress:
            progress(f"[rejection {i + 1}/{len(configs)}] B={batch} k={k} V={vocab} {backend}")
        probs_bytes = 2 * batch * k * vocab * 4
        num_sets = max(1, min(4, -(-2 * L2_BYTES // probs_bytes)))
        input_sets = [_rejection_inputs(batch, k, vocab, s) for s in range(num_sets)]
        fn = jax.jit(lambda d, cu, q, p, bo, key, k=k, backend=backend: scv_jax.rejection_sample(
            d, cu, q, p, bo, key=key, max_spec_len=k, backend=backend))
        seconds = _time_rotating(fn, input_sets, repeats, inner)
        del input_sets
        rows.append(dict(op="rejection", batch=batch, k=k, vocab=vocab, backend=backend, seconds=seconds,
                         probs_gbps=probs_bytes / seconds / 1e9))
    return rows


def speedups(rows: list[dict]) -> dict[tuple, float]:
    """XLA seconds / kernel seconds per configuration (where both were timed)."""
    key = lambda r: (r["op"], r["batch"], r["k"], r.get("vocab"))  # noqa: E731
    xla = {key(r): r["seconds"] for r in rows if r["backend"] == "xla"}
    return {key(r): xla[key(r)] / r["seconds"] for r in rows if r["backend"] != "xla" and key(r) in xla}


def markdown_table(rows: list[dict]) -> str:
    ratio = speedups(rows)
    lines = ["| op | B | k | V | backend | µs | p+q GB/s | speed-up vs XLA |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        key = (r["op"], r["batch"], r["k"], r.get("vocab"))
        gbps = f"{r['probs_gbps']:.1f}" if "probs_gbps" in r else ""
        speedup = f"{ratio[key]:.2f}x" if r["backend"] != "xla" and key in ratio else ""
        lines.append(f"| {r['op']} | {r['batch']} | {r['k']} | {r.get('vocab', '')} | {r['backend']} | "
                     f"{r['seconds'] * 1e6:.1f} | {gbps} | {speedup} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU-sized: B <= 64, V = 32k only")
    parser.add_argument("--backends", nargs="*", help="default: pallas and xla on a GPU, xla on CPU")
    parser.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    batches = (1, 8, 64) if args.quick else BATCHES
    vocabs = (32_768,) if args.quick else VOCABS
    rows = run_greedy(batches, backends=args.backends)
    rows += run_rejection(batches, (1, 4) if args.quick else SPEC_LENS, vocabs, backends=args.backends,
                          repeats=3 if args.quick else 10, inner=1 if args.quick else 5)
    command = "python " + " ".join([os.path.relpath(__file__, os.getcwd())] + sys.argv[1:])
    text = results_header("bench_acceptance: greedy and rejection sampling", command,
                          "All requests full (T = B * k); fp32 probabilities; medians of back-to-back calls. ")
    text += markdown_table(rows)
    print(text)
    if args.append:
        append_results(text)


if __name__ == "__main__":
    main()
