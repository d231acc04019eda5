"""The EAGLE-3 head's catch-up and prefill forwards with one output row per request
(``Eagle3Head.forward_paged(..., out_rows=)``: every row's K/V, the query, MLP and ``lm_head`` of the
drafting row alone) against the same forward with every row's output, on the demo head (or ``--head``),
float32, in one process, alternating, median of ``--repeats`` calls each.

Widths: the catch-up of chain steps at k = 2, 4, 6 (k + 1 rows per request) and a 48-token prefill chunk.

    python benchmarks/bench_head_rows.py [--batch 4] [--repeats 30] [--head DIR] [--append]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from scv_jax import PagedKVCache  # noqa: E402
from scv_jax.demo.report import append_markdown, results_header  # noqa: E402
from scv_jax.models import load_demo, load_demo_head, load_eagle3  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
WIDTHS = {"catch-up, k=2": 3, "catch-up, k=4": 5, "catch-up, k=6": 7, "prefill chunk": 48}
CONTEXT, BLOCK_SIZE = 64, 16


def call_ms(fn) -> float:
    """Milliseconds of one call of ``fn`` to its result."""
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return 1e3 * (time.perf_counter() - start)


def run(args: argparse.Namespace) -> str:
    target, _ = load_demo()
    head = (load_demo_head(target, dtype="float32") if args.head is None
            else load_eagle3(args.head, target, dtype="float32"))
    graphdef, state = nnx.split(head)
    c, batch = head.config, args.batch
    blocks = (CONTEXT + max(WIDTHS.values())) // BLOCK_SIZE + 1
    cache = PagedKVCache.create(1, batch * blocks, BLOCK_SIZE, c.num_kv_heads, c.head_dim, dtype="float32")
    tables = jnp.arange(batch * blocks, dtype=jnp.int32).reshape(batch, blocks)
    context = jnp.full((batch,), CONTEXT, jnp.int32)
    forward = jax.jit(lambda state, tokens, hidden, rows: nnx.merge(graphdef, state).forward_paged(
        tokens, hidden, cache, tables, context, out_rows=rows))
    every = jax.jit(lambda state, tokens, hidden: nnx.merge(graphdef, state).forward_paged(
        tokens, hidden, cache, tables, context))
    lines = ["| forward | rows per request | one output row (ms) | every row's output (ms) | saved |",
             "|---|---:|---:|---:|---:|"]
    for name, width in WIDTHS.items():
        key = jax.random.key(width)
        tokens = jax.random.randint(key, (batch, width), 0, c.vocab_size, jnp.int32)
        hidden = jax.random.normal(key, (batch, width, c.d_model), jnp.float32)
        rows = jnp.full((batch,), width - 1, jnp.int32)
        calls = (lambda: forward(state, tokens, hidden, rows)), (lambda: every(state, tokens, hidden))
        for fn in calls * 2:                                                          # compile, first runs
            call_ms(fn)
        a, b = (statistics.median(column) for column in zip(*([call_ms(fn) for fn in calls]
                                                               for _ in range(args.repeats))))
        lines.append(f"| {name} | {width} | {a:.3f} | {b:.3f} | {1 - a / b:.0%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--head", help="an EAGLE-3 checkpoint for the demo target (default: the shipped head)")
    parser.add_argument("--append", action="store_true")
    args = parser.parse_args()
    table = run(args)
    print(table)
    if args.append:
        command = "python benchmarks/bench_head_rows.py " + " ".join(sys.argv[1:])
        details = f"Batch {args.batch}, context {CONTEXT}, median of {args.repeats} alternating calls. "
        append_markdown(RESULTS, results_header("EAGLE-3 head: one output row per request", command, details)
                        + table + "\n")


if __name__ == "__main__":
    main()
