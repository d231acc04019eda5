"""Chunked prefill's step: the target's forward of a decode verification and of a prefill chunk as two
calls (what the engine runs: ``StepRunner.prefill`` then ``dispatch``) against one packed call over all
their tokens (``Transformer.forward_packed``, which scores rows of any length: a prefill chunk is a row
of C tokens after its cached context, the decode rows k + 1 tokens after theirs).

Per shape (B decoding requests of ``--context`` positions verifying k drafts, one request prefilling a
C-token chunk after ``--prefill-start`` positions) it reports the step's wall time (the best of
``--repeats``, the least disturbed on a shared machine; both calls dispatched back to back and waited
for once, as in a step), the host's dispatch time (until the last
call returns) and device time (``harness.device_seconds``: the calls inside one loop executable, no
host), for:

- separate: ``forward_paged`` of [B, k + 1] tokens + ``forward_paged`` of [1, C] tokens;
- packed: ``forward_packed`` of the B * (k + 1) + C tokens on a [B + 1, max(k + 1, C)] attention grid.

Only the forwards differ between the two designs (commits, acceptance and sampling would be the same
work either way), so the forwards are what is timed; the demo target (6 layers, d_model 384, float32).

    python benchmarks/bench_mixed_step.py --append
    python benchmarks/bench_mixed_step.py --dry-run     # one small shape, nothing appended
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness import device_seconds, publish  # noqa: E402
from scv_jax.models import load_demo  # noqa: E402
from scv_jax.models.protocol import PackedTokens  # noqa: E402
from scv_jax.ops.commit.kv_cache import PagedKVCache  # noqa: E402

BLOCK = 16


def inputs(batch: int, k: int, chunk: int, context: int, prefill_start: int, vocab: int, seed: int = 0) -> dict:
    """The numpy inputs of both designs: each request its own blocks, the prefilling one last."""
    rng = np.random.default_rng(seed)
    width = -(-(max(context + k + 1, prefill_start + chunk)) // BLOCK)
    tables = np.arange((batch + 1) * width, dtype=np.int32).reshape(batch + 1, width)
    decode_tokens = rng.integers(0, vocab, (batch, k + 1)).astype(np.int32)
    chunk_tokens = rng.integers(0, vocab, (1, chunk)).astype(np.int32)
    grid = max(k + 1, chunk)
    rows = np.concatenate([np.repeat(np.arange(batch), k + 1), np.full(chunk, batch)]).astype(np.int32)
    offsets = np.concatenate([np.tile(np.arange(k + 1), batch), np.arange(chunk)]).astype(np.int32)
    return dict(tables=tables, decode_tokens=decode_tokens, chunk_tokens=chunk_tokens,
                decode_lens=np.full(batch, context, np.int32), start=np.array([prefill_start], np.int32),
                packed_tokens=np.concatenate([decode_tokens.reshape(-1), chunk_tokens[0]]), rows=rows, offsets=offsets,
                packed_lens=np.append(np.full(batch, context), prefill_start).astype(np.int32), grid=grid,
                num_blocks=(batch + 1) * width)


def measure(target, batch: int, k: int, chunk: int, context: int, prefill_start: int, repeats: int) -> dict:
    graphdef, state = nnx.split(target)
    cfg = target.config
    x = inputs(batch, k, chunk, context, prefill_start, cfg.vocab_size)
    cache = PagedKVCache.create(cfg.num_layers, x["num_blocks"], BLOCK, cfg.num_kv_heads, cfg.head_dim, dtype=cfg.dtype)
    grid = x["grid"]

    def paged(state, cache, tokens, tables, lens):
        out = nnx.merge(graphdef, state).forward_paged(tokens, cache, tables, lens, backend="xla")
        return out.logits, out.keys, out.values

    def packed(state, cache, tokens, rows, offsets, tables, lens):
        out = nnx.merge(graphdef, state).forward_packed(tokens, PackedTokens(rows, offsets, grid), cache, tables, lens,
                                                        backend="xla")
        return out.logits, out.keys, out.values

    paged_jit, packed_jit = jax.jit(paged), jax.jit(packed)
    put = jax.device_put
    decode_args = (state, cache, put(x["decode_tokens"]), put(x["tables"][:batch]), put(x["decode_lens"]))
    prefill_args = (state, cache, put(x["chunk_tokens"]), put(x["tables"][batch:]), put(x["start"]))
    packed_args = (state, cache, put(x["packed_tokens"]), put(x["rows"]), put(x["offsets"]), put(x["tables"]),
                   put(x["packed_lens"]))
    designs = {
        "separate": (lambda: (paged_jit(*prefill_args), paged_jit(*decode_args)),
                     lambda *a: (paged(*a[:5]), paged(*a[5:])), prefill_args + decode_args),
        "packed": (lambda: packed_jit(*packed_args), packed, packed_args),
    }
    result = {}
    for name, (call, fn, args) in designs.items():
        jax.block_until_ready(call())               # compiles
        walls, dispatches = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            out = call()
            dispatched = time.perf_counter()
            jax.block_until_ready(out)
            walls.append(time.perf_counter() - start)
            dispatches.append(dispatched - start)
        device = device_seconds(fn, args, iterations=5, repeats=3)
        result[name] = (min(walls), float(np.median(dispatches)), device)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--chunks", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--prefill-start", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--append", action="store_true")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    if args.dry_run:
        args.batch_sizes, args.chunks, args.context, args.prefill_start, args.repeats = [2], [16], 32, 16, 3
    target, _ = load_demo()
    lines = ["| B | k | chunk C | separate: wall ms | dispatch ms | device ms | packed: wall ms | dispatch ms | "
             "device ms | packed / separate (wall) |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for chunk in args.chunks:
        for batch in args.batch_sizes:
            r = measure(target, batch, args.k, chunk, args.context, args.prefill_start, args.repeats)
            (sw, sd, sv), (pw, pd, pv) = r["separate"], r["packed"]
            lines.append(f"| {batch} | {args.k} | {chunk} | {sw * 1e3:.2f} | {sd * 1e3:.2f} | {sv * 1e3:.2f} | "
                         f"{pw * 1e3:.2f} | {pd * 1e3:.2f} | {pv * 1e3:.2f} | {pw / sw:.2f}x |")
            print(lines[-1], flush=True)
    details = (f"demo target, decode context {args.context}, prefill chunk after {args.prefill_start} positions, "
               f"blocks of {BLOCK}, backend xla; wall: best of {args.repeats} steps (both calls dispatched, "
               "then waited for once); dispatch: median time until the last call returned; device: the calls inside "
               "one loop executable (harness.device_seconds). ")
    publish(__file__, "Chunked prefill: separate prefill + decode forwards vs one packed forward", details,
            "\n".join(lines) + "\n", append=args.append and not args.dry_run)


if __name__ == "__main__":
    main()
