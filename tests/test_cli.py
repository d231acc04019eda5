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
    argv = ["bench", "--batch-sizes", "2", "--temperatures", "0", "--modes", "2", "adaptive", "--max-new-tokens", "5",
            "--packed", "--workloads", "stdlib", "stream", "--append", str(results)]
    assert cli.main(argv) == 0
    table = capsys.readouterr().out
    assert "| 2 | 0 | autoregressive |" in table and "| 2 | 0 | k=2 |" in table and "| 2 | 0 | k=2 packed |" in table
    assert "| stream | model | 8 | 0 | k=2 packed |" in table      # 32 requests, 8 running at once
    written = results.read_text()
    assert "End-to-end" in written and "| 2 | 0 | k=2 |" in written and f"`scv-jax {' '.join(argv)}`" in written
    assert "Adaptive vs the best fixed k" in written and "| stdlib | model | 2 | 0 | adaptive packed | k=2" in written


@pytest.mark.parametrize("packed", [[], ["--packed-verify"]], ids=["dense", "packed"])
def test_demo_with_ngram_drafting(tiny_demo, capsys, packed):
    assert cli.main(["demo", "--prompt", "abcabcabcabc", "--max-new-tokens", "10", "--k", "3", "--ngram",
                     "--ngram-max", "2", *packed]) == 0
    out = capsys.readouterr().out
    assert "speculative (k=3, n-gram)" in out and "greedy outputs identical  yes" in out


def test_k_and_adaptive_are_exclusive(capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--k", "2", "--adaptive"])


def test_demo_without_speculation_prints_dashes(tiny_demo, capsys):
    assert cli.main(["demo", "--max-new-tokens", "4", "--k", "0"]) == 0
    acceptance = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("acceptance"))
    assert "nan" not in acceptance and acceptance.split() == ["acceptance", "-", "per", "position:", "-"]


@pytest.mark.parametrize("argv, message", [
    (["demo", "--max-new-tokens", "0"], "argument --max-new-tokens: must be an int >= 1, got 0"),
    (["demo", "--k", "-1"], "argument --k: must be an int >= 0, got -1"),
    (["demo", "--temperature", "-2"], "argument --temperature: must be a finite number >= 0"),
    (["bench", "--batch-sizes", "0"], "argument --batch-sizes: must be an int >= 1, got 0"),
    (["demo", "--prompt", ""], "--prompt must not be empty"),
    (["bench", "--modes", "two"], "--modes: each mode must be a k >= 1 or 'adaptive'"),
    (["bench", "--workloads", "server"], "argument --workloads: invalid choice: 'server'"),
    (["demo", "--ngram", "--ngram-min", "3", "--ngram-max", "2"], "--ngram-min (3) must be <= --ngram-max (2)"),
    (["demo", "--ngram-min", "0"], "argument --ngram-min: must be an int >= 1, got 0"),
])
def test_user_mistakes_are_one_line_errors_before_loading_weights(argv, message, monkeypatch, capsys):
    def no_weights():
        raise AssertionError("weights loaded before the arguments were checked")
    monkeypatch.setattr("scv_jax.models.load_demo", no_weights)
    try:
        code = cli.main(argv)
    except SystemExit as exit:     # argparse's own errors
        code = exit.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err


def test_help_shows_every_default():
    for command, defaults in (("demo", ["192", "6", "0.0", "1", "3"]), ("bench", ["[1, 4, 16]", "96", "3"])):
        out = subprocess.run([sys.executable, "-m", "scv_jax", command, "--help"], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0
        text = " ".join(out.stdout.split())
        assert all(f"(default: {d})" in text for d in defaults), text


def test_module_entry_point_help():
    out = subprocess.run([sys.executable, "-m", "scv_jax", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "demo" in out.stdout and "bench" in out.stdout


FIXTURE = "tests/models/hf_fixtures/qwen2"


def test_generate_continues_text_with_a_checkpoint(capsys):
    argv = ["generate", "--model", FIXTURE, "--draft", FIXTURE, "--prompt", "hello", "--max-new-tokens", "8",
            "--dtype", "float32", "--k", "3", "--compare"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("hello") and "speculative (k=3)" in out and "speedup" in out
    assert "greedy outputs identical  yes" in out


def test_generate_mistakes_are_one_line_errors(capsys, monkeypatch, tmp_path):
    assert cli.main(["generate", "--model", str(tmp_path), "--prompt", "x"]) == 2
    assert "tokenizer.json not found" in capsys.readouterr().err
    small = {FIXTURE: tiny_model(BYTE_TARGET), "other": tiny_model(TransformerConfig(vocab_size=300))}
    monkeypatch.setattr("scv_jax.models.load_hf", lambda path, dtype: small[path])
    assert cli.main(["generate", "--model", FIXTURE, "--draft", "other", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--draft other has vocab_size 300" in err and "must share the vocabulary" in err
