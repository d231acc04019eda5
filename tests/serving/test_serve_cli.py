"""``scv-jax serve``'s argument mistakes: one line on stderr, exit status 2, no traceback."""

from __future__ import annotations

import pytest

from scv_jax import cli
from scv_jax.serving.server import batch_buckets
from tests.models.hub_cache import offline_hub


def _one_line_error(argv: list[str], message: str, capsys) -> None:
    try:
        code = cli.main(argv)
    except SystemExit as exit:     # argparse's own errors
        code = exit.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("argv, message", [
    (["--port", "-1"], "argument --port: must be an int >= 0, got -1"),
    (["--max-num-seqs", "0"], "argument --max-num-seqs: must be an int >= 1, got 0"),
    (["--k", "2", "--adaptive"], "argument --adaptive: not allowed with argument --k"),
    (["--draft", "x", "--ngram"], "argument --ngram: not allowed with argument --draft"),
    (["--ngram", "--suffix"], "argument --suffix: not allowed with argument --ngram"),
    (["--suffix", "--suffix-min-token-prob", "2"], "argument --suffix-min-token-prob: must be a number in [0, 1], got '2'"),
    (["--suffix", "--suffix-max-cached-requests", "-1"],
     "argument --suffix-max-cached-requests: must be an int >= 0, got -1"),
    (["--mesh", "2"], "--mesh must be DATA,MODEL (two ints >= 1, e.g. 1,8), got '2'"),
    (["--max-request-bytes", "0"], "argument --max-request-bytes: must be an int >= 1, got 0"),
    (["--max-prompt-chars", "x"], "argument --max-prompt-chars: must be an int >= 1, got 'x'"),
    (["--shutdown-timeout", "-1"], "argument --shutdown-timeout: must be a finite number >= 0, got '-1'"),
    (["--ngram", "--ngram-min", "3", "--ngram-max", "2"], "--ngram-min (3) must be <= --ngram-max (2)"),
    (["--max-model-len", "4096"], "--max-model-len 4096 exceeds the model's max_position_embeddings 512"),
    # caches that would not fit: the error names the serve flag that sized them
    (["--num-blocks", str(10 ** 10)], "--num-blocks: the KV caches for 160000000000 positions need"),
    (["--max-num-seqs", str(10 ** 9)], "; lower --max-num-seqs or --max-model-len, or pass a smaller --num-blocks"),
])
def test_serve_mistakes_are_one_line_errors(checkpoint, argv, message, capsys):
    _one_line_error(["serve", "--model", str(checkpoint), *argv], message, capsys)


def test_a_directory_without_a_tokenizer(tmp_path, capsys):
    _one_line_error(["serve", "--model", str(tmp_path)], "tokenizer.json not found", capsys)


def test_an_id_not_in_the_cache_offline(monkeypatch, tmp_path, capsys):
    offline_hub(monkeypatch, tmp_path / "hub")
    _one_line_error(["serve", "--model", "org/missing"], "scv-jax serve: error: --model org/missing is not a local "
                    "directory and not (completely) in the Hugging Face cache", capsys)


def test_batch_buckets_end_at_max_num_seqs():
    assert batch_buckets(1) == (1,) and batch_buckets(8) == (1, 2, 4, 8) and batch_buckets(12) == (1, 2, 4, 8, 12)
