"""The decoding loop's host-cost benchmarks run end to end on small settings and print their tables."""

import os
import subprocess
import sys

import pytest

from tests.benchmark_modules import benchmark_module

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script: str, *args: str) -> list[list[str]]:
    """The markdown rows (cells) that ``benchmarks/<script>`` prints (each row as it is measured, then the
    whole table)."""
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", script), *args], capture_output=True,
                          text=True, timeout=600, cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return [[c.strip() for c in line.split("|")[1:-1]] for line in proc.stdout.splitlines()
            if line.startswith("| ") and line[2].isdigit()]


def test_bench_controller_reports_each_batch_and_mode():
    rows = _run("bench_controller.py", "--steps", "200", "--request-steps", "10")[-4:]
    static = "all (static)"
    assert [tuple(r[:2]) for r in rows] == [("1", static), ("1", "10"), ("64", static), ("64", "10")]
    for *_, median, p90, p99, mean in rows:
        assert 0 < float(median) <= float(p90) <= float(p99) and float(mean) > 0


@pytest.mark.slow
def test_bench_host_step_reports_every_mode():
    rows = _run("bench_host_step.py", "--batch-sizes", "2", "--max-new-tokens", "12", "--repeats", "1",
                "--cold-caches-mb", "0", "4")
    assert len(rows) == 4 and rows[:2] == rows[2:]           # each row as measured, then the table
    assert [r[:2] for r in rows[:2]] == [["2", "0"], ["2", "4"]] and all(len(r) == 7 for r in rows)
    for row in rows[:2]:
        for cell in row[2:6]:                   # "wall (cpu; outside)" microseconds per step, each mode
            wall, cpu, outside = cell.replace("(", "").replace(")", "").replace(";", "").split()
            assert float(wall) > 0 and float(cpu) > 0 and 0 < float(outside) <= float(wall)
        adaptive_wall = float(row[4].split()[0])
        assert 0 < float(row[6]) < adaptive_wall       # the adaptive controller's share of its step


def test_adaptive_summary_compares_with_the_best_fixed_k_round_by_round():
    """The e2e summary picks the fixed k with the best median and divides adaptive's runs by its runs of
    the same round (the machine's load drifts between rounds, alike for every mode of a round)."""
    from scv_jax.demo.e2e import E2ERow, adaptive_summary

    def row(mode, runs):
        return E2ERow("stdlib", "model", 4, 0.0, mode, sorted(runs)[1], (min(runs), max(runs)), 1.0, 1.0, 1.0,
                      True, 1.0, 1.0, tuple(runs))

    lines = adaptive_summary([row("autoregressive", (50, 60, 70)), row("k=2", (100, 90, 120)),
                              row("k=4", (80, 200, 40)), row("adaptive", (110, 80, 60))])
    cells = [c.strip() for c in lines.splitlines()[-1].split("|")[1:-1]]
    # adaptive mode, best fixed k, medians' ratio, min / max, same-round ratios 110/100, 80/90, 60/120
    assert cells[4:] == ["adaptive", "k=2", f"{80 / 100:.2f}", f"{60 / 120:.2f}", "0.89 [0.50-1.10]"]


@pytest.mark.slow
def test_bench_engine_dry_run_reports_every_mode(capsys):
    assert benchmark_module("bench_engine").main(["--dry-run"]) == 0          # in-process: no JAX start-up
    rows = [line for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and not line.startswith("| mode")]
    assert [r.split("|")[1].strip() for r in rows] == ["target only", "draft model k=4", "n-gram k=4",
                                                       "draft model adaptive"]
