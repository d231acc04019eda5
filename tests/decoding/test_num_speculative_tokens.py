"""``SamplingParams.num_speculative_tokens``: a request's own cap on its drafts per step. A request at 0
never drafts while its batch-mates do, one at n verifies at most n drafts a step (a tree: accepts at
most n nodes deep), a batch where every request is at 0 runs k = 0 steps, and the adaptive controller
sees each capped request as one that emits at most n + 1 tokens a step; greedy outputs stay the
target's alone."""

from __future__ import annotations

import pytest

from scv_jax import DecoderConfig, Engine, SamplingParams, SpeculativeDecoder
from tests.decoding.common import MAX_NEW, SMALL, prompts
from tests.decoding.test_drafting import ADAPTIVE, Spy
from tests.decoding.test_engine import run, tokens
from tests.decoding.test_tree_decoding import TREE_CONFIG

K3 = DecoderConfig(**{**vars(SMALL), "k": 3})
CAPS = {"off": 0, "one": 1, "two": 2, "engine": None}      # request id -> num_speculative_tokens


def _run_capped(decoder, autoregressive, caps: dict[str, int | None], seed: int) -> tuple[Engine, dict]:
    """Runs one greedy request per entry of ``caps`` in one batch; checks each against autoregressive
    decoding; returns the engine and the outputs."""
    engine = Engine(decoder)
    batch = prompts(seed, len(caps))
    arrivals = {0: [(p, SamplingParams(max_tokens=MAX_NEW, num_speculative_tokens=n), rid)
                    for p, (rid, n) in zip(batch, caps.items())]}
    outputs = run(engine, arrivals)
    for prompt, rid in zip(batch, caps):
        assert tokens(outputs, rid) == autoregressive.generate([prompt], MAX_NEW).tokens[0], rid
    assert engine.num_free_blocks == engine.num_blocks
    return engine, outputs


def _check_caps(outputs: dict, caps: dict[str, int | None]) -> None:
    """Each request drafted within its cap (a chain's verified drafts, a tree's depth cap, at most n a
    step) and accepted none past it; one at 0 drafted nothing, the others something."""
    for rid, n in caps.items():
        last, steps = outputs[rid][-1], len(outputs[rid])        # every step emits a token of each request
        if n is None:
            assert last.num_draft_tokens > 0, rid
            continue
        assert last.num_draft_tokens <= n * steps, (rid, last.num_draft_tokens, steps)
        assert not any(last.num_accepted_per_pos[n:]), (rid, last.num_accepted_per_pos)
        assert (last.num_draft_tokens > 0) == (n > 0), rid


@pytest.fixture(scope="module")
def chain(target, partial_draft):
    return SpeculativeDecoder(target, partial_draft, config=K3)


def test_a_request_at_0_never_drafts_and_one_at_n_drafts_at_most_n_a_step(chain, autoregressive):
    _, outputs = _run_capped(chain, autoregressive, CAPS, seed=61)
    _check_caps(outputs, CAPS)
    assert outputs["engine"][-1].num_accepted_per_pos[2] > 0       # uncapped: drafts past position 2 accepted


def test_a_batch_where_every_request_is_at_0_runs_k_0_steps(chain, autoregressive):
    engine, outputs = _run_capped(chain, autoregressive, {"a": 0, "b": 0, "c": 0}, seed=62)
    assert set(engine.stats.k_histogram) == {0}
    assert all(o[-1].num_draft_tokens == 0 for o in outputs.values())


def test_a_tree_is_capped_in_depth(target, partial_draft, autoregressive):
    decoder = SpeculativeDecoder(target, partial_draft, config=TREE_CONFIG)
    _, outputs = _run_capped(decoder, autoregressive, CAPS, seed=63)
    _check_caps(outputs, CAPS)
    assert any(outputs["engine"][-1].num_accepted_per_pos[2:])      # uncapped: paths deeper than 2 accepted


def test_the_adaptive_controller_counts_a_capped_request_as_n_drafts_at_most(target, partial_draft,
                                                                             autoregressive):
    """``next_k`` gets each capped request's remaining tokens as at most n + 1 (its E(k) stops at n drafts),
    and ``update`` its offered drafts as at most n."""
    decoder = SpeculativeDecoder(target, partial_draft, config=ADAPTIVE)
    spy = decoder.controllers["greedy"] = Spy(decoder.controllers["greedy"].config)
    _, outputs = _run_capped(decoder, autoregressive, CAPS, seed=64)
    _check_caps(outputs, CAPS)
    # controller ids are handed out in arrival order: sorted, they are the requests of CAPS in order
    first = sorted(spy.asked[0][1].tolist())
    cap_of = dict(zip(first, CAPS.values()))
    assert len(first) == len(CAPS) and spy.told
    for _, ids, _, remaining in spy.asked:
        for i, left in zip(ids.tolist(), remaining.tolist()):
            assert cap_of[i] is None or left <= cap_of[i] + 1, (cap_of[i], left)
    assert any(left > 3 for _, ids, _, remaining in spy.asked for left in remaining.tolist())   # uncapped
    for told in spy.told:
        for i, drafted in zip(told["ids"].tolist(), told["drafts"].tolist()):
            assert cap_of[i] is None or drafted <= cap_of[i], (cap_of[i], drafted)


@pytest.mark.parametrize("config", [K3, TREE_CONFIG], ids=["chain", "tree"])
def test_an_eagle3_head_honours_the_caps(target, autoregressive, tmp_path, config):
    """A random EAGLE-3 head (its drafts mostly rejected, but verified): the caps hold for its chains
    and its trees."""
    from tests.decoding.test_eagle3_decoding import random_head

    decoder = SpeculativeDecoder(target, random_head(target, tmp_path, seed=3), config=config)
    _, outputs = _run_capped(decoder, autoregressive, CAPS, seed=65)
    _check_caps(outputs, CAPS)
