"""filtered_probs and token_logprobs: the XLA path and the reference against a float64 oracle
(hypothesis), the shape contract, bad input, and no NaN from bad values inside jit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import scv_jax
from scv_jax.ops.sampling import api
from scv_jax.ops.sampling.reference import filtered_probs_reference
from scv_jax.ops.sampling.xla import filtered_probs_xla
from tests.ops.sampling.oracle import filtered

_reference = jax.jit(filtered_probs_reference)
_xla = jax.jit(filtered_probs_xla, static_argnames="candidates")


@st.composite
def filter_cases(draw, rows: int = 4):
    """(logits float32[R, V], temperature, top_k, top_p, min_p) with ties, odd V, V = 1, k >= V,
    top_p = 1, min_p = 1 and greedy rows mixed with sampled ones (few shapes: each compiles)."""
    v = draw(st.sampled_from([1, 2, 7, 33]))
    kind = draw(st.sampled_from(["grid", "normal", "equal", "masked"]))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    if kind == "grid":      # many ties
        logits = rng.integers(-4, 4, (rows, v)) / 2.0
    elif kind == "equal":
        logits = np.full((rows, v), draw(st.sampled_from([0.0, 3.5, -20.0])))
    else:
        logits = rng.normal(0, 2, (rows, v))
        if kind == "masked":
            logits[rng.random((rows, v)) < 0.4] = -np.inf
    per_row = lambda values: np.array([draw(st.sampled_from(values)) for _ in range(rows)])  # noqa: E731
    temperature = per_row([0.0, 0.0, 0.5, 1.0, 1.5, 1e-6]).astype(np.float32)
    top_k = per_row([0, -1, 1, 2, 3, v, v + 5]).astype(np.int32)
    top_p = per_row([1.0, 0.95, 0.8, 0.5, 0.3, 0.01]).astype(np.float32)
    min_p = per_row([0.0, 0.0, 0.05, 0.3, 1.0]).astype(np.float32)
    return logits.astype(np.float32), temperature, top_k, top_p, min_p


@given(case=filter_cases(), candidates=st.sampled_from([1, 3, 256]))
def test_xla_path_and_reference_match_the_float64_oracle(case, candidates):
    expected, ambiguous = filtered(*case)
    assume(not ambiguous)
    args = [jnp.asarray(a) for a in case]
    for probs in (_reference(*args), _xla(*args, candidates=candidates)):
        probs = np.asarray(probs)
        np.testing.assert_allclose(probs, expected, rtol=2e-5, atol=1e-6)
        np.testing.assert_array_equal(probs > 0, expected > 0)


@given(case=filter_cases())
def test_greedy_rows_are_the_one_hot_of_jnp_argmax(case):
    logits, temperature, *filters = case
    temperature = np.zeros_like(temperature)
    probs = np.asarray(scv_jax.filtered_probs(logits, temperature, *filters))
    np.testing.assert_array_equal(probs, np.eye(logits.shape[1])[np.asarray(jnp.argmax(logits, axis=-1))])


@given(data=st.data())
def test_bad_values_inside_jit_give_distributions(data):
    """NaN / inf / negative parameters and NaN / +-inf logits: finite probabilities summing to 1."""
    rows, v = 4, data.draw(st.sampled_from([1, 5, 40]))
    pick = lambda values, dtype: np.array([data.draw(st.sampled_from(values)) for _ in range(rows)], dtype)  # noqa
    odd = [np.nan, np.inf, -np.inf, -1.0, 0.0, 1e-30, 1e30, 0.5, 2.0]
    logits = np.random.default_rng(data.draw(st.integers(0, 1000))).normal(0, 3, (rows, v)).astype(np.float32)
    for _ in range(data.draw(st.integers(0, 6))):
        logits[data.draw(st.integers(0, rows - 1)), data.draw(st.integers(0, v - 1))] = data.draw(
            st.sampled_from([np.nan, np.inf, -np.inf]))
    for candidates in (2, 256):
        probs = np.asarray(_xla(jnp.asarray(logits), *(jnp.asarray(a) for a in (
            pick(odd, np.float32), pick([-5, -1, 0, 1, v, 2 ** 31 - 1], np.int32), pick(odd, np.float32),
            pick(odd, np.float32))), candidates=candidates))
        assert np.all(np.isfinite(probs)) and np.all(probs >= 0)
        np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)


def test_target_and_draft_shapes_and_the_rows_map_agree():
    """[B, k + 1, V] (the target), [B, V] (a draft step) and [N, V] with rows give the same rows."""
    b, t, v = 3, 4, 50
    logits = jax.random.normal(jax.random.key(1), (b, t, v)) * 3
    params = (jnp.float32([0.0, 0.7, 1.3]), jnp.int32([5, 0, 10]), jnp.float32([0.5, 0.9, 0.8]),
              jnp.float32([0.0, 0.1, 0.0]))
    target = np.asarray(scv_jax.filtered_probs(logits, *params))
    assert target.shape == (b, t, v) and target.dtype == np.float32
    np.testing.assert_array_equal(target[:, 2], np.asarray(scv_jax.filtered_probs(logits[:, 2], *params)))
    rows = jnp.int32([2, 0, 1, 1, 2, 0, 0])
    flat = logits.reshape(-1, v)[jnp.int32([11, 1, 4, 5, 8, 0, 3])]   # row i of request rows[i]
    np.testing.assert_array_equal(np.asarray(scv_jax.filtered_probs(flat, *params, rows=rows)),
                                  target.reshape(-1, v)[[11, 1, 4, 5, 8, 0, 3]])
    np.testing.assert_array_equal(target[0], np.eye(v)[np.asarray(jnp.argmax(logits[0], -1))])
    inside_jit = jax.jit(lambda x, *p: scv_jax.filtered_probs(x, *p))(logits, *params)   # in a device step
    np.testing.assert_allclose(np.asarray(inside_jit), target, rtol=1e-6, atol=1e-7)


def test_changing_the_greedy_and_sampled_mix_compiles_nothing():
    logits = jax.random.normal(jax.random.key(2), (4, 3, 64))
    mixes = [([0.0] * 4, [0] * 4, [1.0] * 4), ([0.8, 0.0, 1.0, 0.0], [0, 0, 5, 0], [0.9, 1.0, 1.0, 1.0]),
             ([1.0] * 4, [3] * 4, [0.5] * 4)]
    scv_jax.filtered_probs(logits, np.ones(4, np.float32), np.zeros(4, np.int32), np.ones(4, np.float32),
                           np.zeros(4, np.float32))
    before = api._filtered_probs._cache_size()
    for temperature, top_k, top_p in mixes:
        scv_jax.filtered_probs(logits, np.float32(temperature), np.int32(top_k), np.float32(top_p),
                               np.zeros(4, np.float32))
    assert api._filtered_probs._cache_size() == before


@pytest.mark.parametrize("change, message", [
    (dict(logits=np.zeros((3,), np.float32)), r"logits must be float\[B, \.\.\., V\]"),
    (dict(logits=np.zeros((2, 0), np.float32)), r"logits must be float\[B, \.\.\., V\]"),
    (dict(logits=np.zeros((2, 4), np.int32)), r"logits must be a floating array"),
    (dict(temperature=np.ones(3, np.float32)), r"temperature must be float32\[B\] with B = logits.shape\[0\] = 2"),
    (dict(top_k=np.ones(2, np.float32)), r"top_k must be an integer array"),
    (dict(top_p=np.ones((2, 1), np.float32)), r"top_p must be float32\[B\] \(rank 1\)"),
    (dict(min_p=[1, 2]), r"min_p must be a floating array"),
    (dict(rows=np.zeros(3, np.int32)), r"rows must be int32\[N\]"),
    (dict(backend="pallas"), r"filtered_probs: has no Pallas kernel"),
])
def test_bad_input_raises_naming_the_argument(change, message):
    args = dict(logits=np.zeros((2, 4), np.float32), temperature=np.ones(2, np.float32),
                top_k=np.zeros(2, np.int32), top_p=np.ones(2, np.float32), min_p=np.zeros(2, np.float32))
    args.update(change)
    with pytest.raises((ValueError, TypeError), match="filtered_probs: " + message.removeprefix("filtered_probs: ")):
        scv_jax.filtered_probs(**args)


@given(case=filter_cases(), num_top=st.integers(0, 3))
def test_token_logprobs_are_the_unfiltered_log_softmax(case, num_top):
    logits = case[0]
    v = logits.shape[1]
    assume(num_top <= v)
    ids = np.random.default_rng(v).integers(-1, v + 1, logits.shape[0]).astype(np.int32)
    out = scv_jax.token_logprobs(logits, ids, num_top)
    x = logits.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        expected = x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))
    expected = np.where(np.isfinite(x.max(-1, keepdims=True)), expected, -np.inf)
    in_vocab = (ids >= 0) & (ids < v)
    want = np.where(in_vocab, expected[np.arange(len(ids)), np.clip(ids, 0, v - 1)], -np.inf)
    np.testing.assert_allclose(np.asarray(out.logprob), want, atol=1e-5)
    order = np.argsort(-expected, axis=-1, kind="stable")[:, :num_top]
    np.testing.assert_array_equal(np.asarray(out.top_ids), order)
    np.testing.assert_allclose(np.asarray(out.top_logprobs), np.take_along_axis(expected, order, -1), atol=1e-5)


def test_token_logprobs_shapes_and_bad_input():
    logits = jax.random.normal(jax.random.key(3), (2, 5, 30))
    out = scv_jax.token_logprobs(logits, jnp.zeros((2, 5), jnp.int32), 20)
    assert out.logprob.shape == (2, 5) and out.top_ids.shape == out.top_logprobs.shape == (2, 5, 20)
    with pytest.raises(ValueError, match=r"token_logprobs: num_top must be <= 20"):
        scv_jax.token_logprobs(logits, jnp.zeros((2, 5), jnp.int32), 21)
    with pytest.raises(ValueError, match=r"token_logprobs: logits must be float\[\.\.\., V\]"):
        scv_jax.token_logprobs(logits, jnp.zeros((2,), jnp.int32), 1)
    with pytest.raises(ValueError, match=r"token_logprobs: num_top must be a Python int"):
        scv_jax.token_logprobs(logits, jnp.zeros((2, 5), jnp.int32), True)
