"""bench_multihost's dry run: 2 processes exchange each kind of step message through the coordination service,
then decode on an engine that process 0 drives, with the tokens of one process."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_multihost_dry_run():
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_multihost.py"), "--dry-run"],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line.split(" | ") for line in proc.stdout.splitlines() if line.startswith("| ")]
    messages = [row for row in rows if row[0][2:].isdigit()]
    assert [row[0] for row in messages] == ["| 0", "| 1", "| 64", "| 256"]
    sizes = [int(row[1].replace(",", "")) for row in messages]
    assert sizes[0] < 64 and sizes[1] < sizes[2] < sizes[3]          # an empty step's message is a few bytes
    decoding = [row for row in rows if row[0] in ("| one process", "| two processes (data across them)")]
    assert len(decoding) == 2 and all(row[-1] == "yes |" for row in decoding), proc.stdout   # the same tokens
