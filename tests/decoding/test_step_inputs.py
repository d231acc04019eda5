"""``step_inputs.prefill_chunks``: split over calls of at most ``max_rows`` requests, the calls carry the
same rows' inputs, in the same order, as unsplit calls."""

from __future__ import annotations

import types

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from scv_jax.decoding.step_inputs import prefill_chunks


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 7), st.integers(1, 5), st.integers(1, 8), st.integers(0, 2), st.integers(0, 2**31 - 1))
def test_split_prefill_calls_carry_the_unsplit_calls_rows(num_requests, max_rows, chunk, lookahead, seed):
    rng = np.random.default_rng(seed)
    max_len, width = 40, 6
    state = types.SimpleNamespace(tokens=rng.integers(0, 100, (num_requests + 2, max_len)),
                                  blocks=rng.integers(0, 50, (num_requests + 2, width)),
                                  num_blocks=rng.integers(1, width + 1, num_requests + 2))
    rows = rng.permutation(num_requests + 2)[:num_requests]
    count = rng.integers(0, 20, num_requests)           # 0: a request with nothing to prefill
    begin = rng.integers(0, max_len - 20, num_requests)
    whole = list(prefill_chunks(state, rows, begin, count, chunk, lookahead))
    split = list(prefill_chunks(state, rows, begin, count, chunk, lookahead, max_rows=max_rows))
    assert all(len(sub) <= max_rows for _, sub, _ in split)
    for done, sub, inputs in whole:        # each unsplit call: the split calls of the same chunk, in order
        parts = [(s, i) for d, s, i in split if d == done]
        assert np.array_equal(np.concatenate([s for s, _ in parts]), sub)
        for name in ("tokens", "start", "count"):
            assert np.array_equal(np.concatenate([i[name] for _, i in parts]), inputs[name])
        for s, i in parts:                 # block tables as wide as the call's own rows need
            assert np.array_equal(i["block_tables"], state.blocks[s, :int(state.num_blocks[s].max())])
    assert sum(len(s) for _, s, _ in split) == sum(len(s) for _, s, _ in whole)
