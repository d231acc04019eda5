"""bench_attention's dry run: the benchmark's code path (timing, chaining, KV bytes, kernel vs XLA error) on
CPU at tiny sizes with the interpret kernel."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_bench_attention_dry_run():
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_attention.py"), "--dry-run",
                           "--cache-dtypes", "fp8"], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| 2 | 96 | 3 |")]
    assert [cells[4].strip() for cells in rows] == ["xla", "interpret"]
    kernel = [cell.strip() for cell in rows[1]]
    assert float(kernel[5]) > 0 and float(kernel[6]) > 0            # µs per call, device µs
    assert float(kernel[7]) > 0                                        # KV MB
    assert float(kernel[-1]) < 1e-2                                    # max |kernel - XLA|
