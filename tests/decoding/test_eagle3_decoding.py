"""An EAGLE-3 head drafting in the engine: greedy output equals the target's alone (chains, adaptive k,
packed verification, requests arriving mid-flight, chunked prompts, one-token prompts), sampled tokens
keep the filtered target distribution, nothing of a rejected draft reaches the head's cache, and a head
fitted to the target's continuations sees its drafts accepted."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from scv_jax import DecoderConfig, Engine, SamplingParams, SpeculativeDecoder, TreeConfig
from scv_jax.eagle3_train import train_head
from scv_jax.models import load_eagle3
from scv_jax.graph.compile_counter import CompileCounter
from tests.decoding.common import MAX_NEW, SMALL, prompts, ran_packed_steps
from tests.decoding.test_controls import CONTROLS, EOS, MASKS
from tests.decoding.test_engine import FILTERS, first_two_tokens_follow_the_target, run, target_logits, tokens  # noqa: F401
from tests.decoding.test_packed_verify import PACKED
from tests.models.eagle3_fixtures.heads import head_config, head_tensors
from tests.models.fixtures import TINY
from tests.models.test_eagle3 import write_head

HEAD = dict(hidden=TINY.d_model, heads=4, kv_heads=2, head_dim=8, ffn=48, target_vocab=TINY.vocab_size,
            draft_vocab=12)
CHAIN = DecoderConfig(**{**vars(SMALL), "k": 3})
ADAPTIVE = DecoderConfig(**{**vars(SMALL), "adaptive": True, "k_values": (0, 2, 4)})
TREE = DecoderConfig(**{**vars(SMALL), "tree": TreeConfig(max_depth=3, branching=2, max_nodes=6)})


def fit(head, target, sequences: list[list[int]], steps: int = 300) -> np.ndarray:
    """``head`` trained in place (``train_head``: adam, two TTT steps) on ``sequences``, the target's own
    continuations, so its drafts should then be accepted; returns the last step's top-1 agreement with
    the target per TTT step."""
    batch = np.asarray(sequences, np.int32)
    return train_head(head, target, [batch] * steps, optax.adam(1e-2), ttt_steps=2)[1]


def random_head(target, directory, seed: int, **fields):
    """A random head over the taps of layers (0, 1, 1) of the 2-layer target."""
    spec = {**HEAD, **fields}
    return load_eagle3(write_head(directory, head_tensors(**spec, seed=seed),
                                  head_config(**spec, aux_layers=(0, 1, 1))), target, dtype="float32")


@pytest.fixture(scope="module")
def head(target, tmp_path_factory):
    """A random head (most drafts rejected)."""
    return random_head(target, tmp_path_factory.mktemp("head"), seed=3)


@pytest.fixture(scope="module")
def fitted(target, autoregressive, tmp_path_factory):
    """(a head fitted to the target's greedy continuations of ``FIT_PROMPTS``, its final agreement)."""
    model = random_head(target, tmp_path_factory.mktemp("fitted"), seed=4, draft_vocab=TINY.vocab_size)
    continuations = autoregressive.generate(FIT_PROMPTS, 2 * MAX_NEW).tokens
    return model, fit(model, target, [p + c for p, c in zip(FIT_PROMPTS, continuations)])


FIT_PROMPTS = [p[:6] + [0] * (6 - len(p[:6])) for p in prompts(40, 8)]


@pytest.mark.parametrize("config", [CHAIN, ADAPTIVE, TREE, PACKED], ids=["chain", "adaptive", "tree", "packed"])
@pytest.mark.slow
def test_greedy_output_is_the_targets_as_requests_come_and_go(target, autoregressive, fitted, config):
    engine = Engine(target, fitted[0], config=config, eos_token_id=None)
    batch = FIT_PROMPTS[:2] + prompts(31, 2) + [[5]]     # 1 to 19 tokens (prefill chunks of 16), and one
    free = autoregressive.generate(batch, MAX_NEW).tokens
    params = SamplingParams(max_tokens=MAX_NEW)
    outputs = run(engine, {0: [(batch[0], params, "0"), (batch[4], params, "4")],
                           2: [(batch[1], params, "1"), (batch[2], params, "2")], 5: [(batch[3], params, "3")]})
    assert [tokens(outputs, str(i)) for i in range(5)] == free
    assert sum(outputs[str(i)][-1].num_accepted_tokens for i in range(5)) > 0
    assert ran_packed_steps(engine) == config.packed_verify


@pytest.mark.parametrize("config", [DecoderConfig(**{**vars(SMALL), "k": 4}), TREE,
                                    DecoderConfig(**{**vars(SMALL), "k": 4, "packed_verify": True})],
                         ids=["chain", "tree", "packed"])
@pytest.mark.slow
def test_the_head_cache_holds_verified_rows_only(target, fitted, config):
    """One request with accepted and rejected drafts, alone in a fresh engine (its blocks are the pool's first,
    in order, so position p is slot p): the head's cache holds the target's combined taps of each
    position it verified, the accepted drafts' tokens at their positions, and one K/V row per position
    but the last lag (at most k + 1) ones, which the prefix cache's top-up at the end adds (the last row
    pairs the last verified position with the last token): nothing of a rejected draft, nothing past
    the text. Packed (one request in a batch of 4: packed steps), the taps come from the packed tokens."""
    head = fitted[0]
    engine = Engine(target, head, config=config, eos_token_id=None)
    prompt = FIT_PROMPTS[0][:3]            # the start of a learned text: some drafts accepted, some not
    final = run(engine, {0: [(prompt, SamplingParams(max_tokens=MAX_NEW), "r")]})["r"][-1]
    sequence = prompt + list(final.token_ids)
    target_cache, cache = engine.runner.caches.take()
    engine.runner.caches.put(target_cache, cache)
    _, taps = target(jnp.asarray([sequence]), aux_layers=head.aux_layers)
    features = np.asarray(cache.features).reshape(-1, TINY.d_model)
    np.testing.assert_allclose(features[:len(sequence) - 1], np.asarray(head.combine(taps))[0, :-1], atol=1e-5)
    assert not features[len(sequence) - 1:].any()
    tokens = np.asarray(cache.tokens).reshape(-1)
    written = np.flatnonzero(tokens)
    assert 0 < final.num_accepted_tokens < len(final.token_ids) - 1
    assert len(written) <= final.num_accepted_tokens and np.array_equal(tokens[written], np.asarray(sequence)[written])
    kv_rows = np.any(np.asarray(cache.kv.k_pages) != 0, axis=(0, -2, -1)).reshape(-1)
    committed = int(kv_rows.sum())
    assert committed == len(sequence) - 1 and kv_rows[:committed].all()
    assert ran_packed_steps(engine) == config.packed_verify


@pytest.mark.parametrize("config", [DecoderConfig(**{**vars(SMALL), "k": 2}), TREE], ids=["chain", "tree"])
@pytest.mark.slow
def test_sampled_tokens_follow_the_filtered_target(target, target_logits, head, config):  # noqa: F811
    engine = Engine(target, head, config=config)
    prompt, count = [3, 1, 4, 3, 1], 400
    params = SamplingParams(max_tokens=3, **FILTERS["all"])
    outputs = run(engine, {0: [(prompt, SamplingParams(**{**vars(params), "seed": i}), str(i)) for i in range(count)]},
                  max_steps=2 * count)
    sampled = [tokens(outputs, str(i)) for i in range(count)]
    first_two_tokens_follow_the_target(sampled, prompt, params, target_logits)


@pytest.mark.slow
def test_packed_verification_is_the_dense_steps(target, autoregressive, fitted):
    """A head's chains verified packed (its next catch-up reads the taps of the packed tokens): greedy
    output is the target's alone, and every step and acceptance is the dense steps' for fewer scored
    tokens."""
    batch = [FIT_PROMPTS[1], [5]]     # a learned text, a token: 2 rows of 4, every step packed (m = 2 of k = 3)
    packed = SpeculativeDecoder(target, fitted[0], config=PACKED)
    out = packed.generate(batch, MAX_NEW)
    baseline = SpeculativeDecoder(target, fitted[0], config=CHAIN).generate(batch, MAX_NEW)
    assert out.tokens == baseline.tokens == autoregressive.generate(batch, MAX_NEW).tokens and ran_packed_steps(packed)
    assert out.stats.steps == baseline.stats.steps and out.stats.acceptance_rate > 0
    assert out.stats.acceptance_per_position == baseline.stats.acceptance_per_position
    assert out.stats.scored_tokens < baseline.stats.scored_tokens



def test_a_fitted_heads_drafts_are_accepted(target, autoregressive, fitted):
    """Positions, the hidden handed from draft to draft and the feature of the last accepted token must
    all line up for a head that learned the target's continuations to see its drafts accepted."""
    model, agreement = fitted
    assert agreement.min() > 0.95, agreement
    decoder = SpeculativeDecoder(target, model, config=DecoderConfig(**{**vars(SMALL), "k": 4}))
    out = decoder.generate(FIT_PROMPTS, 2 * MAX_NEW)
    assert out.tokens == autoregressive.generate(FIT_PROMPTS, 2 * MAX_NEW).tokens
    assert out.stats.acceptance_rate > 0.9, out.stats.acceptance_per_position


def test_greedy_with_logit_controls_equals_autoregressive(target, autoregressive, fitted):
    """Penalties, biases and masks apply to the head's drafts as to the target's logits (draft j's history
    holds the drafts before it): greedy output equals autoregressive decoding's with the same controls."""
    decoder = SpeculativeDecoder(target, fitted[0], config=DecoderConfig(**{**vars(SMALL), "k": 3}))
    batch, accepted = FIT_PROMPTS[:4], 0.0
    for group in (CONTROLS, MASKS):
        params = [SamplingParams(max_tokens=12, **control) for control in group.values()][:4]
        out = decoder.generate(batch, sampling=params, eos_token_id=EOS)
        assert out.tokens == autoregressive.generate(batch, sampling=params, eos_token_id=EOS).tokens
        accepted += out.stats.acceptance_rate
    assert accepted > 0


@pytest.mark.slow
def test_warmup_then_generate_compiles_nothing_and_updates_the_caches_in_place(target, head):
    config = DecoderConfig(**{**vars(SMALL), "adaptive": True, "k_values": (0, 2)})
    decoder = SpeculativeDecoder(target, head, config=config)
    decoder.warmup([4], config.max_seq_len)
    with CompileCounter() as compiles:
        out = decoder.generate(prompts(33, 5), MAX_NEW)
    assert compiles.count == compiles.loads == 0 and out.stats.compiled == [], out.stats.compiled
    for stats in decoder.graph_stats.values():       # the head's cache updated in place, k = 0 included
        assert stats.copied_donations == stats.unaliased_donations == 0
