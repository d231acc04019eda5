"""The logit controls: ``controlled_logits`` against a float64 numpy oracle of vLLM's order (bias and masks,
then repetition, frequency and presence penalties; hypothesis), the wrong orders told apart, and
``SamplingParams``' new fields checked on construction (one line naming the field) with ``bias_row`` and
``bad_word_table``. ``controlled_row`` is the oracle the decoder's tests use too (bad words of several
tokens: vLLM's rule over the output tokens)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from scv_jax import SamplingParams
from scv_jax.sampling_params import ANY_TOKEN, MAX_BAD_WORD_LEN, MAX_BAD_WORDS
from scv_jax.ops.sampling.controls import controlled_logits


def controlled_row(logits: np.ndarray, prompt, output, params: SamplingParams, stops=()) -> np.ndarray:
    """float64[V]: one position's logits after ``params``' controls, given the prompt and the output so
    far (vLLM: bias, allowed tokens, bad words and min_tokens first, then the penalties). A bad word of
    several tokens masks its last token where the output so far ends with the others."""
    vocab = logits.shape[-1]
    x = logits.astype(np.float64) + params.bias_row(vocab)
    for word in params.bad_words_token_ids:
        if 1 < len(word) <= len(output) + 1 and list(output[len(output) - len(word) + 1:]) == list(word[:-1]):
            x[word[-1]] = -np.inf
    if len(output) < params.min_tokens:
        x[list(stops)] = -np.inf
    counts = np.bincount(np.asarray(output, np.int64), minlength=vocab).astype(np.float64)
    seen = (counts > 0) | np.isin(np.arange(vocab), prompt)
    rep = params.repetition_penalty
    x = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
    return x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)


@st.composite
def control_cases(draw):
    rows, vocab = draw(st.integers(1, 4)), draw(st.integers(2, 12))
    logits = draw(st.lists(st.floats(-8, 8, width=32), min_size=rows * vocab, max_size=rows * vocab))
    tokens = st.integers(0, vocab - 1)
    params, prompts, outputs = [], [], []
    for _ in range(rows):
        params.append(SamplingParams(
            presence_penalty=draw(st.floats(-2, 2)), frequency_penalty=draw(st.floats(-2, 2)),
            repetition_penalty=draw(st.sampled_from([1.0, 0.5, 1.3, 2.0])),
            logit_bias=draw(st.dictionaries(tokens, st.floats(-100, 100), max_size=3)),
            allowed_token_ids=draw(st.none() | st.lists(tokens, min_size=1, max_size=vocab)),
            bad_words_token_ids=[[t] for t in draw(st.lists(tokens, max_size=2))]))
        prompts.append(draw(st.lists(tokens, max_size=6)))
        outputs.append(draw(st.lists(tokens, max_size=8)))
    return np.float32(logits).reshape(rows, vocab), params, prompts, outputs


def _inputs(logits, params, prompts, outputs):
    rows, vocab = logits.shape
    counts = np.stack([np.bincount(np.asarray(o, np.int64), minlength=vocab) for o in outputs]).astype(np.int32)
    in_prompt = np.stack([np.isin(np.arange(vocab), p) for p in prompts])
    bias = np.stack([p.bias_row(vocab) for p in params])
    return (logits, bias, counts, in_prompt, np.float32([p.presence_penalty for p in params]),
            np.float32([p.frequency_penalty for p in params]), np.float32([p.repetition_penalty for p in params]))


@given(case=control_cases())
def test_controlled_logits_match_the_oracle(case):
    logits, params, prompts, outputs = case
    got = np.asarray(controlled_logits(*_inputs(*case)))
    want = np.stack([controlled_row(*row) for row in zip(logits, prompts, outputs, params)])
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-3)


def test_neutral_controls_leave_the_logits_and_the_order_is_vllms():
    logits = np.float32([[1.5, -0.5, 0.25, 3.0]])
    neutral = SamplingParams()
    np.testing.assert_array_equal(np.asarray(controlled_logits(*_inputs(logits, [neutral], [[0, 1]], [[1, 1]]))),
                                  logits)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0,
                            logit_bias={1: 2.0})
    got = np.asarray(controlled_logits(*_inputs(logits, [params], [[0]], [[1, 1, 3]])))[0]
    # token 0: in the prompt only; 1: biased to 1.5, then seen twice; 2: unseen; 3: seen once
    np.testing.assert_allclose(got, [0.75, 1.5 / 2 - 0.5 - 0.5, 0.25, 1.5 - 0.25 - 0.5])
    assert got[1] != (-0.5 * 2 - 0.5 - 0.5) + 2.0                    # the bias after the penalties: another value


def test_bias_row_masks_and_biases():
    row = SamplingParams(logit_bias={0: -3.0, 2: 5.0}, allowed_token_ids=[0, 1, 2],
                         bad_words_token_ids=[[1]]).bias_row(5)
    np.testing.assert_array_equal(row, np.float32([-3.0, -np.inf, 5.0, -np.inf, -np.inf]))
    params = SamplingParams(logit_bias={7: 1}, max_tokens=4, min_tokens=4)
    assert params.logit_bias == ((7, 1.0),) and params.controlled and params.token_ids() == (7,)
    assert not SamplingParams(min_tokens=3).controlled and SamplingParams(repetition_penalty=1.1).penalties


def test_bad_words_of_several_tokens_go_to_the_table():
    params = SamplingParams(bad_words_token_ids=[[4], [1, 2], [3, 0, 3]])
    np.testing.assert_array_equal(params.bias_row(5), np.float32([0, 0, 0, 0, -np.inf]))
    table = params.bad_word_table()
    assert table.shape == (MAX_BAD_WORDS, MAX_BAD_WORD_LEN) and (table[2:] == -1).all()
    assert table[0].tolist() == [ANY_TOKEN] * (MAX_BAD_WORD_LEN - 2) + [1, 2]
    assert table[1].tolist() == [ANY_TOKEN] * (MAX_BAD_WORD_LEN - 3) + [3, 0, 3]
    assert params.token_ids() == (4, 1, 2, 3, 0, 3)


@pytest.mark.parametrize("field, value, error", [
    ("presence_penalty", 2.5, ValueError), ("presence_penalty", "1", TypeError),
    ("frequency_penalty", -2.1, ValueError), ("frequency_penalty", float("nan"), ValueError),
    ("repetition_penalty", 0.0, ValueError), ("repetition_penalty", None, TypeError),
    ("logit_bias", {1: 101}, ValueError), ("logit_bias", {-1: 1}, ValueError), ("logit_bias", {"1": 1}, TypeError),
    ("logit_bias", [1, 2], TypeError), ("allowed_token_ids", [], ValueError), ("allowed_token_ids", "ab", TypeError),
    ("allowed_token_ids", [-1], ValueError), ("bad_words_token_ids", [list(range(MAX_BAD_WORD_LEN + 1))], ValueError),
    ("bad_words_token_ids", [[1, 2]] * (MAX_BAD_WORDS + 1), ValueError),
    ("bad_words_token_ids", [[]], ValueError), ("bad_words_token_ids", "x", TypeError),
    ("min_tokens", -1, ValueError), ("min_tokens", 17, ValueError), ("min_tokens", 1.0, TypeError)])
def test_bad_controls_raise_one_line_naming_the_field(field, value, error):
    with pytest.raises(error, match=rf"^SamplingParams\.{field} must be [^\n]*, got ") as info:
        SamplingParams(**{field: value})
    assert "\n" not in str(info.value)
