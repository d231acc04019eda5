"""bench_suffix's dry runs: the three workloads through every mode (greedy outputs checked against the
target's alone inside the script) and the host-cost table, at tiny sizes."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("flags, rows", [([], 15), (["--host-cost"], 1)], ids=["workloads", "host-cost"])
@pytest.mark.slow
def test_bench_suffix_dry_run(flags, rows):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_suffix.py"), "--dry-run", *flags],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ") and not line.startswith("| workload")
             and not line.startswith("| history")]
    assert len(table) == rows, proc.stdout
    if flags:
        assert "Finished-output cache: 50 requests" in proc.stdout
