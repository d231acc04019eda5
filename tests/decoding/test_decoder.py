"""The speculative decoding loop: lossless greedy output, sampling distribution, no recompiles, errors."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

import scv_jax
from scv_jax import DecoderConfig, NgramDrafter, SpeculativeDecoder, generate_autoregressive
from scv_jax.graph.compile_counter import CompileCounter
from scv_jax.models import TransformerConfig
from tests.decoding.common import MAX_NEW, SMALL
from tests.decoding.common import prompts as _prompts
from tests.models.fixtures import TINY, TINY_DRAFT, tiny_model


@pytest.mark.parametrize("k", [0, 2, 5])
def test_greedy_speculative_equals_autoregressive(target, partial_draft, autoregressive, k):
    decoder = SpeculativeDecoder(target, partial_draft, config=DecoderConfig(**{**vars(SMALL), "k": k}))
    patterns = set()
    for seed, batch in ((0, 1), (1, 3), (2, 4)):
        prompts = _prompts(seed, batch)
        expected = autoregressive.generate(prompts, MAX_NEW).tokens
        out = decoder.generate(prompts, MAX_NEW)
        assert out.tokens == expected
        assert all(len(t) == MAX_NEW for t in out.tokens)
        patterns.add(out.stats.acceptance_rate)
    assert decoder.pool.num_free == SMALL.num_blocks          # every block went back to the pool
    if k:
        assert any(0.0 < a < 1.0 for a in patterns), patterns  # partial acceptance exercised


def test_draft_equal_to_target_accepts_everything(target, autoregressive):
    """All drafts accepted every step: the draft catches up on its missing last token each step."""
    decoder = SpeculativeDecoder(target, target, config=DecoderConfig(**{**vars(SMALL), "k": 3}))
    prompts = _prompts(5, 3)
    out = decoder.generate(prompts, 17)
    assert out.tokens == autoregressive.generate(prompts, 17).tokens
    assert out.stats.acceptance_rate == 1.0
    assert out.stats.acceptance_per_position == [1.0, 1.0, 1.0]
    # 4 tokens a step, then one token left: the last step drafts nothing (its budget) and emits 1
    assert out.stats.steps == 5 and out.stats.mean_accepted_length == pytest.approx(17 / 5)
    # (one step in flight: the last step was planned before the one before it was fetched: k = 3, no drafts)
    assert out.stats.k_histogram == ({3: 5} if decoder.config.overlap else {3: 4, 0: 1})


def test_generate_autoregressive_matches_plain_forward(target):
    """The baseline through the paged cache equals argmax decoding with full-sequence forwards."""
    prompt = _prompts(7, 1)[0]
    out = generate_autoregressive(target, [prompt], 6, config=SMALL)
    graphdef, state = nnx.split(target)
    forward = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens))
    seq = list(prompt)
    for _ in range(6):
        seq.append(int(np.argmax(np.asarray(forward(state, np.array([seq])))[0, -1])))
    assert out.tokens[0] == seq[len(prompt):]


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_sampling_matches_target_distribution(target, drafter):
    """First sampled token over many seeds ~ softmax(target logits / T) (chi-square, tiny vocab), with
    the drafts of a poor draft model (most tokens resampled) or of prompt lookup (q = one-hot)."""
    draft = tiny_model(TINY_DRAFT, seed=9, scale=1.0) if drafter == "model" else NgramDrafter(1, 2)
    temperature, batch, rounds = 1.5, 4, 150
    decoder = SpeculativeDecoder(target, draft, config=DecoderConfig(**{**vars(SMALL), "k": 2}))
    prompt = [3, 1, 4, 3, 1]                                   # the n-gram (3, 1) proposes [4, 3]
    probs = np.asarray(scv_jax.models.Transformer.__call__(target, np.array([prompt])))[0, -1]
    probs = np.exp((probs - probs.max()) / temperature)
    probs /= probs.sum()
    counts = np.zeros(TINY.vocab_size)
    for seed in range(rounds):
        out = decoder.generate([prompt] * batch, 3, temperature=temperature, seed=seed)
        for tokens in out.tokens:
            counts[tokens[0]] += 1
        assert out.stats.k_histogram.get(2, 0) >= 1            # the first step verified 2 drafts
    n = batch * rounds
    expected = probs * n
    keep = expected >= 5
    chi2 = np.sum((counts[keep] - expected[keep]) ** 2 / expected[keep]) + (
        (counts[~keep].sum() - expected[~keep].sum()) ** 2 / max(expected[~keep].sum(), 1e-9))
    dof = int(keep.sum())                                      # bins kept + 1 pooled - 1
    assert chi2 < dof + 5 * np.sqrt(2 * dof), (chi2, dof, counts, expected)   # ~5 sigma
    assert out.stats.acceptance_rate < 1.0


def test_same_seed_same_output(target, partial_draft):
    decoder = SpeculativeDecoder(target, partial_draft, config=DecoderConfig(**{**vars(SMALL), "k": 2}))
    prompts = _prompts(3, 3)
    first = decoder.generate(prompts, 10, temperature=1.0, seed=42).tokens
    assert decoder.generate(prompts, 10, temperature=1.0, seed=42).tokens == first
    assert decoder.generate(prompts, 10, temperature=1.0, seed=43).tokens != first


@pytest.mark.slow
def test_no_recompilation_after_warmup_adaptive(target, partial_draft):
    config = DecoderConfig(**{**vars(SMALL), "adaptive": True, "k_values": (0, 2, 4)})
    decoder = SpeculativeDecoder(target, partial_draft, config=config)
    compiled = decoder.warmup(4, SMALL.max_seq_len)
    assert compiled >= 4                                       # prefill + decode for k in {0, 2, 4}
    with CompileCounter() as compiles:
        out = decoder.generate([[1], [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [5] * 30, [7, 7]], 20)
        out_small = decoder.generate([[1, 2]], 9)
    assert compiles.count == compiles.loads == 0 and out.stats.compile_count == 0 and out_small.stats.compile_count == 0
    assert sum(out.stats.k_histogram.values()) == out.stats.steps
    assert out.stats.generated_tokens == 4 * 20 and out.stats.tokens_per_second > 0


@pytest.mark.parametrize("prompts, max_new, match", [
    ([], 4, "at least one prompt"),
    ([[1, 2], []], 4, "prompt 1 must be a non-empty"),
    ([[1, 16]], 4, "token id 16 at index 1, outside \\[0, vocab_size=16\\)"),
    ([[6, -1, 66]], 4, "token id -1 at index 1"),
    ([1, 2, 3], 4, "a flat list of ints \\(wrap one prompt as \\[\\[...\\]\\]\\)"),
    ([b"import os"], 4, "prompt 0 is bytes, not token ids: tokenize it first"),
    (["import os"], 4, "prompt 0 is str, not token ids"),
    ("import os", 4, "got a single str"),
    (np.array([1, 2]), 4, "got a single ndarray"),
    ([[1, 2]], 0, "max_new_tokens must be an int >= 1"),
    ([[1] * 40], 30, "max_seq_len"),
])
def test_clear_errors(autoregressive, prompts, max_new, match):
    with pytest.raises(ValueError, match=match):
        autoregressive.generate(prompts, max_new)
    assert autoregressive.pool.num_free == SMALL.num_blocks


def test_bad_models_and_temperature(target):
    with pytest.raises(TypeError, match="PagedModel"):
        SpeculativeDecoder(object(), None)
    with pytest.raises(ValueError, match="vocab_size"):
        SpeculativeDecoder(target, tiny_model(scv_jax.models.TransformerConfig(vocab_size=8), seed=1))
    with pytest.raises(ValueError, match="temperature"):
        SpeculativeDecoder(target, None, config=SMALL).generate([[1]], 2, temperature=-1.0)


@pytest.mark.parametrize("field, value", [("cache_dtype", "int8"), ("backend", "cuda"), ("k", -1),
                                          ("batch_buckets", (0, 2)), ("k_values", ()), ("block_size", 0),
                                          ("adaptive", "no"), ("adaptive", 1)])
def test_config_rejects_bad_fields_at_construction(field, value):
    with pytest.raises(ValueError, match=f"DecoderConfig.{field}"):
        DecoderConfig(**{field: value})


def test_compile_time_is_reported_apart_from_decoding_speed(target, no_persistent_cache):
    decoder = SpeculativeDecoder(target, None, config=SMALL)
    first = decoder.generate([[1, 2, 3]], 6).stats
    assert first.compile_count > 0 and 0 < first.compile_seconds < first.wall_seconds
    assert first.tokens_per_second == pytest.approx(6 / (first.wall_seconds - first.compile_seconds))
    second = decoder.generate([[1, 2, 3]], 6).stats
    assert second.compile_count == 0 and second.compile_seconds == 0.0


def test_long_prefill_reports_progress(target, capsys, monkeypatch):
    monkeypatch.setattr("scv_jax.decoding.runner.PREFILL_PROGRESS_SECONDS", 0.0)
    decoder = SpeculativeDecoder(target, None, config=SMALL)
    decoder.generate([[1] * 40], 2, progress=True)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("prefill:")]
    assert [line.split()[1] for line in lines] == ["16/39", "32/39", "39/39"]
    decoder.generate([[1] * 40], 2)
    assert "prefill:" not in capsys.readouterr().err


@pytest.mark.parametrize("k, with_draft", [(0, False), (0, True), (3, True)])
@pytest.mark.slow
def test_decode_steps_update_the_caches_in_place(target, partial_draft, k, with_draft):
    config = DecoderConfig(**{**vars(SMALL), "k": k, "batch_buckets": (1, 2)})
    decoder = SpeculativeDecoder(target, partial_draft if with_draft else None, config=config)
    decoder.warmup((1, 2), SMALL.max_seq_len)
    for name, stats in decoder.graph_stats.items():
        assert stats.compiles >= 2 and stats.unaliased_donations == stats.copied_donations == 0, name


@pytest.mark.slow
def test_greedy_is_lossless_with_every_kernel_interpreted():
    """The Pallas kernels (attention, acceptance, commit) in interpret mode give the XLA path's tokens;
    head_dim 64 and kv_heads * head_dim = 128 put every op on its kernel."""
    wide = TransformerConfig(vocab_size=32, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, head_dim=64,
                             ffn_dim=96)
    wide_draft = TransformerConfig(vocab_size=32, num_layers=1, d_model=32, num_heads=2, num_kv_heads=2,
                                   head_dim=64, ffn_dim=64)
    geometry = dict(block_size=16, num_blocks=16, max_seq_len=64, prefill_chunk=16, batch_buckets=(2,),
                    context_buckets=(4,))
    target, draft = tiny_model(wide), tiny_model(wide_draft, seed=1)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    want = SpeculativeDecoder(target, None, config=DecoderConfig(k=0, backend="xla", **geometry)).generate(prompts, 6)
    out = SpeculativeDecoder(target, draft, config=DecoderConfig(k=2, backend="interpret", **geometry)).generate(
        prompts, 6)
    assert out.tokens == want.tokens and 0 < out.stats.acceptance_rate < 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(eos_token_id=10.5), "eos_token_id must be None, an int or a sequence of ints in \\[0, vocab_size=16\\)"),
    (dict(eos_token_id=[1, 16]), "eos_token_id must be"),
    (dict(eos_token_id="2"), "eos_token_id must be"),
    (dict(eos_token_id=True), "eos_token_id must be"),
    (dict(seed=None), "seed must be an int in \\[0, 2\\*\\*32\\), got None"),
    (dict(seed=1.5), "seed must be an int in"),
    (dict(seed=2 ** 70), "seed must be an int in"),
    (dict(seed=-1), "seed must be an int in"),
    (dict(on_tokens="print"), "on_tokens must be None or a callable"),
])
def test_generate_argument_errors_name_the_argument(autoregressive, kwargs, match):
    with pytest.raises(ValueError, match=match) as error:
        autoregressive.generate([[1, 2]], 3, **kwargs)
    assert "\n" not in str(error.value)


def test_requests_beyond_the_models_context_are_refused(target):
    """A model's config.max_position_embeddings (load_hf reads it) bounds prompt + max_new_tokens."""
    short = tiny_model(dataclasses.replace(TINY, max_position_embeddings=12), seed=0)
    decoder = SpeculativeDecoder(short, None, config=SMALL)
    with pytest.raises(ValueError, match="generate: prompt 1: prompt \\(10 tokens\\) \\+ max_tokens 3 = 13 positions "
                                         "exceed the model's max_position_embeddings 12"):
        decoder.generate([[1], [2] * 10], 3)
    with pytest.raises(ValueError, match="max_position_embeddings 12"):      # a draft's limit counts too
        SpeculativeDecoder(target, short, config=SMALL).generate([[1] * 12], 1)
    assert decoder.max_position_embeddings == 12 and decoder.pool.num_free == SMALL.num_blocks
