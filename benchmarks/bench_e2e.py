"""End-to-end: speculative vs autoregressive tokens/s on the shipped demo models, in one process.

Batch sizes {1, 4, 16}, greedy and temperature 1, fixed k in {2, 4, 8} and adaptive k; each row's
ratio is against autoregressive decoding (same batch, temperature, prompts and cache code).
Compilation is excluded (each configuration is warmed up by an identical untimed call).

Run: ``JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_e2e.py [--quick] [--append]``
(``scv-jax bench`` runs the same benchmark).
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from harness import RESULTS_PATH  # noqa: E402
from scv_jax.demo.e2e import format_table, run_e2e, write_results  # noqa: E402
from scv_jax.models import load_demo  # noqa: E402

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="batch 1 only, greedy only")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    target, draft = load_demo()
    batch_sizes, temperatures = ((1,), (0.0,)) if args.quick else ((1, 4, 16), (0.0, 1.0))
    rows = run_e2e(target, draft, batch_sizes=batch_sizes, temperatures=temperatures,
                   max_new_tokens=args.max_new_tokens)
    table = format_table(rows)
    print(table)
    if args.append:
        command = "JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_e2e.py " + " ".join(sys.argv[1:])
        write_results(RESULTS_PATH, table, command, args.max_new_tokens)


if __name__ == "__main__":
    main()
