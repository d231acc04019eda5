"""benchmarks/bench_peer.py without the peer's torch venv: one line saying what is missing, exit 2."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_peer.py"), *args],
                          capture_output=True, text=True, timeout=300, cwd=REPO, env=dict(os.environ, **env))


def test_without_torch_it_says_so_in_one_line(tmp_path):
    peer = tmp_path / "peer"
    peer.mkdir()
    (peer / "bench_vs_transformers.py").write_text("")
    proc = _run("--peer-dir", str(peer), PEER_TORCH_PYTHON=str(tmp_path / "no-python"))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "torch and transformers are not importable" in proc.stderr


def test_without_the_peer_folder_it_says_so_in_one_line(tmp_path):
    proc = _run("--peer-dir", str(tmp_path / "nowhere"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "transformers_peer" in proc.stderr
