"""No write on reject: commit-accepted-only vs write-all, Pallas kernel vs XLA scatter, bytes vs time.

For T staged tokens (32 layers, 8 kv heads, head_dim 128 by default; bf16 and fp8-e4m3 caches with a
per-tensor scale) and acceptance rates 0.3/0.6/0.9, times a donated (in-place) ``commit_draft_kv`` that
writes
  * only the accepted tokens (``accept_mask``; the NWOR design), and
  * all T tokens (``accept_mask=None``; the baseline that writes rejected drafts too),
per call (back-to-back donated calls, host dispatch included) and, with ``device_iterations``, as
device time (``harness.device_seconds``: dependent commits chained in one executable), and reports
the bytes each moves (reads of the written tokens' staged K/V + writes to the cache), the achieved
bandwidth, and on a GPU its share of the measured device copy bandwidth.

Run: ``.venv/bin/python benchmarks/bench_commit.py [--quick] [--append]`` (CPU: XLA only).
``run(sizes, backends)`` returns the rows for other scripts (benchmarks/gpu_suite.py).
"""

from __future__ import annotations

import argparse
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import scv_jax
from harness import copy_bandwidth, device_seconds, median_seconds, publish
from scv_jax.ops.registry import cuda_available

LAYERS, HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
CACHE_DTYPES = ("bfloat16", "fp8")
ACCEPTANCE = (0.3, 0.6, 0.9)
INPUT_DTYPE = jnp.bfloat16


def bytes_moved(num_written: int, cache_dtype: str, layers: int = LAYERS, heads: int = HEADS,
                head_dim: int = HEAD_DIM) -> int:
    """Reads of the written tokens' staged K and V plus writes of their cache entries (all layers)."""
    elements = 2 * layers * num_written * heads * head_dim
    cache_itemsize = 1 if cache_dtype.startswith("fp8") else 2
    return elements * (jnp.dtype(INPUT_DTYPE).itemsize + cache_itemsize)


def time_commit(num_tokens: int, cache_dtype: str, backend: str, accept_mask: np.ndarray | None,
                repeats: int, seed: int = 0, inner: int = 1, *, layers: int = LAYERS, heads: int = HEADS,
                head_dim: int = HEAD_DIM, device_iterations: int = 0) -> tuple[float, float | None]:
    """Median seconds of one donated commit of T tokens (``accept_mask`` None: all written) per call
    and, with ``device_iterations``, on the device (else None); the cache holds 2 * T slots, rounded up
    to blocks."""
    rng = np.random.default_rng(seed)
    num_blocks = -(-2 * num_tokens // BLOCK_SIZE)
    scale_mode = "tensor" if cache_dtype.startswith("fp8") else None
    cache = scv_jax.PagedKVCache.create(layers, num_blocks, BLOCK_SIZE, heads, head_dim, dtype=cache_dtype,
                                        scale_mode=scale_mode, k_scale=0.05 if scale_mode else None)
    shape = (layers, num_tokens, heads, head_dim)
    keys = jax.random.normal(jax.random.key(seed), shape, INPUT_DTYPE)
    values = jax.random.normal(jax.random.key(seed + 1), shape, INPUT_DTYPE)
    slots = jnp.asarray(rng.permutation(num_blocks * BLOCK_SIZE)[:num_tokens], jnp.int32)
    mask = None if accept_mask is None else jnp.asarray(accept_mask)
    op = functools.partial(scv_jax.commit_draft_kv, backend=backend)
    commit = jax.jit(op, donate_argnums=0)
    holder = [jax.block_until_ready(commit(cache, keys, values, slots, mask))]   # compile + warm up

    def once():
        holder[0] = commit(holder[0], keys, values, slots, mask)
        return holder[0]
    per_call = median_seconds(once, repeats, inner)
    if not device_iterations:
        return per_call, None
    return per_call, device_seconds(op, (holder[0], keys, values, slots, mask), updates_first_arg=True,
                                    iterations=device_iterations, repeats=repeats)


def run(sizes: Sequence[int] = (16, 256, 4096), backends: Sequence[str] | None = None, *,
        cache_dtypes: Sequence[str] = CACHE_DTYPES, acceptance: Sequence[float] = ACCEPTANCE,
        repeats: int = 20, inner: int = 1, layers: int = LAYERS, heads: int = HEADS, head_dim: int = HEAD_DIM,
        device_iterations: int = 0, progress: Callable[[str], None] | None = print) -> list[dict]:
    """Times every (T, cache dtype, backend, acceptance) for accepted-only and write-all commits.

    Args:
      sizes: token counts T.
      acceptance: acceptance rates; 1.0 times the write-all commit only.
      backends: default ("pallas", "xla") with a CUDA GPU, else ("xla",).
      inner: calls dispatched back to back per timing sample (amortises the host's wait).
      layers, heads, head_dim: the cache shape.
      device_iterations: chained commits per device-time sample (0: per-call time only).
    Returns:
      One dict per configuration: tokens, layers, heads, head_dim, cache_dtype, backend, acceptance,
      written (accepted tokens), accepted_s / all_s (median seconds per call), accepted_device_s /
      all_device_s (with device_iterations), accepted_bytes / all_bytes, accepted_gbps / all_gbps (from
      device time when measured), and with a GPU copy_gbps and accepted_pct_copy.
    """
    backends = tuple(backends or (("pallas", "xla") if cuda_available() else ("xla",)))
    copy_gbps = copy_bandwidth() / 1e9 if cuda_available() else None
    rows = []
    configs = [(t, d, b, a) for t in sizes for d in cache_dtypes for b in backends for a in acceptance]
    for i, (tokens, dtype, backend, rate) in enumerate(configs):
        if progress:
            progress(f"[{i + 1}/{len(configs)}] T={tokens} {dtype} {backend} acceptance={rate}")
        accept_mask = np.random.default_rng(i).random(tokens) < rate
        written = int(accept_mask.sum())
        shape = dict(layers=layers, heads=heads, head_dim=head_dim)
        timing = dict(repeats=repeats, inner=inner, device_iterations=device_iterations, **shape)
        all_s, all_device_s = time_commit(tokens, dtype, backend, None, **timing)
        accepted_s, accepted_device_s = (all_s, all_device_s) if rate >= 1.0 else time_commit(
            tokens, dtype, backend, accept_mask, **timing)
        row = dict(tokens=tokens, **shape, cache_dtype=dtype, backend=backend, acceptance=rate, written=written,
                   accepted_s=accepted_s, all_s=all_s, accepted_bytes=bytes_moved(written, dtype, **shape),
                   all_bytes=bytes_moved(tokens, dtype, **shape))
        if device_iterations:
            row.update(accepted_device_s=accepted_device_s, all_device_s=all_device_s)
        for kind in ("accepted", "all"):
            row[f"{kind}_gbps"] = row[f"{kind}_bytes"] / (row.get(f"{kind}_device_s") or row[f"{kind}_s"]) / 1e9
        if copy_gbps:
            row["copy_gbps"] = copy_gbps
            row["accepted_pct_copy"] = 100 * row["accepted_gbps"] / copy_gbps
        rows.append(row)
    return rows


def _device_us(r: dict) -> str:
    if "all_device_s" not in r:
        return ""
    return f" {r['accepted_device_s'] * 1e6:.1f} / {r['all_device_s'] * 1e6:.1f} |"


def markdown_table(rows: list[dict]) -> str:
    gpu = any("copy_gbps" in r for r in rows)
    device = any("all_device_s" in r for r in rows)
    head = ("| T | cache | backend | accept | written | accepted-only µs | write-all µs | speed-up | "
            + ("device µs (acc/all) | " if device else "") + "MB moved (acc/all) | GB/s (acc/all) |"
            + (" % of copy BW |" if gpu else ""))
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        line = (f"| {r['tokens']} | {r['cache_dtype']} | {r['backend']} | {r['acceptance']:.1f} | {r['written']} | "
                f"{r['accepted_s'] * 1e6:.1f} | {r['all_s'] * 1e6:.1f} | {r['all_s'] / r['accepted_s']:.2f}x |"
                f"{_device_us(r)} "
                f"{r['accepted_bytes'] / 1e6:.1f} / {r['all_bytes'] / 1e6:.1f} | "
                f"{r['accepted_gbps']:.1f} / {r['all_gbps']:.1f} |")
        if gpu:
            line += f" {r['accepted_pct_copy']:.0f}% |"
        lines.append(line)
    if gpu:
        lines.append(f"\nMeasured device copy bandwidth: {rows[0]['copy_gbps']:.0f} GB/s.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T in {16, 256} only, fewer repeats (CPU)")
    parser.add_argument("--sizes", type=int, nargs="*", help="token counts T (default 16 256 4096)")
    parser.add_argument("--backends", nargs="*", help="default: pallas and xla on a GPU, xla on CPU")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--device-iterations", type=int, default=0,
                        help="also time chained commits in one executable (device time); 0: off")
    parser.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    sizes = args.sizes or ((16, 256) if args.quick else (16, 256, 4096))
    repeats = args.repeats or (5 if args.quick else 20)
    rows = run(sizes, args.backends, repeats=repeats, device_iterations=args.device_iterations)
    publish(__file__, "bench_commit: NWOR commit, accepted-only vs write-all",
            f"{LAYERS} layers, {HEADS} kv heads, head_dim {HEAD_DIM}, bf16 inputs, block_size {BLOCK_SIZE}, "
            f"donated cache, median of {repeats}. ", markdown_table(rows), append=args.append)


if __name__ == "__main__":
    main()
