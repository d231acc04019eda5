"""End-to-end: speculative vs autoregressive tokens/s on the shipped demo models, in one process.

``scv-jax bench`` (same options, ``--help``) with ``--append`` taking no path: the tables go to
``benchmarks/RESULTS.md``. Batch sizes {1, 4, 16} (``--quick``: 1), greedy and temperature 1, fixed k
in {2, 4, 8} and adaptive k, the demo draft model or n-gram prompt lookup (``--ngram``);
``--workloads`` adds ``mixed`` (a batch of 8 mixing repetitive and free-form prompts) and ``stream``
(32 such requests, 8 running at once: continuous batching); ``--packed`` runs every speculative mode
packed too (``packed_verify``). Each row's ratio is against autoregressive decoding (same batch,
temperature, prompts and cache code); compilation is excluded (each configuration is warmed up by an
untimed call). Each configuration runs ``--repeats`` times, interleaved; rows give the median and the
spread, and the host's share of each step (step wall time - the step's device time). A second table
puts each adaptive mode against the best fixed k of each batch and temperature.

Run: ``JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_e2e.py [--quick] [--ngram] [--workloads stdlib mixed stream]
[--packed] [--batch-sizes B ...] [--temperatures T ...] [--repeats N] [--append]``
"""

from __future__ import annotations

import os
import shlex
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from harness import RESULTS_PATH  # noqa: E402
from scv_jax import cli  # noqa: E402


def main() -> int:
    argv = sys.argv[1:]
    command_line = f"JAX_PLATFORMS={os.environ['JAX_PLATFORMS']} " + shlex.join(["python", "benchmarks/bench_e2e.py",
                                                                               *argv])
    if "--append" in argv:           # here a flag: the repository's results file
        argv = [a for a in argv if a != "--append"] + ["--append", RESULTS_PATH]
    return cli.main(["bench", *argv], command_line=command_line)


if __name__ == "__main__":
    sys.exit(main())
