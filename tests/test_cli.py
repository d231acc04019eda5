"""The ``scv-jax`` command (demo and bench), on tiny byte-level models for speed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from scv_jax import cli
from scv_jax.models import TransformerConfig
from tests.models.fixtures import tiny_model

BYTE_TARGET = TransformerConfig(vocab_size=256, num_layers=1, d_model=32, num_heads=2, num_kv_heads=1,
                                head_dim=16, ffn_dim=64)


@pytest.fixture
def tiny_demo(monkeypatch):
    target = tiny_model(BYTE_TARGET, seed=0)
    monkeypatch.setattr("scv_jax.models.load_demo", lambda: (target, target))


def test_demo_prints_text_and_table(tiny_demo, capsys):
    assert cli.main(["demo", "--prompt", "def f(x):", "--max-new-tokens", "12", "--k", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def f(x):")
    for row in ("autoregressive", "speculative (k=3)", "speedup", "mean accepted length", "acceptance"):
        assert row in out
    assert "greedy outputs identical  yes" in out


def test_demo_sampling_and_adaptive(tiny_demo, capsys):
    assert cli.main(["demo", "--max-new-tokens", "6", "--temperature", "1.0", "--adaptive"]) == 0
    out = capsys.readouterr().out
    assert "speculative (adaptive k)" in out and "n/a (sampling" in out


def test_bench_appends_table(tiny_demo, capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("scv_jax.demo.e2e.benchmark_prompts", lambda batch, **_: [[100, 101, 102]] * batch)
    results = tmp_path / "RESULTS.md"
    assert cli.main(["bench", "--batch-sizes", "2", "--temperatures", "0", "--modes", "2",
                     "--max-new-tokens", "5", "--append", str(results)]) == 0
    table = capsys.readouterr().out
    assert "| 2 | 0 | autoregressive |" in table and "| 2 | 0 | k=2 |" in table
    assert "End-to-end" in results.read_text() and "| 2 | 0 | k=2 |" in results.read_text()


def test_k_and_adaptive_are_exclusive(capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--k", "2", "--adaptive"])


def test_module_entry_point_help():
    out = subprocess.run([sys.executable, "-m", "scv_jax", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "demo" in out.stdout and "bench" in out.stdout
