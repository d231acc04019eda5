"""One step in flight (``DecoderConfig.overlap``): the device's carry moves a request's step row exactly as
the host's bookkeeping would (``RequestBatch.advance`` then ``decode_inputs``), and an engine whose
steps overlap emits what the synchronous loop emits, under arrivals, aborts, stops and budgets."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scv_jax import DecoderConfig, Engine, SamplingParams, SpeculativeDecoder
from scv_jax.decoding import carry
from scv_jax.decoding.block_pool import BlockPool
from scv_jax.decoding.plan import CarryColumn, SamplingColumn, StepRow
from scv_jax.decoding.positions import lag_after_step
from scv_jax.decoding.requests import RequestBatch
from scv_jax.decoding.step_inputs import decode_inputs
from tests.decoding.common import SMALL, prompts
from tests.decoding.test_engine import run, tokens

SLOTS, CAPACITY, K = 6, 40, 3
carried_inputs = jax.jit(carry.carried_inputs)
carry_after_step = jax.jit(carry.carry_after_step, static_argnums=(4, 5, 6))


def _batch(rng: np.random.Generator, num: int) -> RequestBatch:
    """``num`` running requests with random tokens, budgets, stop ids and min_tokens."""
    state = RequestBatch(SLOTS, CAPACITY, 4, CAPACITY // 4, [BlockPool(64)])
    for _ in range(num):
        prompt = rng.integers(0, 12, rng.integers(1, 8)).tolist()
        sampling = np.zeros(SamplingColumn.WIDTH, np.float32)
        sampling[SamplingColumn.MIN_TOKENS] = rng.integers(0, 4)
        stops = tuple(rng.choice(12, rng.integers(0, 3), replace=False).tolist())
        state.start(prompt, len(prompt), int(rng.integers(1, 7)), 0, sampling, np.zeros(2, np.int32), stops,
                    lag=int(rng.integers(1, 3)))
    rows = state.active
    state.ensure(rows, state.length[rows] + 2 * (K + 1))
    return state


@settings(max_examples=60, deadline=None)
@given(st.integers(1, SLOTS), st.integers(0, 2**31 - 1))
def test_the_carry_moves_a_row_as_the_host_does(num, seed):
    """Step t's summary (random emitted tokens) written to the carry, then step t + 1's host rows (built
    before t was fetched) moved on by it, equal the rows the host builds after applying t: context,
    budget, lag, last tokens, drafts capped at the budget, min_tokens; a request t ended runs as padding."""
    rng = np.random.default_rng(seed)
    state = _batch(rng, num)
    rows = rng.permutation(state.active)
    width = int(state.num_blocks[rows].max())
    num_drafts = rng.integers(0, K + 1, num)
    before = decode_inputs(state, rows, np.arange(num), num, width, np.minimum(num_drafts, state.budget[rows] - 1))
    emitted = rng.integers(1, K + 2, num)
    tokens_out = np.where(np.arange(K + 1) < emitted[:, None], rng.integers(0, 12, (num, K + 1)), -1)
    accepted = emitted - 1
    packed = np.concatenate([tokens_out, accepted[:, None], emitted[:, None], accepted[:, None]], 1).astype(np.int32)
    written = carry_after_step(carry.zeros(SLOTS), before["rows"], packed, np.ones(num, bool),
                                     lag_after_step, K, 2)
    # the next step, planned from the same (stale) host state, every row carried
    later = decode_inputs(state, rows, np.arange(num), num, width, np.full(num, K))
    later["rows"][:, StepRow.CARRIED] = 1
    moved_rows, moved_sampling, moved_tables = jax.device_get(
        carried_inputs(written, later["rows"], later["sampling"], later["block_tables"]))
    # the host's reference: apply step t, then build step t + 1's rows
    lag = lag_after_step(state.lag[rows], accepted, K)
    count, done, _ = state.advance(rows, tokens_out, emitted)
    state.lag[rows] = np.minimum(lag, 2)
    assert np.array_equal(np.asarray(written)[rows, CarryColumn.EMITTED], count)
    assert np.array_equal(np.asarray(written)[rows, CarryColumn.DONE], done)
    exact = decode_inputs(state, rows, np.arange(num), num, width, np.minimum(K, np.maximum(state.budget[rows] - 1, 0)))
    live = ~done
    for column in (StepRow.CONTEXT, StepRow.BUDGET, StepRow.LAG, StepRow.NUM_DRAFTS):
        assert np.array_equal(moved_rows[live, column], exact["rows"][live, column]), column
    assert np.array_equal(moved_rows[live, StepRow.TOKENS:], exact["rows"][live, StepRow.TOKENS:])
    assert np.array_equal(moved_sampling[live], exact["sampling"][live])
    assert np.array_equal(moved_tables[live], later["block_tables"][live])
    assert (moved_tables[done] == -1).all() and (moved_rows[done, StepRow.NUM_DRAFTS] == 0).all()
    assert (moved_rows[done, StepRow.BUDGET] == 0).all()


def test_rows_not_carried_and_padding_are_left_alone():
    """A row not marked carried reads nothing from the carry, and padding rows (no budget) write nothing."""
    rows = np.zeros((3, StepRow.WIDTH), np.int32)
    rows[:, StepRow.SLOT], rows[:, StepRow.BUDGET], rows[:, StepRow.CONTEXT] = [0, 1, 2], [5, 0, 5], 7
    full = carry.zeros(SLOTS).at[:, CarryColumn.EMITTED].set(3).at[:, CarryColumn.DONE].set(1)
    sampling, tables = np.zeros((3, SamplingColumn.WIDTH), np.float32), np.arange(6, dtype=np.int32).reshape(3, 2)
    moved, _, moved_tables = carried_inputs(full, rows, sampling, tables)
    assert np.array_equal(moved, rows) and np.array_equal(moved_tables, tables)
    packed = np.array([[4, -1, 0, 1, 0]] * 3, np.int32)
    written = np.asarray(carry_after_step(carry.zeros(SLOTS), rows, packed, np.array([True, True, False]),
                                                lag_after_step, 1, 2))
    assert written[0, CarryColumn.EMITTED] == 1 and not written[1:].any()


@pytest.fixture(scope="module")
def decoders(target, partial_draft):
    """The same draft-model decoder with one step in flight and without."""
    config = DecoderConfig(**{**vars(SMALL), "k": 3})
    return {overlap: SpeculativeDecoder(target, partial_draft, config=DecoderConfig(**{**vars(config), "overlap": overlap}))
            for overlap in (True, False)}


def test_overlap_is_the_default_on_one_device(decoders):
    assert DecoderConfig().overlap
    assert Engine(decoders[True]).overlaps and not Engine(decoders[False]).overlaps


@settings(max_examples=6, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_overlapped_engine_emits_what_the_synchronous_one_does(decoders, seed):
    """Random arrivals, budgets, stop ids, sampled and greedy requests, and aborts: every request not
    aborted gets the same tokens with one step in flight as without; an aborted one a prefix of them, and
    its blocks come back."""
    rng = np.random.default_rng(seed)
    count = 6
    batch = prompts(seed, count, alphabet=16)
    arrivals: dict[int, list] = {}
    for i, prompt in enumerate(batch):
        params = SamplingParams(max_tokens=int(rng.integers(1, 12)), temperature=float(rng.choice([0.0, 1.0])),
                                seed=i, stop_token_ids=rng.choice(16, int(rng.integers(0, 2))).tolist())
        arrivals.setdefault(int(rng.integers(0, 6)), []).append((prompt, params, str(i)))
    aborted = {str(i): int(rng.integers(1, 8)) for i in rng.choice(count, 2, replace=False)}
    results = {}
    for overlap, decoder in decoders.items():
        engine = Engine(decoder)
        steps = {step: list(items) for step, items in arrivals.items()}
        outputs: dict[str, list] = {}
        for step in range(200):
            for prompt, params, request_id in steps.pop(step, []):
                engine.add_request(prompt, params, request_id)
            for request_id, when in aborted.items():
                if when == step:
                    engine.abort(request_id)
            if not engine.has_unfinished() and not steps and step > max(aborted.values()):
                break
            for out in engine.step():
                outputs.setdefault(out.request_id, []).append(out)
        assert not engine.has_unfinished() and engine.num_free_blocks == engine.num_blocks
        results[overlap] = outputs
    for request_id in map(str, range(count)):
        on, off = results[True].get(request_id, []), results[False].get(request_id, [])
        if request_id in aborted:
            on_tokens = [t for o in on for t in o.new_token_ids]
            full = list(alone_tokens(decoders[False], arrivals, request_id))
            assert on_tokens == full[:len(on_tokens)]
        else:
            assert tokens(results[True], request_id) == tokens(results[False], request_id)
            assert on[-1].finish_reason == off[-1].finish_reason


def alone_tokens(decoder, arrivals: dict[int, list], request_id: str) -> list[int]:
    """The tokens a request gets alone (its stream and greedy tokens do not depend on the batch)."""
    prompt, params = next((p, s) for items in arrivals.values() for p, s, r in items if r == request_id)
    engine = Engine(decoder)
    engine.add_request(prompt, params, request_id)
    return tokens(run(engine), request_id)


def test_an_abort_while_a_step_is_in_flight_frees_the_blocks(decoders, autoregressive):
    """Aborted while its step runs, a request ends "abort" with no tokens of that step; its blocks return,
    and the other request's tokens are its tokens alone."""
    engine = Engine(decoders[True])
    first, second = prompts(11, 2, alphabet=16)
    engine.add_request(first, SamplingParams(max_tokens=20), "a")
    engine.add_request(second, SamplingParams(max_tokens=20), "b")
    seen: dict[str, list] = {}
    while "a" not in seen:
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    engine.abort("a")                              # a step of "a" is in flight now
    outputs = run(engine)
    assert [o.finish_reason for o in outputs["a"]] == ["abort"] and not outputs["a"][0].new_token_ids
    assert engine.num_free_blocks == engine.num_blocks
    seen["b"] = seen.get("b", []) + outputs["b"]
    assert tokens(seen, "b") == autoregressive.generate([second], 20).tokens[0]
