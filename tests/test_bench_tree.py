"""bench_tree's dry run: the benchmark's code path (the four acceptance ops, chain vs tree attention) at tiny sizes."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_bench_tree_dry_run():
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_tree.py"), "--dry-run"],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ops = [line.split("|")[1].strip() for line in proc.stdout.splitlines() if line.startswith("| ") and "| 2 | 4 |" in line]
    assert ops == ["accept_tree_greedy", "accept_greedy (chain)", "tree_rejection_sample", "rejection_sample (chain)"]
    attention = [line for line in proc.stdout.splitlines() if line.startswith("| 1 | 32 | 3 |")]
    assert len(attention) == 1 and float(attention[0].split("|")[4]) >= 0
