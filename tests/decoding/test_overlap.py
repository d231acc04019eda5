"""One step in flight (``DecoderConfig.overlap``): the device's carry moves a request's step row exactly as
the host's bookkeeping would (``RequestBatch.advance`` then ``decode_inputs``), and an engine whose
steps overlap emits what the synchronous loop emits, under arrivals, aborts, stops and budgets."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scv_jax import DecoderConfig, Engine, HostDrafter, NgramDrafter, SamplingParams, SpeculativeDecoder
from scv_jax.decoding import carry
from scv_jax.decoding.block_pool import BlockPool
from scv_jax.decoding.plan import CarryColumn, SamplingColumn, StepRow
from scv_jax.decoding.positions import lag_after_step
from scv_jax.decoding.requests import RequestBatch
from scv_jax.decoding.step_inputs import decode_inputs
from scv_jax.models import Transformer
from tests.decoding.common import SMALL, prompts
from tests.decoding.test_engine import run, tokens
from tests.models.fixtures import TINY

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
    full = carry.zeros(SLOTS)
    full[:, CarryColumn.EMITTED], full[:, CarryColumn.DONE] = 3, 1
    sampling, tables = np.zeros((3, SamplingColumn.WIDTH), np.float32), np.arange(6, dtype=np.int32).reshape(3, 2)
    moved, _, moved_tables = carried_inputs(full, rows, sampling, tables)
    assert np.array_equal(moved, rows) and np.array_equal(moved_tables, tables)
    packed = np.array([[4, -1, 0, 1, 0]] * 3, np.int32)
    written = np.asarray(carry_after_step(carry.zeros(SLOTS), rows, packed, np.array([True, True, False]),
                                                lag_after_step, 1, 2))
    assert written[0, CarryColumn.EMITTED] == 1 and not written[1:].any()


def with_and_without_overlap(target, drafter, **config) -> dict[bool, SpeculativeDecoder]:
    """The same decoder (k = 3, ``config``) with one step in flight and without."""
    return {overlap: SpeculativeDecoder(target, drafter, config=DecoderConfig(**{**vars(SMALL), "k": 3, **config,
                                                                                "overlap": overlap}))
            for overlap in (True, False)}


@pytest.fixture(scope="module")
def decoders(target, partial_draft):
    """The draft-model decoder with one step in flight and without."""
    return with_and_without_overlap(target, partial_draft)


@pytest.fixture(scope="module")
def ngram_decoders(target):
    """The n-gram decoder (host chains, drafted past the step in flight's drafts) with and without."""
    return with_and_without_overlap(target, "ngram", draft_ahead=True)


def test_overlap_is_the_default_on_one_device(decoders):
    assert DecoderConfig().overlap
    assert Engine(decoders[True]).overlaps and not Engine(decoders[False]).overlaps


@settings(max_examples=6, deadline=None)
@given(st.integers(0, 2**31 - 1))
@pytest.mark.slow
def test_overlapped_engine_emits_what_the_synchronous_one_does(decoders, seed):
    """Random arrivals, budgets, stop ids, sampled and greedy requests, and aborts: every request not
    aborted gets the same tokens with one step in flight as without; an aborted one a prefix of them, and
    its blocks come back."""
    check_overlap_against_synchronous(decoders, seed, same_drafts=True)


@settings(max_examples=4, deadline=None)
@given(st.integers(0, 2**31 - 1))
@pytest.mark.slow
def test_host_chains_drafted_ahead_emit_what_the_synchronous_loop_does(ngram_decoders, seed):
    """The same with n-gram drafts, made past the step in flight's drafts assumed accepted (right or
    wrong): greedy requests get the same tokens (sampled ones verify other drafts, so other draws)."""
    check_overlap_against_synchronous(ngram_decoders, seed, same_drafts=False)


def check_overlap_against_synchronous(decoders: dict[bool, SpeculativeDecoder], seed: int, same_drafts: bool) -> None:
    """``same_drafts``: both loops verify the same drafts, so sampled requests get the same tokens too."""
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
        params = next(s for items in arrivals.values() for _, s, r in items if r == request_id)
        if params.temperature > 0 and not same_drafts:
            assert not on or len(on[-1].token_ids) <= params.max_tokens
            continue
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


class Oracle(HostDrafter):
    """Drafts each request's known greedy continuation after the tokens it is given (none where they
    leave it); records how many tokens past what ``start`` and ``extend`` told it it was given (the step
    in flight's drafts, assumed accepted)."""

    def __init__(self, continuations: dict[str, list[int]]):
        self.continuations, self.told, self.most_assumed = continuations, {}, 0

    def start(self, request_id, prompt_token_ids):
        self.told[request_id] = len(prompt_token_ids)

    def extend(self, request_id, new_token_ids):
        self.told[request_id] += len(new_token_ids)

    def propose(self, request_ids, token_ids, max_drafts):
        chains = []
        for request_id, given, cap in zip(request_ids, token_ids, max_drafts.tolist()):
            known = self.continuations[request_id]
            self.most_assumed = max(self.most_assumed, len(given) - self.told[request_id])
            chains.append(known[len(given):len(given) + cap] if given.tolist() == known[:len(given)] else [])
        return chains


@pytest.mark.parametrize("overlap", [True, False])
def test_host_chains_drafted_ahead_of_the_step_in_flight_are_all_accepted_when_right(target, autoregressive, overlap):
    """A drafter that knows the greedy output: drafting ahead of the step in flight it is asked past its drafts
    (and its first proposal guesses the token that step ends with), and every draft it makes is accepted,
    as without; the output is the target's alone."""
    batch = prompts(23, 3, alphabet=16)
    greedy = autoregressive.generate(batch, 24).tokens
    oracle = Oracle({str(i): list(p) + list(g) for i, (p, g) in enumerate(zip(batch, greedy))})
    decoder = SpeculativeDecoder(target, oracle, config=DecoderConfig(**{**vars(SMALL), "k": 3, "overlap": overlap,
                                                                         "draft_ahead": True}))
    engine = Engine(decoder)
    for i, prompt in enumerate(batch):
        engine.add_request(prompt, SamplingParams(max_tokens=24), str(i))
    outputs = run(engine)
    for i in range(len(batch)):
        last = outputs[str(i)][-1]
        assert tokens(outputs, str(i)) == greedy[i]
        assert last.num_draft_tokens > 0 and last.num_accepted_tokens == last.num_draft_tokens
    assert (oracle.most_assumed > 0) == overlap


def test_sampled_host_chains_drafted_ahead_keep_the_target_distribution(target):
    """The second sampled token over many seeds ~ its target marginal, sum over t1 of p(t1) p(t2 | t1)
    (chi-square, tiny vocab), with n-gram drafts made while the first step is in flight (``draft_ahead``:
    its drafts assumed accepted, the token after them guessed)."""
    temperature, batch, rounds = 1.5, 4, 150
    decoder = SpeculativeDecoder(target, NgramDrafter(1, 2),
                                 config=DecoderConfig(**{**vars(SMALL), "k": 2, "draft_ahead": True}))
    prompt = [3, 1, 4, 3, 1]                                   # the n-gram (3, 1) proposes [4, 3]

    def probs(contexts: np.ndarray) -> np.ndarray:
        logits = np.asarray(Transformer.__call__(target, contexts))[:, -1] / temperature
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        return p / p.sum(axis=1, keepdims=True)

    vocab = TINY.vocab_size
    first = probs(np.array([prompt]))[0]
    second = first @ probs(np.array([prompt + [t] for t in range(vocab)]))
    counts = np.zeros(vocab)
    for seed in range(rounds):
        out = decoder.generate([prompt] * batch, 3, temperature=temperature, seed=seed)
        for tokens in out.tokens:
            counts[tokens[1]] += 1
    expected = second * batch * rounds
    keep = expected >= 5
    chi2 = np.sum((counts[keep] - expected[keep]) ** 2 / expected[keep]) + (
        (counts[~keep].sum() - expected[~keep].sum()) ** 2 / max(expected[~keep].sum(), 1e-9))
    dof = int(keep.sum())                                      # bins kept + 1 pooled - 1
    assert chi2 < dof + 5 * np.sqrt(2 * dof), (chi2, dof, counts, expected)   # ~5 sigma


def test_host_drafters_wait_for_the_step_in_flight_unless_drafting_ahead(target):
    """By default a host drafter's steps are fetched before the next is planned (it reads the last
    tokens); ``draft_ahead`` lets them overlap."""
    for draft_ahead in (False, True):
        config = DecoderConfig(**{**vars(SMALL), "k": 3, "draft_ahead": draft_ahead})
        oracle = Oracle({"0": list(range(12)) * 3})
        engine = Engine(SpeculativeDecoder(target, oracle, config=config))
        engine.add_request(list(range(12)), SamplingParams(max_tokens=8), "0")
        run(engine)
        assert (oracle.most_assumed > 0) == draft_ahead
    with pytest.raises(ValueError, match="DecoderConfig.draft_ahead must be a bool"):
        DecoderConfig(draft_ahead=1)
