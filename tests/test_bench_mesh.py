"""bench_mesh's dry run: tiny models on 4 CPU devices, every placement choice, same tokens as one device."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_bench_mesh_dry_run():
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_mesh.py"), "--dry-run"],
                          capture_output=True, text=True, timeout=900, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "mesh" not in line]
    table = rows[-4:]
    assert [row.split(" | ")[:3] for row in table] == [
        ["| one device", "-", "-"], ["| 2 x 2", "replicated", "vocab-parallel"],
        ["| 2 x 2", "replicated", "replicated"], ["| 2 x 2", "model", "vocab-parallel"]]
    assert all(row.endswith("| yes |") for row in table)
