"""Speculation-length policies in simulation: fixed k (every k), the adaptive controller, oracle.

Runs the scenarios of ``adaptive_sim.standard_scenarios`` (stationary, per-position decaying,
drifting, bursty, a load spike, mixed requests; draft/target cost ratio c from 0.02 to 0.3; batch-dependent
target cost where noted), prints a markdown table of throughput (emitted tokens per simulated second)
relative to the oracle, and saves a plot of k and throughput over time (benchmarks/adaptive_sim.png).
Deterministic (seeded) and host-only (numpy); no device is used, so the numbers hold on any machine.
``--shared-machine`` has the adaptive controller measure its steps as on a busy shared machine (drifting
load, jitter, pauses: ``adaptive_sim.SharedMachineTimer``; the median of 3 noise seeds).

Run: ``.venv/bin/python benchmarks/sim_adaptive.py [--ticks 2000] [--seed 0] [--shared-machine] [--append] [--plot PATH]``
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

import numpy as np

from scv_jax import AdaptiveController
from adaptive_sim import (K_MAX, FixedPolicy, OraclePolicy, Scenario, SharedMachineTimer, Trace, simulate,
                          standard_scenarios)

HERE = os.path.dirname(os.path.abspath(__file__))
ADAPTIVE = {"adaptive": lambda: AdaptiveController()}  # column -> controller factory
PLOTTED = ("drifting", "bursty", "load spike")


def run_scenario(scenario: Scenario, seed: int, shared_machine: bool = False) -> dict[str, Trace]:
    traces = {"oracle": simulate(OraclePolicy(scenario), scenario, seed)}
    traces.update({f"k={k}": simulate(FixedPolicy(k), scenario, seed) for k in range(K_MAX + 1)})
    for name, make in ADAPTIVE.items():
        if shared_machine:   # the run of median throughput over 3 noise seeds
            runs = sorted((simulate(SharedMachineTimer(make(), s), scenario, seed) for s in range(3)),
                          key=lambda trace: trace.throughput)
            traces[name] = runs[1]
        else:
            traces[name] = simulate(make(), scenario, seed)
    return traces


def table(results: dict[str, dict[str, Trace]]) -> str:
    fixed = [f"k={k}" for k in range(K_MAX + 1)]
    header = ["scenario", "oracle tok/s", *fixed, "best fixed", *ADAPTIVE]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, traces in results.items():
        oracle = traces["oracle"].throughput
        ratio = {key: trace.throughput / oracle for key, trace in traces.items()}
        best = max(fixed, key=ratio.get)
        cells = [f"**{ratio[k]:.3f}**" if k == best else f"{ratio[k]:.3f}" for k in fixed]
        adaptive = [f"{ratio[key]:.3f}" for key in ADAPTIVE]
        lines.append(f"| {name} | {oracle:.0f} | " + " | ".join(cells) + f" | {ratio[best]:.3f} ({best}) | "
                     + " | ".join(adaptive) + " |")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Trace]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = [name for name in results if name.startswith(PLOTTED)]
    fig, axes = plt.subplots(2, len(chosen), figsize=(4.2 * len(chosen), 5.2), sharex="col")
    for column, name in enumerate(chosen):
        traces = results[name]
        oracle = traces["oracle"].throughput
        best = max((f"k={k}" for k in range(K_MAX + 1)), key=lambda key: traces[key].throughput)
        bin_seconds = traces["oracle"].seconds.sum() / 40
        for key, style in (("oracle", "k-"), ("adaptive", "C0-"), (best, "C2:")):
            trace = traces[key]
            bins = (trace.start // bin_seconds).astype(np.int64)
            mean_k = np.bincount(bins, weights=trace.k) / np.maximum(np.bincount(bins), 1)
            centres = (np.arange(mean_k.size) + 0.5) * bin_seconds
            axes[0, column].plot(centres, mean_k, style, lw=1.2, label=key if key != best else f"best fixed {key}")
            axes[1, column].plot(*trace.binned_throughput(bin_seconds), style, lw=1.2)
        axes[0, column].set_title(name, fontsize=8)
        axes[0, column].set_ylabel("k (mean per bin)", fontsize=8)
        axes[1, column].set_ylabel("tokens / s", fontsize=8)
        axes[1, column].set_xlabel(f"simulated seconds (oracle {oracle:.0f} tok/s)", fontsize=8)
        axes[0, column].legend(fontsize=7, loc="best")
    for ax in axes.flat:
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ticks", type=int, default=2000, help="scenario length in batch-1 target forwards")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shared-machine", action="store_true",
                        help="the adaptive controller measures step times as on a busy shared machine")
    parser.add_argument("--plot", default=os.path.join(HERE, "adaptive_sim.png"))
    parser.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    start = time.perf_counter()
    results = {}
    for scenario in standard_scenarios(args.ticks, args.seed):
        results[scenario.name] = run_scenario(scenario, args.seed, args.shared_machine)
        print(f"[{time.perf_counter() - start:5.1f}s] {scenario.name}", file=sys.stderr, flush=True)
    markdown = table(results)
    print(markdown)
    plot(results, args.plot)
    print(f"plot: {args.plot} ({os.path.getsize(args.plot) // 1024} KB); {time.perf_counter() - start:.1f}s",
          file=sys.stderr)
    if args.append:
        command = "python benchmarks/sim_adaptive.py " + " ".join(sys.argv[1:])
        with open(os.path.join(HERE, "RESULTS.md"), "a") as results_file:
            results_file.write(
                f"\n## Adaptive speculation length (simulation), {datetime.date.today()}\n\n"
                f"Machine: {os.cpu_count()}-core CPU ({platform.machine()}), no GPU; host-only numpy "
                f"{np.__version__} simulation (no jax), seed {args.seed}, {args.ticks} ticks per scenario"
                f"{'; shared-machine step timings (median of 3 noise seeds)' if args.shared_machine else ''}. "
                f"Command: `{command}`\n"
                "Throughput (emitted tokens / simulated second) relative to the oracle (knows the true "
                "acceptance and cost each step); bold: best fixed k. Acceptance 0.58/0.34/... is read as "
                "marginal per-position rates.\n\n" + markdown + "\n")


if __name__ == "__main__":
    main()
