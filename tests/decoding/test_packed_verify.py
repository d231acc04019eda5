"""Packed verification (``DecoderConfig.packed_verify``): the target scores each request's own drafts,
packed in one row. Greedy output equals autoregressive decoding, sampling keeps the target's
distribution, the target scores fewer tokens than dense steps when drafts are ragged, and an adaptive
decoder trims each request's drafts."""

from __future__ import annotations

import numpy as np
import pytest

import scv_jax
from scv_jax import DecoderConfig, NgramDrafter, SpeculativeDecoder
from tests.decoding.common import MAX_NEW, SMALL, prompts

PACKED = DecoderConfig(**{**vars(SMALL), "k": 3, "packed_verify": True})
PACKED_ADAPTIVE = DecoderConfig(**{**vars(PACKED), "adaptive": True, "k_values": (0, 1, 2, 3)})


@pytest.mark.parametrize("drafter, config", [("ngram", PACKED), ("ngram", PACKED_ADAPTIVE), ("model", PACKED),
                                             ("model", PACKED_ADAPTIVE)],
                         ids=["ngram-k3", "ngram-adaptive", "model-k3", "model-adaptive"])
def test_packed_greedy_equals_autoregressive(target, partial_draft, autoregressive, drafter, config):
    draft = NgramDrafter(min_n=1, max_n=3) if drafter == "ngram" else partial_draft
    packed = SpeculativeDecoder(target, draft, config=config)
    dense = SpeculativeDecoder(target, draft, config=DecoderConfig(**{**vars(config), "packed_verify": False}))
    for seed, batch in ((0, 1), (1, 3), (2, 4)):
        batch_prompts = prompts(seed, batch, alphabet=4 if drafter == "ngram" else 16)
        out = packed.generate(batch_prompts, MAX_NEW)
        assert out.tokens == autoregressive.generate(batch_prompts, MAX_NEW).tokens
        if not config.adaptive:      # the same drafts: ragged n-gram matches and budgets cost less packed
            baseline = dense.generate(batch_prompts, MAX_NEW)
            assert out.tokens == baseline.tokens and out.stats.steps == baseline.stats.steps
            assert out.stats.scored_tokens <= baseline.stats.scored_tokens
            if drafter == "ngram" and batch > 1:
                assert out.stats.scored_tokens < baseline.stats.scored_tokens
    assert packed.pool.num_free == SMALL.num_blocks


def test_packed_sampling_matches_target_distribution(target):
    """First sampled token ~ softmax(target logits / T) (chi-square) for requests whose n-gram drafts
    share packed steps with requests that have none."""
    temperature, rounds = 1.5, 150
    decoder = SpeculativeDecoder(target, NgramDrafter(1, 2), config=DecoderConfig(**{**vars(PACKED), "k": 2}))
    prompt, unmatched = [3, 1, 4, 3, 1], [5, 6, 7, 8, 9]          # (3, 1) proposes [4, 3]; no n-gram repeats
    logits = np.asarray(scv_jax.models.Transformer.__call__(target, np.array([prompt])))[0, -1]
    probs = np.exp((logits - logits.max()) / temperature)
    probs /= probs.sum()
    counts = np.zeros(len(probs))
    for seed in range(rounds):
        out = decoder.generate([prompt, unmatched, prompt, unmatched], 1 + 2, temperature=temperature, seed=seed)
        counts[out.tokens[0][0]] += 1
        counts[out.tokens[2][0]] += 1
        # the first step scored 2 * (2 + 1) + 2 tokens in a 4 * (1 + 1) packed row, not 4 * (2 + 1)
        assert out.stats.scored_tokens < out.stats.steps * 4 * 3
    n = 2 * rounds
    expected = probs * n
    keep = expected >= 5
    chi2 = np.sum((counts[keep] - expected[keep]) ** 2 / expected[keep]) + (
        (counts[~keep].sum() - expected[~keep].sum()) ** 2 / max(expected[~keep].sum(), 1e-9))
    dof = int(keep.sum())
    assert chi2 < dof + 5 * np.sqrt(2 * dof), (chi2, dof, counts, expected)   # ~5 sigma


def test_packed_verify_needs_one_device_and_a_packed_forward(target):
    with pytest.raises(ValueError, match="packed_verify needs one device"):
        SpeculativeDecoder(target, "ngram", config=PACKED, mesh=scv_jax.decoder_mesh(1, 1))
    with pytest.raises(ValueError, match="DecoderConfig.packed_verify must be a bool"):
        DecoderConfig(packed_verify="yes")


@pytest.mark.parametrize("config", [PACKED, PACKED_ADAPTIVE], ids=["k3", "adaptive"])
@pytest.mark.slow
def test_no_recompilation_after_warmup_with_packed_steps(target, config):
    """``warmup`` compiles every packed step a decoder may run: ragged n-gram steps compile nothing more."""
    from scv_jax.graph.compile_counter import CompileCounter

    decoder = SpeculativeDecoder(target, NgramDrafter(1, 3), config=config)
    assert decoder.warmup(4, 40) > 0
    with CompileCounter() as compiles:
        out = decoder.generate(prompts(1, 4, alphabet=4), MAX_NEW)
    assert compiles.count == compiles.loads == 0
    if not config.adaptive:          # ragged n-gram drafts: packed steps ran
        assert out.stats.scored_tokens < out.stats.steps * 4 * (config.k + 1)
