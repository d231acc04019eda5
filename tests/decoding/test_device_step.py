"""The decode step on a ragged batch of given drafts: each request verifies its own first num_drafts[b]
drafts, takes its bonus token after its last one, and commits exactly its accepted K/V; the result
does not depend on the other requests."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import scv_jax
from pallas_kernels.tree_mask import ancestor_mask, depths
from scv_jax.decoding.chain_verifier import ChainVerifier, compact_drafts, fitting_drafts, packed_layout, ragged_slots
from scv_jax.decoding.device_step import (SamplingColumn, SplitModel, StepRow, drafts_previous, latest,
                                          make_prefill_step)
from scv_jax.decoding.step_fn import make_decode_step
from scv_jax.decoding.tree_verifier import path_previous
from tests.models.fixtures import TINY, tiny_model

BLOCK, BLOCKS_PER_REQUEST, BATCH, K = 8, 4, 4, 3
PROMPT_LENS = (5, 9, 2, 7)


@functools.cache
def setup():
    """The tiny target split once, its jitted prefill and decode steps, and the requests' prompts."""
    model = tiny_model(TINY, seed=0)
    split, params = SplitModel.split(model)
    prefill = jax.jit(make_prefill_step(split, None, BLOCK), static_argnames=("backend",))
    step = jax.jit(make_decode_step(split, None, BLOCK, ChainVerifier()),
                   static_argnames=("k", "greedy", "backend", "packed_k"))
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


def run_step(rows: list[int], drafts: np.ndarray, num_drafts: np.ndarray, *, packed_k: int = 0, greedy: bool = True):
    """One step (greedy by default) of the requests ``rows`` with given drafts: (emitted tokens, accepted,
    cache, block tables)."""
    _, params, _, step, prompts, _ = setup()
    cache, tables = prefilled(rows)
    step_rows = np.zeros((len(rows), StepRow.WIDTH), np.int32)
    for i, r in enumerate(rows):
        step_rows[i, StepRow.LAG], step_rows[i, StepRow.CONTEXT] = 1, PROMPT_LENS[r] - 1
        step_rows[i, StepRow.KEY], step_rows[i, StepRow.NUM_DRAFTS] = r, num_drafts[i]
        step_rows[i, StepRow.STOP:StepRow.TOKENS] = -1
        step_rows[i, StepRow.TOKENS:] = ([0] + prompts[r])[-2:]
    sampling = np.zeros((len(rows), SamplingColumn.WIDTH), np.float32)
    sampling[:, [SamplingColumn.TEMPERATURE, SamplingColumn.TOP_P]] = 0.0 if greedy else 1.0, 1.0
    cache, _, summary = step(params, None, cache, None, tables, step_rows, sampling, drafts.astype(np.int32),
                             k=K, greedy=greedy, packed_k=packed_k)
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
@pytest.mark.slow
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


def assert_same_commits(rows: list[int], first, second) -> None:
    """Two steps' caches hold the same K/V at every position of the requests ``rows``."""
    for i, b in enumerate(rows):
        positions = np.arange(BLOCKS_PER_REQUEST * BLOCK)
        got, want = (scv_jax.gather_kv(cache, scv_jax.slots_from_block_table(tables[i], positions, BLOCK))
                     for cache, tables in (first, second))
        for x, y in zip(got, want):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)


@given(ragged_drafts(), st.integers(1, K - 1))
def test_packed_step_equals_the_dense_step(case, packed_k):
    """A packed step (B * (packed_k + 1) target tokens) emits and commits what the dense step does for the
    same drafts, cut from the last requests on to fit its B * packed_k draft slots."""
    drafts, num_drafts = case
    rows = list(range(BATCH))
    fitting = np.asarray(fitting_drafts(jax.numpy.asarray(num_drafts, jax.numpy.int32), BATCH * packed_k))
    tokens, accepted, *dense = run_step(rows, drafts, fitting)
    packed_tokens, packed_accepted, *packed = run_step(rows, drafts, num_drafts, packed_k=packed_k)
    assert packed_tokens == tokens and packed_accepted.tolist() == accepted.tolist()
    assert_same_commits(rows, dense, packed)


def test_packed_sampling_step_equals_the_dense_step():
    """With rejection sampling too (the same random stream per request), on fixed cases."""
    rng = np.random.default_rng(7)
    rows = list(range(BATCH))
    for _ in range(6):
        drafts = rng.integers(0, TINY.vocab_size, (BATCH, K))
        num_drafts = rng.integers(0, K, BATCH)          # sum <= BATCH * (K - 1): nothing cut
        tokens, accepted, *dense = run_step(rows, drafts, num_drafts, greedy=False)
        packed_tokens, packed_accepted, *packed = run_step(rows, drafts, num_drafts, packed_k=K - 1, greedy=False)
        assert packed_tokens == tokens and packed_accepted.tolist() == accepted.tolist()
        assert_same_commits(rows, dense, packed)


@given(st.lists(st.integers(0, 5), max_size=6), st.integers(0, 40), st.integers(0, 12))
@pytest.mark.slow
def test_packed_layout_and_fitting_drafts(num_drafts, extra_tokens, capacity):
    """Request b's tokens are offsets 0..n_b at tokens cu[b] + b..., the rest padding (offset = width);
    fitting_drafts keeps each request's drafts while the running sum fits ``capacity``."""
    width = 6
    fitted = np.asarray(fitting_drafts(jax.numpy.asarray(num_drafts, jax.numpy.int32), capacity)).tolist()
    expected, left = [], capacity
    for n in num_drafts:
        expected.append(min(n, left))
        left -= expected[-1]
    assert fitted == expected
    if not num_drafts:
        return
    num_tokens = sum(num_drafts) + len(num_drafts) + extra_tokens
    layout = packed_layout(jax.numpy.asarray(num_drafts, jax.numpy.int32), num_tokens, width)
    cells = [(b, t) for b, n in enumerate(num_drafts) for t in range(n + 1)]
    got = list(zip(np.asarray(layout.rows).tolist(), np.asarray(layout.offsets).tolist()))
    assert got[:len(cells)] == cells and layout.width == width
    assert all(offset == width for _, offset in got[len(cells):])


@given(st.data())
@pytest.mark.slow
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


def test_the_last_output_tokens_of_each_position_for_bad_words():
    """The histories a bad word's other tokens are matched against: after a step's emitted tokens
    (``latest``), at chain position t (the drafts before t after the committed tokens) and after a
    tree's node (its path)."""
    assert np.asarray(latest(np.int32([[1, 2, 3], [-1, -1, 6]]), np.int32([[4, 5, -1], [7, -1, -1]]),
                             np.int32([2, 1]))).tolist() == [[3, 4, 5], [-1, 6, 7]]
    assert np.asarray(drafts_previous(np.int32([[7, 8, 9]]), np.int32([[1, 2]]))).tolist() == [
        [[7, 8, 9], [8, 9, 1], [9, 1, 2]]]
    parents = np.int32([[-1, 0, 1, 0, 2]])          # the pending token; nodes 1 <- 2 <- 4 and 3 off the root
    got = path_previous(np.int32([[7, 8, 9]]), np.int32([[10, 11, 12, 13]]), parents, depths(ancestor_mask(parents)))
    assert np.asarray(got).tolist() == [[[7, 8, 9], [8, 9, 10], [9, 10, 11], [8, 9, 12], [10, 11, 13]]]
