"""``scv-jax serve``'s argument mistakes: one line on stderr, exit status 2, no traceback."""

from __future__ import annotations

import argparse
import types

import pytest

from scv_jax import cli, launch
from scv_jax.serving.server import batch_buckets, pool_blocks
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
    (["--max-num-batched-tokens", "0"], "argument --max-num-batched-tokens: must be an int >= 1, got 0"),
    (["--max-prompt-chars", "x"], "argument --max-prompt-chars: must be an int >= 1, got 'x'"),
    (["--shutdown-timeout", "-1"], "argument --shutdown-timeout: must be a finite number >= 0, got '-1'"),
    (["--ngram", "--ngram-min", "3", "--ngram-max", "2"], "--ngram-min (3) must be <= --ngram-max (2)"),
    (["--max-model-len", "4096"], "--max-model-len 4096 exceeds the model's max_position_embeddings 512"),
    # caches that would not fit: the error names the serve flag that sized them
    (["--num-blocks", str(10 ** 10)], "--num-blocks: the KV caches for 160000000000 positions need"),
    (["--max-num-seqs", str(10 ** 9)], "; lower --max-num-seqs or --max-model-len, or pass --kv-cache-memory or "
                                        "--num-blocks"),
    (["--kv-cache-memory", str(10 ** 15)], "--kv-cache-memory: the KV caches for"),
    # the pool's size: one flag, a byte count or a fraction, memory a CPU can report
    (["--kv-cache-memory", "0"], "argument --kv-cache-memory: must be a byte count >= 1 (e.g. 2000000000, 500M or "
                                 "2GiB), got '0'"),
    (["--kv-cache-memory", "2XB"], "argument --kv-cache-memory: must be a byte count >= 1"),
    (["--kv-cache-memory", "1G", "--num-blocks", "8"], "argument --num-blocks: not allowed with argument --kv-cache-memory"),
    (["--gpu-memory-utilization", "1.5"], "argument --gpu-memory-utilization: must be a number in (0, 1], got '1.5'"),
    (["--gpu-memory-utilization", "0.5"], "--gpu-memory-utilization: this device does not report its memory (a CPU): "
                                          "pass --kv-cache-memory BYTES or --num-blocks"),
    (["--kv-cache-memory", "1KiB"], "--kv-cache-memory: the KV cache holds 0 blocks of 16 positions"),
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


def _sizing(**flags) -> argparse.Namespace:
    return argparse.Namespace(**{"num_blocks": None, "kv_cache_memory": None, "gpu_memory_utilization": None,
                                 "max_num_seqs": 4, "dtype": "float32", **flags})


# K and V of 2 layers of 2 heads of 8 dims in float32: 256 bytes a position, 4096 a block of 16
MODELS = [types.SimpleNamespace(config=types.SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=8))]


@pytest.mark.parametrize("flags, device, blocks", [
    (dict(kv_cache_memory=40_000), None, 9),                           # 40,000 // 4,096
    (dict(kv_cache_memory=40_000), (10 ** 9, 0), 9),                   # given bytes beat the device's memory
    (dict(), None, 4 * 4),                                             # a CPU: --max-num-seqs x 4 blocks
    (dict(), (1_000_000, 100_000), 195),                               # a GPU: (0.9 x 1e6 - 1e5) // 4096
    (dict(gpu_memory_utilization=0.5), (1_000_000, 100_000), 97),
    (dict(num_blocks=7), (1_000_000, 100_000), 7),
])
def test_the_pool_is_sized_from_memory(monkeypatch, flags, device, blocks):
    monkeypatch.setattr(launch, "device_memory", lambda: device)
    pool = pool_blocks(_sizing(**flags), MODELS, 64, 1)
    assert pool.num_blocks == blocks
    assert pool.summary.startswith(f"KV cache: {blocks} blocks of 16 positions") and f": {blocks // 4} requests of" \
        in pool.summary


def test_the_pool_divides_over_the_data_shards(monkeypatch):
    monkeypatch.setattr(launch, "device_memory", lambda: None)
    assert pool_blocks(_sizing(kv_cache_memory=40_000), MODELS, 64, 2)[:2] == (8, "--kv-cache-memory")
    with pytest.raises(ValueError, match="fewer than one request of --max-model-len 64 needs on each of 4 data"):
        pool_blocks(_sizing(kv_cache_memory=40_000), MODELS, 64, 4)


@pytest.mark.parametrize("flags, budget", [([], 256), (["--max-num-batched-tokens", "32"], 32)])
def test_max_num_batched_tokens_reaches_the_engine(monkeypatch, checkpoint, flags, budget):
    from scv_jax.serving import server

    parsed = []
    monkeypatch.setattr(server, "serve", lambda args: parsed.append(args) or 0)
    assert cli.main(["serve", "--model", str(checkpoint), "--dtype", "float32", *flags]) == 0
    served = server.make_engine(parsed[0], launch.checkpoints(parsed[0]))
    assert served.engine.max_num_batched_tokens == budget
