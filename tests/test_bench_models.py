"""``benchmarks/bench_models.py --dry-run``: the realistic-size benchmark runs end to end on tiny shapes."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_bench_models_dry_run():
    out = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_models.py"), "--dry-run"],
                         capture_output=True, text=True, timeout=600, cwd=REPO,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in out.stdout.splitlines() if line.startswith("| tiny")]
    assert [(r[1].strip(), r[3].strip()) for r in rows] == [("-", "0"), ("2-layer", "2"), ("n-gram", "2")]
    autoregressive, *speculative = rows
    assert autoregressive[7].strip() == "1.00"            # c(0) = 1 by definition
    for row in speculative:
        assert float(row[4]) > 0 and float(row[7]) > 0 and float(row[6]) > 0 and float(row[5]) >= 1.0
