"""SamplingParams: vLLM's fields, checked on construction; batch_sampling_arrays."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from scv_jax import SamplingParams, batch_sampling_arrays


def test_defaults_are_greedy_and_values_are_normalised():
    params = SamplingParams()
    assert params.greedy and not params.filters and params.max_tokens == 16 and params.seed is None
    sampled = SamplingParams(temperature=1, top_k=np.int64(5), stop_token_ids=[2, np.int32(7)], seed=2 ** 63 - 1,
                             logprobs=20)
    assert not sampled.greedy and sampled.filters and sampled.stop_token_ids == (2, 7)
    assert type(sampled.temperature) is float and type(sampled.top_k) is int
    assert SamplingParams(temperature=1e-6).greedy and not SamplingParams(temperature=1e-5).greedy
    assert not SamplingParams(temperature=0.7, top_k=-1).filters
    assert params.num_speculative_tokens is None
    assert type(SamplingParams(num_speculative_tokens=np.int64(0)).num_speculative_tokens) is int
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 1.0


@pytest.mark.parametrize("field, value, error", [
    ("temperature", -0.1, ValueError), ("temperature", float("nan"), ValueError),
    ("temperature", float("inf"), ValueError), ("temperature", True, TypeError), ("temperature", "1", TypeError),
    ("top_k", -2, ValueError), ("top_k", 1.0, TypeError), ("top_k", True, TypeError),
    ("top_p", 0, ValueError), ("top_p", 1.5, ValueError), ("top_p", float("nan"), ValueError),
    ("min_p", -0.1, ValueError), ("min_p", 1.1, ValueError), ("min_p", None, TypeError),
    ("seed", -1, ValueError), ("seed", 2 ** 63, ValueError), ("seed", 1.0, TypeError), ("seed", False, TypeError),
    ("max_tokens", 0, ValueError), ("max_tokens", True, TypeError),
    ("stop_token_ids", [1, -1], ValueError), ("stop_token_ids", "ab", TypeError), ("stop_token_ids", 3, TypeError),
    ("stop_token_ids", [True], TypeError),
    ("ignore_eos", 1, TypeError), ("logprobs", 21, ValueError), ("logprobs", -1, ValueError),
    ("logprobs", True, TypeError), ("num_speculative_tokens", -1, ValueError),
    ("num_speculative_tokens", 2.0, TypeError), ("num_speculative_tokens", True, TypeError)])
def test_bad_values_raise_one_line_naming_the_field(field, value, error):
    with pytest.raises(error, match=rf"^SamplingParams\.{field} must be [^\n]*, got ") as info:
        SamplingParams(**{field: value})
    assert "\n" not in str(info.value)


def test_the_message_reads_as_documented():
    with pytest.raises(ValueError, match=r"^SamplingParams.top_p must be a float in \(0, 1\], got 0$"):
        SamplingParams(top_p=0)


def test_batch_arrays_switch_greedy_rows_filters_off_and_pad_greedy():
    arrays = batch_sampling_arrays([SamplingParams(top_k=3, top_p=0.5, min_p=0.1),   # greedy: filters ignored
                                    SamplingParams(temperature=0.8, top_k=-1, top_p=0.9, min_p=0.05),
                                    SamplingParams(temperature=1.0, top_k=2 ** 40)], rows=4)
    np.testing.assert_array_equal(arrays.temperature, np.float32([0, 0.8, 1, 0]))
    np.testing.assert_array_equal(arrays.top_k, [0, 0, 2 ** 31 - 1, 0])
    np.testing.assert_array_equal(arrays.top_p, np.float32([1, 0.9, 1, 1]))
    np.testing.assert_array_equal(arrays.min_p, np.float32([0, 0.05, 0, 0]))
    assert [a.dtype for a in arrays] == [np.float32, np.int32, np.float32, np.float32]
    with pytest.raises(ValueError, match="rows must be an int >= len"):
        batch_sampling_arrays([SamplingParams()] * 2, rows=1)
