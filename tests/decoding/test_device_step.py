"""The decode step on a ragged batch of given drafts: each request verifies its own first num_drafts[b]
drafts, takes its bonus token after its last one, and commits exactly its accepted K/V; the result
does not depend on the other requests."""

from __future__ import annotations

import functools

import jax
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import scv_jax
from scv_jax.decoding.device_step import (SplitModel, StepRow, compact_drafts, make_decode_step, make_prefill_step,
                                           ragged_slots)
from tests.models.fixtures import TINY, tiny_model

BLOCK, BLOCKS_PER_REQUEST, BATCH, K = 8, 4, 4, 3
PROMPT_LENS = (5, 9, 2, 7)


@functools.cache
def setup():
    """The tiny target split once, its jitted prefill and decode steps, and the requests' prompts."""
    model = tiny_model(TINY, seed=0)
    split, params = SplitModel.split(model)
    prefill = jax.jit(make_prefill_step(split, None, BLOCK), static_argnames=("backend",))
    step = jax.jit(make_decode_step(split, None, BLOCK), static_argnames=("k", "greedy", "backend"))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, TINY.vocab_size, n).tolist() for n in PROMPT_LENS]
    forward = jax.jit(lambda tokens: model(tokens))
    return model, params, prefill, step, prompts, forward


def greedy_next(forward, tokens: list[int]) -> int:
    return int(np.argmax(np.asarray(forward(np.array([tokens])))[0, -1]))


def prefilled(rows: list[int]):
    """A cache holding every prompt of ``rows`` but its last token; their block tables."""
    _, params, prefill, _, prompts, _ = setup()
    cache = scv_jax.PagedKVCache.create(TINY.num_layers, BATCH * BLOCKS_PER_REQUEST, BLOCK, TINY.num_kv_heads,
                                        TINY.head_dim, dtype="float32")
    cache = cache.replace(v_pages=jax.numpy.zeros_like(cache.v_pages))
    tables = np.array([np.arange(BLOCKS_PER_REQUEST) + r * BLOCKS_PER_REQUEST for r in rows], np.int32)
    tokens = np.zeros((len(rows), 16), np.int32)
    for i, r in enumerate(rows):
        tokens[i, :PROMPT_LENS[r] - 1] = prompts[r][:-1]
    count = np.array([PROMPT_LENS[r] - 1 for r in rows], np.int32)
    cache, _ = prefill(params, None, cache, None, tables, tokens, np.zeros(len(rows), np.int32), count)
    return cache, tables


def run_step(rows: list[int], drafts: np.ndarray, num_drafts: np.ndarray):
    """One greedy step of the requests ``rows`` with given drafts: (emitted tokens, accepted, cache)."""
    _, params, _, step, prompts, _ = setup()
    cache, tables = prefilled(rows)
    step_rows = np.zeros((len(rows), StepRow.WIDTH), np.int32)
    for i, r in enumerate(rows):
        step_rows[i, StepRow.LAG], step_rows[i, StepRow.CONTEXT] = 1, PROMPT_LENS[r] - 1
        step_rows[i, StepRow.REQUEST_ID], step_rows[i, StepRow.NUM_DRAFTS] = r, num_drafts[i]
        step_rows[i, StepRow.TOKENS:] = ([0] + prompts[r])[-2:]
    cache, _, summary = step(params, None, cache, None, tables, step_rows, np.zeros(2, np.uint32),
                             np.float32(1.0), drafts.astype(np.int32), k=K, greedy=True)
    host = summary.fetch(len(rows))
    return host.token_lists(), host.num_accepted, cache, tables


@st.composite
def ragged_drafts(draw):
    """Per request: how many drafts it verifies and how many of them follow the target's greedy text."""
    model, _, _, _, prompts, forward = setup()
    num_drafts = np.array([draw(st.integers(0, K)) for _ in range(BATCH)])
    drafts = np.zeros((BATCH, K), np.int64)
    for b in range(BATCH):
        matching = draw(st.integers(0, K))
        text = list(prompts[b])
        for j in range(K):
            right = greedy_next(forward, text)
            drafts[b, j] = right if j < matching else (right + 1 + draw(st.integers(0, 14))) % TINY.vocab_size
            text.append(int(drafts[b, j]))
    return drafts, num_drafts


@given(ragged_drafts())
def test_each_request_verifies_its_own_drafts(case):
    drafts, num_drafts = case
    _, _, _, _, prompts, forward = setup()
    tokens, accepted, cache, tables = run_step(list(range(BATCH)), drafts, num_drafts)
    for b in range(BATCH):
        # greedy reference: accept while the draft is the target's argmax, then emit the target's token
        text, expected = list(prompts[b]), []
        for j in range(num_drafts[b] + 1):
            right = greedy_next(forward, text)
            expected.append(right)
            if j == num_drafts[b] or drafts[b, j] != right:
                break
            text.append(right)
        assert tokens[b] == expected and accepted[b] == len(expected) - 1
        # alone in its batch, the request gets the same tokens and the same cache rows
        alone_tokens, _, alone_cache, alone_tables = run_step([b], drafts[b:b + 1], num_drafts[b:b + 1])
        assert alone_tokens[0] == expected
        positions = np.arange(PROMPT_LENS[b] - 1 + len(expected) + 2)
        slots = scv_jax.slots_from_block_table(tables[b], positions, BLOCK)
        alone_slots = scv_jax.slots_from_block_table(alone_tables[0], positions, BLOCK)
        got_k, _ = scv_jax.gather_kv(cache, slots)
        want_k, _ = scv_jax.gather_kv(alone_cache, alone_slots)
        np.testing.assert_allclose(np.asarray(got_k), np.asarray(want_k), rtol=1e-5, atol=1e-5)  # batch shape
        # the pending token and the accepted drafts are committed; nothing after them
        written = np.abs(np.asarray(got_k)).sum(axis=(0, 2, 3)) > 0
        assert written.tolist() == [p < PROMPT_LENS[b] - 1 + len(expected) for p in positions]


@given(st.data())
def test_ragged_slots_compact_each_part_within_its_own_slots(data):
    """Part s's drafts, request by request, fill the start of its B * k / shards slots; ``cu`` counts them."""
    shards = data.draw(st.sampled_from([1, 2, 4]))
    rows, k = data.draw(st.integers(1, 3)), data.draw(st.integers(0, 4))
    num_drafts = np.array(data.draw(st.lists(st.integers(0, k), min_size=shards * rows, max_size=shards * rows)))
    cu, source = ragged_slots(jax.numpy.asarray(num_drafts, jax.numpy.int32), k, shards)
    grid = np.arange(shards * rows * k * 2).reshape(shards * rows, k, 2)
    compacted = np.asarray(compact_drafts(jax.numpy.asarray(grid), source))
    assert np.asarray(cu).tolist() == [0, *np.cumsum(num_drafts).tolist()]
    assert compacted.shape == (shards * rows * k, 2) and (compacted.min(initial=0) >= 0)
    for s in range(shards):
        mine = range(s * rows, (s + 1) * rows)
        expected = [grid[b, j] for b in mine for j in range(num_drafts[b])]
        got = compacted[s * rows * k: s * rows * k + len(expected)]
        assert got.tolist() == np.array(expected).reshape(-1, 2).tolist()
