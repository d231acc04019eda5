"""No silent recompiles or fallbacks: ``warmup`` covers every executable a ``generate`` of its sizes runs
(and says how many before compiling them), the running batch never outgrows the largest batch bucket,
context widths grow geometrically, a compile after warm-up and a kernel that fell back to XLA show in
``GenerateStats`` (and the log), and ``backend="pallas"`` without a GPU is an error."""

from __future__ import annotations

import dataclasses
import logging
import re

import jax
import pytest

import scv_jax
from scv_jax import DecoderConfig, SamplingParams, SpeculativeDecoder
from scv_jax.graph.buckets import Buckets
from scv_jax.graph.compile_counter import CompileCounter
from scv_jax.ops import registry
from tests.decoding.common import MAX_NEW, SMALL, prompts
from tests.decoding.test_continuous_batching import _running_sizes
from tests.models.fixtures import TINY


@pytest.fixture(scope="module")
def demo():
    return scv_jax.models.load_demo()


@pytest.mark.parametrize("with_draft", [False, True], ids=["autoregressive", "k4"])
@pytest.mark.slow
def test_warmup_then_generate_compiles_nothing(demo, with_draft):
    """The regression: ``SpeculativeDecoder(target, None).warmup(1, 91)`` then a 48-token generate of a
    41-byte prompt compiled the seed's key (2 executables) in the first call."""
    target, draft = demo
    jax.clear_caches()                                # as in a fresh process: nothing compiled yet
    decoder = SpeculativeDecoder(target, draft if with_draft else None)
    decoder.warmup(1, 91)
    out = decoder.generate([list(b"def fibonacci(n):\n    a, b = 0, 1\n    for")], 48)
    assert out.stats.compile_count == 0
    assert out.stats.compiled == [] and len(out.tokens[0]) == 48


@pytest.mark.slow
def test_the_running_batch_never_exceeds_the_largest_bucket(target, autoregressive, monkeypatch):
    """10 prompts and no max_num_seqs with batch buckets up to 4: 4 run at once, the others wait (no step
    at an unbucketed size compiled by plain jit), and the output is that of running them alone."""
    config = DecoderConfig(**{**vars(SMALL), "batch_buckets": (1, 2, 4)})
    decoder = SpeculativeDecoder(target, "ngram", config=dataclasses.replace(config, k=2))
    sizes = _running_sizes(monkeypatch)
    decoder.warmup(4, SMALL.max_seq_len)
    batch = prompts(21, 10)
    out = decoder.generate(batch, MAX_NEW)
    assert max(sizes) == 4 and out.stats.compile_count == 0
    assert all(s.oversize == 0 for s in decoder.graph_stats.values())
    assert out.tokens == autoregressive.generate(batch, MAX_NEW).tokens


def test_a_compile_after_warmup_is_counted_and_logged_once(target, caplog):
    config = DecoderConfig(**{**vars(SMALL), "batch_buckets": (1, 2, 4), "k": 0})
    decoder = SpeculativeDecoder(target, None, config=config)
    decoder.warmup(2, SMALL.max_seq_len)
    assert decoder.generate(prompts(1, 2), 5).stats.compiled == []
    with caplog.at_level(logging.WARNING):
        out = decoder.generate(prompts(2, 3), 5)                  # batch bucket 4: not warmed up
        again = decoder.generate(prompts(3, 4), 5)
    shape = ("decode_step(batch=4, blocks=8, k=0, greedy=True, logprobs=False, backend=auto, packed_k=0, "
             "draft_only=False)")
    assert shape in out.stats.compiled and out.stats.compile_count == len(out.stats.compiled) == 2
    assert again.stats.compiled == [] and again.stats.compile_count == 0
    warnings = [r.getMessage() for r in caplog.records if "warm-up did not cover" in r.getMessage()]
    assert len(warnings) == 2 and any("batch=4, blocks=8, k=0, greedy=True" in w for w in warnings), warnings


@pytest.mark.slow
def test_warmup_covers_greedy_and_sampled_steps_when_asked(target, no_persistent_cache):
    decoder = SpeculativeDecoder(target, None, config=SMALL)
    decoder.warmup(4, SMALL.max_seq_len)                          # greedy only (temperatures=0.0)
    assert decoder.generate(prompts(4, 3), MAX_NEW, temperature=1.0).stats.compile_count > 0
    decoder = SpeculativeDecoder(target, None, config=SMALL)
    decoder.warmup(4, SMALL.max_seq_len, temperatures=(0.0, 0.7))
    for temperature in (0.0, 1.0):
        assert decoder.generate(prompts(4, 3), MAX_NEW, temperature=temperature).stats.compile_count == 0


@pytest.mark.slow
def test_a_batch_mixing_every_logit_control_compiles_nothing_after_warmup(target, partial_draft):
    """The logit controls are data: after a greedy and sampled warm-up, 16 requests (each control alone and
    all of them together, plain, each greedy and sampled), 4 running at once in every mix, compile and
    load nothing (the control state's writer included) and emit what they must (no bad word, only allowed
    ids, no eos before min_tokens)."""
    decoder = SpeculativeDecoder(target, partial_draft, config=dataclasses.replace(SMALL, k=2))
    decoder.warmup(4, SMALL.max_seq_len, temperatures=(0.0, 1.0))
    controls = [dict(presence_penalty=1.5), dict(frequency_penalty=1.0), dict(repetition_penalty=1.5),
                dict(logit_bias={3: 5.0}), dict(allowed_token_ids=[1, 2, 3, 5]), dict(bad_words_token_ids=[[4], [7]]),
                dict(min_tokens=8), dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
                                         logit_bias={2: 1.0}, allowed_token_ids=[2, 4, 5, 6, 7, 8],
                                         bad_words_token_ids=[[6]], min_tokens=3), {}]
    params = [SamplingParams(max_tokens=10, temperature=temperature, seed=i, **control)
              for i, control in enumerate(controls) for temperature in (0.0, 1.0)]
    with CompileCounter() as compiles:
        out = decoder.generate(prompts(8, len(params)), sampling=params, eos_token_id=5)
    assert compiles.count == compiles.loads == 0 and out.stats.compiled == [], out.stats.compiled
    assert out.stats.acceptance_rate > 0
    for p, tokens in zip(params, out.tokens):
        assert not {t for (t,) in p.bad_words_token_ids} & set(tokens)
        assert set(tokens) <= set(p.allowed_token_ids or range(TINY.vocab_size))
        assert 5 not in tokens[:p.min_tokens]


@pytest.mark.parametrize("kwargs, match", [(dict(temperatures=-1.0), "temperatures"),
                                           (dict(temperatures=()), "non-empty"),
                                           (dict(max_len=65), "max_seq_len 64"),
                                           (dict(batch_sizes=[0]), "batch_sizes must be an int >= 1")])
def test_warmup_rejects_bad_arguments(autoregressive, kwargs, match):
    with pytest.raises(ValueError, match=match):
        autoregressive.warmup(**{"batch_sizes": 1, "max_len": 8, **kwargs})


def test_a_kernel_that_fails_to_compile_shows_in_the_stats(target, autoregressive, monkeypatch):
    """With "auto" a bucket whose kernels fail falls back to XLA: the tokens are right, and the bucket and
    the reason are in ``GenerateStats.fallbacks`` (``check_no_fallbacks`` raises). Pretending a GPU is
    there makes "auto" pick the Pallas kernels, which cannot compile for the CPU."""
    monkeypatch.setattr(registry, "cuda_available", lambda: True)
    out = SpeculativeDecoder(target, None, config=SMALL).generate(prompts(5, 2), 6)
    assert out.tokens == autoregressive.generate(prompts(5, 2), 6).tokens
    shape = ("decode_step(batch=4, blocks=8, k=0, greedy=True, logprobs=False, backend=auto, packed_k=0, "
             "draft_only=False)")
    assert "interpret" in out.stats.fallbacks[shape] and "prefill_step(batch=4, blocks=8, backend=auto)" in \
        out.stats.fallbacks
    # the reason names the executable and the Pallas kernel whose lowering failed (where it is called)
    assert re.match(r"decode_step: compile failed in \S+.* from \w+ \(pallas_kernels/\w+\.py:\d+\): ValueError: ",
                    out.stats.fallbacks[shape]), out.stats.fallbacks[shape]
    with pytest.raises(RuntimeError, match=re.escape("row: 2 step bucket(s) fell back to XLA")):
        out.stats.check_no_fallbacks("row")
    monkeypatch.undo()
    clean = SpeculativeDecoder(target, None, config=SMALL).generate(prompts(5, 2), 6).stats
    assert clean.fallbacks == {} and clean.check_no_fallbacks("row") is None


@pytest.mark.skipif(registry.cuda_available(), reason="checks the error raised without a GPU")
def test_pallas_without_a_gpu_is_an_error(target):
    with pytest.raises(ValueError, match="DecoderConfig.backend='pallas' needs a CUDA GPU .* 'interpret' on CPU"):
        SpeculativeDecoder(target, None, config=dataclasses.replace(SMALL, backend="pallas"))


def test_unsupported_inputs_under_interpret_are_an_error_not_a_fallback(target):
    """"interpret" (like "pallas") never falls back: the tiny model's head_dim 8 is outside the attention
    kernel's support, and the step says so instead of running XLA."""
    decoder = SpeculativeDecoder(target, None, config=dataclasses.replace(SMALL, backend="interpret"))
    with pytest.raises(ValueError, match="the Pallas kernel does not support these inputs"):
        decoder.generate([[1, 2]], 2)


def test_context_widths_are_geometric():
    assert DecoderConfig(max_seq_len=1088).block_buckets().sizes == (17, 34, 68)
    assert DecoderConfig(max_seq_len=4096 + 512).block_buckets().sizes == (18, 36, 72, 144, 288)
    assert DecoderConfig(max_seq_len=64, block_size=8).block_buckets().sizes == (8,)
    assert Buckets.halving(1000, min_size=16).sizes == (16, 32, 63, 125, 250, 500, 1000)
    with pytest.raises(ValueError, match="min_size <= max_size"):
        Buckets.halving(4, min_size=8)


@pytest.mark.slow
def test_a_long_generation_compiles_a_handful_of_widths(target):
    """One request growing from 1 to 128 positions of 1 (128 blocks) crosses 4 widths (16, 32, 64, 128
    blocks): 4 decode executables, where multiples of 16 blocks compiled 8; a warm-up to max_seq_len
    covers them."""
    config = DecoderConfig(block_size=1, num_blocks=160, max_seq_len=128, prefill_chunk=16, batch_buckets=(1,), k=0)
    decoder = SpeculativeDecoder(target, None, config=config)
    out = decoder.generate([[3]], 128)
    assert decoder.graph_stats["decode"].compiles == 4
    decode = [c for c in out.stats.compiled if c.startswith("decode_step(")]
    assert [re.search(r"blocks=(\d+)", c).group(1) for c in decode] == ["16", "32", "64", "128"]
    warm = SpeculativeDecoder(target, None, config=config)
    warm.warmup(1, config.max_seq_len)
    again = warm.generate([[3]], 128)
    assert again.stats.compiled == [] and again.tokens == out.tokens


@pytest.mark.slow
def test_warmup_counts_what_it_compiles_and_then_generate_compiles_nothing(target, partial_draft, capsys):
    """An adaptive decoder's warm-up for batches up to 4 (one bucket), greedy and sampled, at 2 context
    widths: k values x batch buckets x widths x 2 decode steps and batch buckets x widths prefills (twice:
    the draft's catch-up), counted before compiling; it completes (12 executables), and a mixed workload
    of batches 1 to 3 then compiles nothing."""
    config = DecoderConfig(block_size=8, num_blocks=96, max_seq_len=128, prefill_chunk=16, batch_buckets=(4,),
                           context_buckets=(8,), adaptive=True, k_values=(0, 2))
    assert config.block_buckets().sizes == (8, 16)
    decoder = SpeculativeDecoder(target, partial_draft, config=config)
    decoder.warmup(4, config.max_seq_len, temperatures=(0.0, 1.0), progress=True)
    decode, prefill = 2 * 1 * 2 * 2, 1 * 2 * 2
    head = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warm-up:")]
    assert head == [f"warm-up: {decode + prefill} executables to compile: {decode} decode steps (k (0, 2) x "
                    "batch buckets (4,) x block-table widths (8, 16) x greedy and sampled), 4 prefills"]
    assert sum(s.compiles for s in decoder.graph_stats.values()) == decode + prefill
    for temperature in (0.0, 1.0):
        with CompileCounter() as compiles:
            out = decoder.generate(prompts(6, 7) + [[5] * 60], 40, temperature=temperature, max_num_seqs=3)
            decoder.generate([[1, 2]], 9, temperature=temperature)
        assert compiles.count == compiles.loads == 0 and out.stats.compiled == [], out.stats.compiled
