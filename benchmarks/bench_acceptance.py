"""Acceptance ops: Pallas kernels vs the XLA reference, per call and device time.

* greedy (from target ids): B requests x k drafts.
* greedy from logits: ``accept_greedy_from_logits`` (argmax fused into the acceptance, [T, V] read
  once) against "argmax then accept" (``jnp.argmax`` + ``accept_greedy``) on the same backend.
* rejection sampling with draft probabilities, fp32 [T, V] p and q; reports the memory floor, a jitted
  ``sum(p) + sum(q)`` over the same arrays (the cost of reading p and q once), and the nominal p+q
  bandwidth 2 * T * V * 4 bytes / time. The implementations race only each request's rejected row,
  so they read fewer bytes than that (``rows`` is how many rows they raced).
Per call: median of back-to-back jitted calls (host dispatch included). Device: ``harness.device_seconds``
(dependent calls chained inside one executable, no dispatch). On CPU only the XLA path is timed by
default (use --quick for sizes a CPU finishes).

Run: ``python benchmarks/bench_acceptance.py [--quick] [--append]``.
``run_greedy`` / ``run_greedy_logits`` / ``run_rejection`` return rows for benchmarks/gpu_suite.py.
"""

from __future__ import annotations

import argparse
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import scv_jax
from harness import device_seconds, median_seconds, publish
from scv_jax.ops.registry import cuda_available

GREEDY_CONFIGS = tuple((b, k) for b in (1, 8, 64, 256) for k in (1, 4, 8))
# (B, k, V): the vLLM peer benchmark's sizes (../shared/bench/vllm_peer_ab.py) and two more.
VOCAB_CONFIGS = ((1, 4, 32_000), (64, 4, 32_000), (256, 8, 32_000), (32, 8, 152_064), (256, 8, 152_064),
                 (8, 4, 151_936), (64, 4, 151_936))
QUICK_GREEDY = tuple((b, k) for b in (1, 8, 64) for k in (1, 4))
QUICK_VOCAB = ((1, 4, 32_768), (8, 4, 32_768), (64, 4, 32_768), (8, 4, 151_936))
L2_BYTES = 60 << 20   # H200's L2; rotating input sets exceed it twice over
Progress = Callable[[str], None] | None


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


def rejection_inputs(batch: int, k: int, vocab: int, seed: int):
    """Rejection-sampling inputs for ``batch`` requests of ``k`` drafts over ``vocab``, made on the device."""
    key = jax.random.key(seed)
    t = batch * k
    q = _probs(jax.random.fold_in(key, 1), (t, vocab))
    p = _probs(jax.random.fold_in(key, 2), (t, vocab))
    draft = jax.random.categorical(jax.random.fold_in(key, 3), jnp.log(q)).astype(jnp.int32)
    cu = jnp.arange(batch + 1, dtype=jnp.int32) * k
    return draft, cu, q, p, jnp.zeros((batch,), jnp.int32), jax.random.split(jax.random.fold_in(key, 4), batch)


def logits_inputs(batch: int, k: int, vocab: int, seed: int):
    """Target logits [T, V] and drafts equal to their argmax 70% of the time."""
    key = jax.random.key(seed)
    t = batch * k
    logits = jax.random.normal(key, (t, vocab), jnp.float32)
    mismatch = jax.random.uniform(jax.random.fold_in(key, 1), (t,)) < 0.3
    top = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    draft = jnp.where(mismatch, (top + 1) % vocab, top)
    return draft, jnp.arange(batch + 1, dtype=jnp.int32) * k, logits, jnp.zeros((batch,), jnp.int32)


def _num_sets(num_bytes: int) -> int:
    return max(1, min(4, -(-2 * L2_BYTES // max(num_bytes, 1))))


def _time(fn: Callable, input_sets: list, *, repeats: int, inner: int, device_iterations: int) -> dict:
    """Per-call seconds (rotating input sets, back-to-back dispatch) and device seconds (first set)."""
    position = [0]

    def once():
        position[0] = (position[0] + 1) % len(input_sets)
        return fn(*input_sets[position[0]])
    row = dict(seconds=median_seconds(once, repeats, inner))
    if device_iterations:
        row["device_seconds"] = device_seconds(fn, input_sets[0], iterations=device_iterations, repeats=repeats)
    return row


def _log(progress: Progress, message: str) -> None:
    if progress:
        progress(message)


def run_greedy(configs: Sequence[tuple[int, int]] = GREEDY_CONFIGS, backends: Sequence[str] | None = None, *,
               repeats: int = 15, inner: int = 20, device_iterations: int = 20, progress: Progress = print
               ) -> list[dict]:
    """Greedy acceptance from target ids, per (B, k, backend)."""
    rows = []
    jobs = [(b, k, be) for b, k in configs for be in backends or default_backends()]
    for i, (batch, k, backend) in enumerate(jobs):
        _log(progress, f"[greedy {i + 1}/{len(jobs)}] B={batch} k={k} {backend}")
        fn = functools.partial(scv_jax.accept_greedy, max_spec_len=k, backend=backend)
        timing = _time(jax.jit(fn), [_greedy_inputs(batch, k, s) for s in range(2)], repeats=repeats, inner=inner,
                       device_iterations=device_iterations)
        rows.append(dict(op="greedy", batch=batch, k=k, backend=backend, **timing))
    return rows


def _argmax_then_accept(draft, cu, logits, bonus, *, max_spec_len: int, backend: str):
    target = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return scv_jax.accept_greedy(draft, cu, target, bonus, max_spec_len=max_spec_len, backend=backend)


def run_greedy_logits(configs: Sequence[tuple[int, int, int]] = VOCAB_CONFIGS, backends: Sequence[str] | None = None,
                      *, repeats: int = 10, inner: int = 5, device_iterations: int = 20,
                      progress: Progress = print) -> list[dict]:
    """Greedy acceptance from fp32 logits [T, V]: fused vs argmax-then-accept, per (B, k, V, backend),
    with the memory floor (a jitted ``sum(logits)``) and the logits bandwidth 4 * T * V / time."""
    rows = []
    jobs = [(b, k, v, be) for b, k, v in configs for be in backends or default_backends()]
    for i, (batch, k, vocab, backend) in enumerate(jobs):
        _log(progress, f"[greedy-logits {i + 1}/{len(jobs)}] B={batch} k={k} V={vocab} {backend}")
        num_bytes = batch * k * vocab * 4
        input_sets = [logits_inputs(batch, k, vocab, s) for s in range(_num_sets(num_bytes))]
        timings = dict(repeats=repeats, inner=inner, device_iterations=device_iterations)
        floor = _time(jax.jit(lambda d, cu, lg, bo: jnp.sum(lg)), input_sets, **timings)
        for variant, op in (("fused", scv_jax.accept_greedy_from_logits), ("argmax+accept", _argmax_then_accept)):
            fn = jax.jit(functools.partial(op, max_spec_len=k, backend=backend))
            row = dict(op="greedy-logits", variant=variant, batch=batch, k=k, vocab=vocab, backend=backend,
                       bytes=num_bytes, **_time(fn, input_sets, **timings))
            rows.append(_with_floor(row, floor))
        del input_sets
    return rows


def _with_floor(row: dict, floor: dict) -> dict:
    row["floor_seconds"] = floor["seconds"]
    if "device_seconds" in floor:
        row["floor_device_seconds"] = floor["device_seconds"]
    row["gbps"] = row["bytes"] / (row.get("device_seconds") or row["seconds"]) / 1e9
    return row


def run_rejection(configs: Sequence[tuple[int, int, int]] = VOCAB_CONFIGS, backends: Sequence[str] | None = None,
                  *, repeats: int = 10, inner: int = 5, device_iterations: int = 20,
                  progress: Progress = print) -> list[dict]:
    """Rejection sampling with fp32 draft probabilities per (B, k, V, backend), with the memory floor
    (a jitted ``sum(p) + sum(q)``) and the nominal p+q bandwidth 2 * T * V * 4 / time."""
    rows = []
    jobs = [(b, k, v, be) for b, k, v in configs for be in backends or default_backends()]
    for i, (batch, k, vocab, backend) in enumerate(jobs):
        _log(progress, f"[rejection {i + 1}/{len(jobs)}] B={batch} k={k} V={vocab} {backend}")
        num_bytes = 2 * batch * k * vocab * 4
        input_sets = [rejection_inputs(batch, k, vocab, s) for s in range(_num_sets(num_bytes))]
        timings = dict(repeats=repeats, inner=inner, device_iterations=device_iterations)
        floor = _time(jax.jit(lambda d, cu, q, p, bo, key: jnp.sum(p) + jnp.sum(q)), input_sets, **timings)
        fn = jax.jit(lambda d, cu, q, p, bo, key, k=k, backend=backend: scv_jax.rejection_sample(
            d, cu, q, p, bo, key=key, max_spec_len=k, backend=backend))
        result = fn(*input_sets[0])
        rows_raced = int(np.sum(np.asarray(result.num_accepted) < k))
        row = dict(op="rejection", batch=batch, k=k, vocab=vocab, backend=backend, bytes=num_bytes,
                   rows=rows_raced, **_time(fn, input_sets, **timings))
        rows.append(_with_floor(row, floor))
        del input_sets
    return rows


def row_key(r: dict) -> tuple:
    """What identifies a result row's configuration: (op, variant, batch, k, vocab)."""
    return r["op"], r.get("variant"), r["batch"], r["k"], r.get("vocab")


def speedups(rows: list[dict], field: str = "seconds") -> dict[tuple, float]:
    """XLA ``field`` / kernel ``field`` per configuration (where both were timed)."""
    xla = {row_key(r): r[field] for r in rows if r["backend"] == "xla" and field in r}
    return {row_key(r): xla[row_key(r)] / r[field] for r in rows
            if r["backend"] != "xla" and row_key(r) in xla and r.get(field)}


def fused_speedups(rows: list[dict], field: str = "seconds") -> dict[tuple, float]:
    """Greedy from logits: "argmax+accept" ``field`` / "fused" ``field`` per (B, k, V, backend)."""
    key = lambda r: (r["batch"], r["k"], r["vocab"], r["backend"])  # noqa: E731
    separate = {key(r): r.get(field) for r in rows if r.get("variant") == "argmax+accept"}
    return {key(r): separate[key(r)] / r[field] for r in rows
            if r.get("variant") == "fused" and r.get(field) and separate.get(key(r))}


def ratio_text(ratios: tuple[dict, dict], key: tuple) -> str:
    """``key``'s ratio in each of two ratio tables, as "1.23x / 4.56x" (a table without it left out)."""
    text = f"{ratios[0][key]:.2f}x" if key in ratios[0] else ""
    return text + (f" / {ratios[1][key]:.2f}x" if key in ratios[1] else "")


def _us(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e6:.1f}"


def markdown_table(rows: list[dict]) -> str:
    """One line per row: per-call and device µs, multiples of the memory floor, bandwidth, speed-ups
    (kernel vs XLA; fused greedy vs argmax then accept), each as "per call / device"."""
    vs_xla = speedups(rows), speedups(rows, "device_seconds")
    vs_separate = fused_speedups(rows), fused_speedups(rows, "device_seconds")
    lines = ["| op | B | k | V | backend | µs per call | device µs | x floor | GB/s | vs XLA | "
             "fused vs argmax+accept |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        dev = r.get("device_seconds")
        floor = f"{r['seconds'] / r['floor_seconds']:.1f}" if "floor_seconds" in r else ""
        if floor and dev and r.get("floor_device_seconds"):
            floor += f" / {dev / r['floor_device_seconds']:.1f}"
        kernel_row = r["backend"] != "xla"
        fused = ratio_text(vs_separate, (r["batch"], r["k"], r.get("vocab"), r["backend"])) if r.get("variant") == "fused" else ""
        gbps = f"{r['gbps']:.1f}" if "gbps" in r else ""
        name = r["op"] + (f" ({r['variant']})" if "variant" in r else "")
        lines.append(f"| {name} | {r['batch']} | {r['k']} | {r.get('vocab', '')} | {r['backend']} | "
                     f"{_us(r['seconds'])} | {_us(dev)} | {floor} | {gbps} | "
                     f"{ratio_text(vs_xla, row_key(r)) if kernel_row else ''} | {fused} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU-sized configurations")
    parser.add_argument("--backends", nargs="*", help="default: pallas and xla on a GPU, xla on CPU")
    parser.add_argument("--device-iterations", type=int, default=None,
                        help="chained calls per device-time sample (0: per-call only); default 20 (10 with --quick)")
    parser.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    iterations = args.device_iterations if args.device_iterations is not None else (10 if args.quick else 20)
    repeats = 5 if args.quick else 10
    greedy = QUICK_GREEDY if args.quick else GREEDY_CONFIGS
    vocab = QUICK_VOCAB if args.quick else VOCAB_CONFIGS
    rows = run_greedy(greedy, args.backends, device_iterations=iterations)
    rows += run_greedy_logits(vocab, args.backends, repeats=repeats, inner=1 if args.quick else 5,
                              device_iterations=iterations)
    rows += run_rejection(vocab, args.backends, repeats=repeats, inner=1 if args.quick else 5,
                          device_iterations=iterations)
    publish(__file__, "bench_acceptance: greedy, greedy from logits and rejection sampling",
            "All requests full (T = B * k); fp32 logits / probabilities. Per call: median of back-to-back "
            "calls; device: chained calls in one executable. Floor: a jitted sum over the same [T, V] arrays "
            "(read once), timed the same way. ", markdown_table(rows), append=args.append)


if __name__ == "__main__":
    main()
