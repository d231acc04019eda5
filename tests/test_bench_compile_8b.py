"""``benchmarks/compile_8b.py --set serve --dry-run``: serve's executables for the abstract 8B target with a
draft model and with an EAGLE-3 head, as the engine enumerates them (nothing compiled)."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_compile_8b_counts_serves_executables_for_both_drafters():
    out = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "compile_8b.py"), "--set", "serve",
                          "--dry-run", "--layers", "per_layer"], capture_output=True, text=True, timeout=600,
                         cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in out.stdout.splitlines()
            if line.startswith(("| draft |", "| eagle3 |"))]
    # serve's defaults: 5 batch buckets x 4 block-table widths of the prefill, the draft's catch-up and the
    # decode steps at k 0 and 4, greedy or sampled, with logprobs or without; serve waits for the two
    # prefills and per k the largest sampled step with logprobs (its stand-in for the other three kinds)
    counts = "200 (40 prefill_step, 160 decode_step) / 10 / 4"
    assert [row[:3] for row in rows] == [["draft", "per_layer", counts], ["eagle3", "per_layer", counts]]
