"""Verification attention: the paged-attention kernel vs the XLA path, bytes of KV read vs time.

For B requests of one context length each, T query tokens (1 = decode, 5 and 9 = verification of 4 and 8
drafts), Llama-8B-like heads (32 query heads, 8 kv heads, head_dim 128, block size 16) and bf16 or fp8-e4m3
(per-tensor scale) caches, times ``scv_jax.paged_attention`` on layer 1 of a 2-layer cache with 8 staged
entries per request, and reports
  * per call: median µs of back-to-back jitted calls (includes the host's dispatch);
  * device time: N dependent calls chained inside one executable (``lax.fori_loop`` feeding the output back
    as a tiny perturbation of q), divided by N;
  * the bytes of K/V the context holds (B * context * kv_heads * head_dim * itemsize * 2), their GB/s at the
    device time and, on a GPU, the share of the measured copy bandwidth, and the speed-up over XLA;
  * the kernel's largest deviation from the XLA path on the benchmark's own inputs.

Run: ``python benchmarks/bench_attention.py [--quick] [--dry-run] [--append]``. On CPU only the XLA path is
timed (``--quick`` keeps sizes a CPU finishes); ``--dry-run`` runs tiny sizes with the interpret backend.
``run(...)`` returns the rows for other scripts (benchmarks/gpu_suite.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import scv_jax
from harness import copy_bandwidth, median_seconds, publish
from scv_jax.ops.registry import cuda_available


@dataclasses.dataclass(frozen=True)
class Shape:
    """Model-side sizes of one benchmark run."""
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    staged: int = 8          # staged entries per request (the draft's in-flight tokens)
    num_layers: int = 2      # the op reads layer 1 (a traced index) of the whole cache


LLAMA_8B = Shape()
TINY = Shape(heads=4, kv_heads=2, head_dim=64, staged=2)
BATCHES = (1, 8, 64)
CONTEXTS = (1024, 4096, 16384, 32768)
TOKENS = (1, 5, 9)
CACHE_DTYPES = ("bfloat16", "fp8")


def default_backends() -> tuple[str, ...]:
    return ("pallas", "xla") if cuda_available() else ("xla",)


def kv_bytes(shape: Shape, batch: int, context: int, cache_dtype: str) -> int:
    """Bytes of K and V the requests' contexts hold (what an ideal kernel reads once)."""
    itemsize = 1 if cache_dtype.startswith("fp8") else 2
    return 2 * batch * context * shape.kv_heads * shape.head_dim * itemsize


def make_inputs(shape: Shape, batch: int, context: int, tokens: int, cache_dtype: str, *, layout: str = "NHD",
                scale_mode: str | None = "default", q_dtype=jnp.bfloat16, ragged: bool = False, seed: int = 0) -> dict:
    """A cache whose blocks are shuffled over the requests, staged and new K/V, and q.

    Contexts are all ``context`` (``ragged``: uniform in [0, context], with request 0 padded: context 0,
    no staged entries, a -1 block table). ``scale_mode`` "default" is "tensor" for fp8, else None.
    """
    key = jax.random.key(seed)
    blocks_per_request = -(-context // shape.block_size)
    num_blocks = max(batch * blocks_per_request, 1)
    if scale_mode == "default":
        scale_mode = "tensor" if cache_dtype.startswith("fp8") else None
    cache = scv_jax.PagedKVCache.create(shape.num_layers, num_blocks, shape.block_size, shape.kv_heads,
                                        shape.head_dim, dtype=cache_dtype, layout=layout, scale_mode=scale_mode)
    pages = lambda k: jax.random.normal(k, cache.k_pages.shape, jnp.float32).astype(cache.dtype)  # noqa: E731
    fields = dict(k_pages=pages(jax.random.fold_in(key, 1)), v_pages=pages(jax.random.fold_in(key, 2)))
    if scale_mode is not None:
        fields.update({name: jax.random.uniform(jax.random.fold_in(key, i), np.shape(cache.k_scale), jnp.float32,
                                                0.5, 1.5) for i, name in ((9, "k_scale"), (10, "v_scale"))})
    cache = cache.replace(**fields)
    tables = jax.random.permutation(jax.random.fold_in(key, 3), num_blocks)[:batch * blocks_per_request]
    tables = tables.reshape(batch, blocks_per_request).astype(jnp.int32)
    context_lens = jnp.full((batch,), context, jnp.int32)
    staged_lens = jnp.full((batch,), shape.staged, jnp.int32)
    if ragged:
        context_lens = jax.random.randint(jax.random.fold_in(key, 11), (batch,), 0, context + 1).at[0].set(0)
        staged_lens = jax.random.randint(jax.random.fold_in(key, 12), (batch,), 0, shape.staged + 1).at[0].set(0)
        tables = tables.at[0].set(-1)
    normal = lambda i, *s: jax.random.normal(jax.random.fold_in(key, i), s, q_dtype)  # noqa: E731
    staged = (shape.num_layers, batch, shape.staged, shape.kv_heads, shape.head_dim)
    return dict(q=normal(4, batch, tokens, shape.heads, shape.head_dim), cache=cache, layer=jnp.int32(1),
                block_tables=tables, context_lens=context_lens, staged_keys=normal(5, *staged),
                staged_values=normal(6, *staged), staged_lens=staged_lens,
                new_keys=normal(7, batch, tokens, shape.kv_heads, shape.head_dim),
                new_values=normal(8, batch, tokens, shape.kv_heads, shape.head_dim))


@functools.cache
def _call(backend: str):
    return jax.jit(functools.partial(scv_jax.paged_attention, backend=backend))


@functools.cache
def _chained(backend: str, steps: int):
    """One executable running ``steps`` dependent calls: q <- q + 1e-3 * output."""
    def chain(q, **rest):
        def step(_, q):
            return q + (1e-3 * scv_jax.paged_attention(q, **rest, backend=backend)).astype(q.dtype)
        return jax.lax.fori_loop(0, steps, step, q)
    return jax.jit(chain)


def time_config(inputs: dict, backend: str, *, repeats: int, inner: int, steps: int) -> tuple[float, float]:
    """(median seconds per call, device seconds per call from ``steps`` chained calls)."""
    call, chained = _call(backend), _chained(backend, steps)
    per_call = median_seconds(lambda: call(**inputs), repeats, inner)
    rest = {k: v for k, v in inputs.items() if k != "q"}
    device = median_seconds(lambda: chained(inputs["q"], **rest), repeats) / steps
    return per_call, device


def run(batches: Sequence[int] = BATCHES, contexts: Sequence[int] = CONTEXTS, tokens: Sequence[int] = TOKENS,
        cache_dtypes: Sequence[str] = CACHE_DTYPES, backends: Sequence[str] | None = None, *,
        shape: Shape = LLAMA_8B, repeats: int = 10, inner: int = 5, steps: int = 20, copy_gbps: float | None = None,
        progress: Callable[[str], None] | None = print) -> list[dict]:
    """Times every (B, context, T, cache dtype, backend).

    Returns one dict per configuration: batch, context, tokens, cache_dtype, backend, call_s, device_s,
    kv_bytes, gbps (KV bytes / device time), with a GPU copy_gbps and pct_copy (``copy_gbps``: measured
    here when None), for kernels max_err (largest |kernel - XLA| on these inputs), and speedup (XLA device
    time / this device time).
    """
    backends = tuple(backends or default_backends())
    if copy_gbps is None and cuda_available():
        copy_gbps = copy_bandwidth() / 1e9
    rows = []
    configs = [(b, c, t, d) for b in batches for c in contexts for t in tokens for d in cache_dtypes]
    for i, (batch, context, num_tokens, dtype) in enumerate(configs):
        inputs = make_inputs(shape, batch, context, num_tokens, dtype, seed=i)
        reference = None
        group = []
        for backend in sorted(backends, key=lambda b: b != "xla"):    # XLA first: the others compare to it
            if progress:
                progress(f"[{i + 1}/{len(configs)}] B={batch} context={context} T={num_tokens} {dtype} {backend}")
            call_s, device_s = time_config(inputs, backend, repeats=repeats, inner=inner, steps=steps)
            row = dict(batch=batch, context=context, tokens=num_tokens, cache_dtype=dtype, backend=backend,
                       call_s=call_s, device_s=device_s, kv_bytes=kv_bytes(shape, batch, context, dtype))
            row["gbps"] = row["kv_bytes"] / device_s / 1e9
            if copy_gbps:
                row["copy_gbps"] = copy_gbps
                row["pct_copy"] = 100 * row["gbps"] / copy_gbps
            output = np.asarray(_call(backend)(**inputs), np.float32)
            if backend == "xla":
                reference = (output, device_s)
            elif reference is not None:
                row["max_err"] = float(np.abs(output - reference[0]).max())
                row["speedup"] = reference[1] / device_s
            group.append(row)
        rows += group
        del inputs
    return rows


def markdown_table(rows: list[dict]) -> str:
    gpu = any("copy_gbps" in r for r in rows)
    head = ("| B | context | T | cache | backend | µs per call | device µs | KV MB | GB/s |"
            + (" % of copy BW |" if gpu else "") + " speed-up vs XLA | max err vs XLA |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        line = (f"| {r['batch']} | {r['context']} | {r['tokens']} | {r['cache_dtype']} | {r['backend']} | "
                f"{r['call_s'] * 1e6:.1f} | {r['device_s'] * 1e6:.1f} | {r['kv_bytes'] / 1e6:.3g} | {r['gbps']:.1f} |")
        if gpu:
            line += f" {r['pct_copy']:.0f}% |"
        line += (f" {r['speedup']:.2f}x |" if "speedup" in r else " |")
        line += (f" {r['max_err']:.1e} |" if "max_err" in r else " |")
        lines.append(line)
    if gpu:
        lines.append(f"\nMeasured device copy bandwidth: {rows[0]['copy_gbps']:.0f} GB/s (read + write).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU-sized: B <= 8, context 1k, T in {1, 9}")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes, interpret kernel and XLA on CPU (checks the script runs)")
    parser.add_argument("--backends", nargs="*", help="default: pallas and xla on a GPU, xla on CPU")
    parser.add_argument("--cache-dtypes", nargs="*", default=list(CACHE_DTYPES), help="bfloat16 and/or fp8")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    if args.dry_run:
        rows = run((2,), (96,), (3,), args.cache_dtypes, args.backends or ("interpret", "xla"), shape=TINY,
                   repeats=1, inner=1, steps=2)
    elif args.quick:
        rows = run((1, 8), (1024,), (1, 9), args.cache_dtypes, args.backends, repeats=args.repeats or 3, inner=1,
                   steps=4)
    else:
        rows = run(cache_dtypes=args.cache_dtypes, backends=args.backends, repeats=args.repeats or 10)
    shape = TINY if args.dry_run else LLAMA_8B
    publish(__file__, "bench_attention: paged verification attention",
            f"{shape.heads} q heads, {shape.kv_heads} kv heads, head_dim {shape.head_dim}, block_size "
            f"{shape.block_size}, {shape.staged} staged entries, bf16 q; fp8 = e4m3 with a per-tensor scale; "
            "device time = chained calls in one executable. ", markdown_table(rows), append=args.append, argv=argv)


if __name__ == "__main__":
    main()
