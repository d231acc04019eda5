"""Sampling from filtered_probs follows the filtered distribution (chi-square), and rejection sampling
against filtered target probabilities is lossless: its first emitted token follows the filtered
target, and greedy rows in the same batch give exactly greedy acceptance."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import scv_jax
from tests.ops.sampling.oracle import filtered_row, fits

V = 10
LOGITS = np.float32([2.0, 1.6, 1.5, 1.0, 0.8, 0.2, 0.0, -0.5, -1.0, -2.0])   # distinct: no ties
SAMPLES = 20_000
# (temperature, top_k, top_p, min_p)
CONFIGS = {"t=0.5": (0.5, 0, 1.0, 0.0), "t=1": (1.0, 0, 1.0, 0.0), "t=1.5": (1.5, 0, 1.0, 0.0),
           "top-k": (1.0, 4, 1.0, 0.0), "top-p": (0.5, 0, 0.8, 0.0), "min-p": (1.0, 0, 1.0, 0.2),
           "all": (1.5, 7, 0.9, 0.3)}


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def _mask(probs, keep):
    probs = np.where(keep, probs, 0.0)
    return probs / probs.sum()


def _wrong_orders() -> dict[str, np.ndarray]:
    """The distributions of "all" and "top-p" had the filters been applied in other orders."""
    t, k, p, m = CONFIGS["all"]
    tempered = _softmax(LOGITS.astype(np.float64) / t)
    ordered = np.sort(tempered)[::-1]
    top_p_first = _mask(tempered, tempered >= ordered[(np.cumsum(ordered) - ordered) < p].min())   # top-p, top-k
    top_p_first = _mask(top_p_first, tempered >= ordered[k - 1])
    min_p_first = _mask(tempered, tempered >= m * tempered.max())                 # vLLM v1's sampler order
    with np.errstate(divide="ignore"):
        min_p_first = filtered_row(np.log(min_p_first), 1.0, k, p, 0.0)[0]
    # temperature after top-p: the set chosen at temperature 1
    t, _, p, _ = CONFIGS["top-p"]
    plain = _softmax(LOGITS.astype(np.float64))
    ordered = np.sort(plain)[::-1]
    late = _mask(_softmax(LOGITS.astype(np.float64) / t), plain >= ordered[(np.cumsum(ordered) - ordered) < p].min())
    return {"all: top-p before top-k": top_p_first, "all: min-p first": min_p_first,
            "top-p: temperature last": late}


def _sample(probs: jax.Array, key) -> np.ndarray:
    """int[R, SAMPLES]: draws from each row of float32[R, V] ``probs`` (categorical on its log)."""
    draws = jax.random.categorical(key, jnp.log(probs), axis=-1, shape=(SAMPLES, probs.shape[0]))
    return np.asarray(draws).T


def _counts(tokens: np.ndarray, vocab: int = V) -> np.ndarray:
    return np.bincount(tokens, minlength=vocab)


def test_samples_follow_the_filtered_distribution_and_wrong_orders_fail():
    names = list(CONFIGS)
    params = [np.array(column, dtype) for column, dtype in zip(zip(*CONFIGS.values()),
                                                               (np.float32, np.int32, np.float32, np.float32))]
    probs = scv_jax.filtered_probs(np.tile(LOGITS, (len(names), 1)), *params)
    samples = _sample(probs, jax.random.key(0))
    expected = {name: filtered_row(LOGITS, *CONFIGS[name])[0] for name in names}
    for name, row in zip(names, samples):
        assert fits(_counts(row), expected[name]), name
    for name, wrong in _wrong_orders().items():     # the test can tell these orders apart
        config = name.split(":")[0]
        assert not np.allclose(wrong, expected[config]), name
        assert not fits(_counts(samples[names.index(config)]), wrong), name


def _tiled(row: np.ndarray, count: int) -> np.ndarray:
    return np.tile(row, (count, 1)).astype(np.float32)


def test_rejection_sampling_against_filtered_probs_emits_the_filtered_target():
    """B requests with k = 2 drafts from a filtered draft q; the first emitted token ~ filtered p."""
    b, k = 20_000, 2
    rng = np.random.default_rng(0)
    target_logits = rng.normal(0, 1.5, (k, V)).astype(np.float32)
    draft_logits = (target_logits + rng.normal(0, 1.0, (k, V))).astype(np.float32)
    target_params = (np.float32([0.8]), np.int32([6]), np.float32([0.9]), np.float32([0.05]))
    draft_params = (np.float32([1.3]), np.int32([7]), np.float32([1.0]), np.float32([0.0]))
    p = np.asarray(scv_jax.filtered_probs(target_logits[None], *target_params))[0]     # [k, V]
    q = np.asarray(scv_jax.filtered_probs(draft_logits[None], *draft_params))[0]
    key_draft, key_accept = jax.random.split(jax.random.key(1))
    drafts = np.asarray(jax.random.categorical(key_draft, jnp.log(jnp.asarray(q)), axis=-1, shape=(b, k)))
    result = scv_jax.rejection_sample(drafts.reshape(-1).astype(np.int32), np.arange(b + 1, dtype=np.int32) * k,
                                      np.tile(q, (b, 1)), np.tile(p, (b, 1)), np.zeros(b, np.int32),
                                      key=key_accept, max_spec_len=k)
    first = _counts(np.asarray(result.output_token_ids)[:, 0])
    expected = filtered_row(target_logits[0], 0.8, 6, 0.9, 0.05)[0]
    assert 0.2 < float(np.mean(np.asarray(result.num_accepted) > 0)) < 0.95      # both branches ran
    assert fits(first, expected)
    assert not fits(first, _softmax(target_logits[0].astype(np.float64) / 0.8))  # the unfiltered target
    assert not fits(first, q[0])                                                   # the draft


def test_greedy_rows_in_a_sampled_batch_give_exactly_greedy_acceptance():
    b, k, v = 8, 3, 16
    greedy = np.arange(b) % 2 == 0
    rng = np.random.default_rng(2)
    target_logits = rng.normal(0, 2, (b, k + 1, v)).astype(np.float32)
    close = rng.random((b, k, 1)) < 0.7          # drafts that mostly agree with the target
    draft_logits = np.where(close, target_logits[:, :k], rng.normal(0, 2, (b, k, v))).astype(np.float32)
    temperature = np.where(greedy, 0.0, 0.9).astype(np.float32)
    params = (temperature, np.where(greedy, 0, 8).astype(np.int32), np.float32([0.9] * b), np.float32([0.02] * b))
    p = scv_jax.filtered_probs(target_logits, *params)                        # [b, k + 1, v]
    q = scv_jax.filtered_probs(draft_logits, *params)                         # [b, k, v]
    key_draft, key_bonus = jax.random.split(jax.random.key(3))
    drafts = jax.random.categorical(key_draft, jnp.log(q), axis=-1).astype(jnp.int32)    # argmax on greedy rows
    bonus = jax.random.categorical(key_bonus, jnp.log(p[:, k]), axis=-1).astype(jnp.int32)
    cu = np.arange(b + 1, dtype=np.int32) * k
    target_argmax = jnp.argmax(target_logits[:, :k], axis=-1).astype(jnp.int32).reshape(-1)
    want = scv_jax.accept_greedy(drafts.reshape(-1), cu, target_argmax, bonus, max_spec_len=k)
    np.testing.assert_array_equal(np.asarray(bonus)[greedy], np.argmax(target_logits[greedy, k], -1))
    accepted = np.asarray(want.num_accepted)[greedy]
    assert accepted.min() < k and accepted.max() > 0                              # matches and mismatches
    for seed in range(4):
        got = scv_jax.rejection_sample(drafts.reshape(-1), cu, q.reshape(-1, v), p[:, :k].reshape(-1, v), bonus,
                                       key=jax.random.key(seed), max_spec_len=k)
        np.testing.assert_array_equal(np.asarray(got.output_token_ids)[greedy], np.asarray(want.output_token_ids)[greedy])
        np.testing.assert_array_equal(np.asarray(got.num_accepted)[greedy], accepted)
