"""bench_multihost's dry run: 2 processes exchange each kind of step message through the coordination service."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_multihost_dry_run():
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_multihost.py"), "--dry-run"],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line.split(" | ") for line in proc.stdout.splitlines() if line.startswith("| ") and "bytes" not in line]
    assert [row[0] for row in rows] == ["| 0", "| 1", "| 64", "| 256"]
    sizes = [int(row[1].replace(",", "")) for row in rows]
    assert sizes[0] < 64 and sizes[1] < sizes[2] < sizes[3]          # an empty step's message is a few bytes
