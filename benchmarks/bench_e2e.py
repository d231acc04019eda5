"""End-to-end: speculative vs autoregressive tokens/s on the shipped demo models, in one process.

Batch sizes {1, 4, 16}, greedy and temperature 1, fixed k in {2, 4, 8} and adaptive k, the demo draft
model or n-gram prompt lookup (``--ngram``); ``--workloads`` adds ``mixed`` (a batch of 8 mixing
repetitive and free-form prompts) and ``stream`` (32 such requests, 8 running at once: continuous
batching); ``--packed`` runs every speculative mode packed too (``packed_verify``). Each row's
ratio is against autoregressive decoding (same batch, temperature, prompts and cache code);
compilation is excluded (each configuration is warmed up by an untimed call). Each configuration runs
``--repeats`` times, interleaved; rows give the median and the spread, and the host's share of each
step (step wall time - the step's device time). A second table puts each adaptive mode against the
best fixed k of each batch and temperature.

Run: ``JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_e2e.py [--quick] [--ngram] [--workloads stdlib mixed stream]
[--packed] [--append]``
(``scv-jax bench`` runs the same benchmark).
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from harness import RESULTS_PATH  # noqa: E402
from scv_jax.demo.e2e import WORKLOADS, adaptive_summary, format_table, run_e2e, write_results  # noqa: E402
from scv_jax.demo.report import append_markdown  # noqa: E402
from scv_jax.models import load_demo  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="batch 1 only, greedy only")
    parser.add_argument("--ngram", action="store_true", help="draft with n-gram prompt lookup, not the draft model")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=["stdlib"],
                        help="stdlib: batch 1/4/16 x greedy/T=1; mixed: a batch of 8 repetitive and free-form "
                             "prompts; stream: 32 of them, 8 running at once (both greedy)")
    parser.add_argument("--packed", action="store_true",
                        help="also run every speculative mode with packed verification (packed_verify=True)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved timed runs per configuration")
    parser.add_argument("--append", action="store_true", help="append the tables to benchmarks/RESULTS.md")
    args = parser.parse_args()
    target, draft = load_demo()
    batch_sizes, temperatures = ((1,), (0.0,)) if args.quick else ((1, 4, 16), (0.0, 1.0))
    rows = run_e2e(target, draft, batch_sizes=batch_sizes, temperatures=temperatures,
                   max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                   drafter="ngram" if args.ngram else "model", workloads=args.workloads, packed=args.packed)
    table, summary = format_table(rows), adaptive_summary(rows)
    print(f"{table}\n\n{summary}\n(load average {os.getloadavg()[0]:.1f})")
    if args.append:
        command = "JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_e2e.py " + " ".join(sys.argv[1:])
        write_results(RESULTS_PATH, table, command, args.max_new_tokens, args.repeats)
        append_markdown(RESULTS_PATH, f"\nAdaptive vs the best fixed k (load average at the end "
                                      f"{os.getloadavg()[0]:.1f}):\n\n{summary}")


if __name__ == "__main__":
    main()
