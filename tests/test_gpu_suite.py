"""The GPU suite's dry run: the same code path as on an H200, on CPU at tiny sizes (interpret)."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_suite_dry_run(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "gpu_suite.py"), "--dry-run",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "suite.json").read_text())
    assert report["environment"]["launch_floor_us"] > 0 and report["environment"]["copy_gbps"] > 0
    checks = report["checks"]
    assert len(checks) >= 17 and all(c["ok"] for c in checks), checks
    assert {r["op"] for r in report["timings"]["acceptance"]} == {"greedy", "rejection"}
    assert {r["backend"] for r in report["timings"]["commit"]} == {"interpret", "xla"}
    assert {r["backend"] for r in report["timings"]["attention"]} == {"interpret", "xla"}
    assert any(c["check"].startswith("attention") for c in checks)
    assert report["pytest"]["returncode"] == 0
    markdown = (tmp_path / "suite.md").read_text()
    assert "Native correctness" in markdown and "Timings" in markdown
