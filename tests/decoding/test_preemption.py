"""KV blocks on demand, preemption by recompute: a pool far smaller than the requests' worst cases runs
more of them at once than reserving the worst case would, preempts the most recently admitted when the
blocks run out, and resumes it later with the same output: greedy equal to autoregressive, seeded
sampling (penalties included) equal to a run with a large pool; every block back in the pool after."""

from __future__ import annotations

import numpy as np
import pytest

from scv_jax import DecoderConfig, Engine, SamplingParams, SpeculativeDecoder, SuffixDrafter, TreeConfig
from scv_jax.decoding.requests import RequestBatch
from tests.decoding.common import MAX_NEW, SMALL, prompts
from tests.decoding.test_eagle3_decoding import random_head
from tests.decoding.test_engine import MAX_STEPS, tokens

# 12 blocks of 8 positions; a request of up to 19 prompt tokens + MAX_NEW = 14 needs up to 4 blocks at
# worst: reserving worst cases would run 3 at once, the batch holds 8
TIGHT = DecoderConfig(**{**vars(SMALL), "num_blocks": 12, "batch_buckets": (8,), "k": 2})
LARGE = DecoderConfig(**{**vars(TIGHT), "num_blocks": 64})
NUM_REQUESTS = 32
WORST_CASE_CONCURRENCY = TIGHT.num_blocks // 4


def drive(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> tuple[dict[str, list], int]:
    """Adds ``requests`` (ids "0", "1", ...), steps the engine until done; returns each request's
    outputs and the most requests that ran at once. Checks the pool is full again."""
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(prompt, params, str(i))
    outputs, most = {}, 0
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        most = max(most, engine.num_running)
    else:
        raise AssertionError(f"the engine did not finish in {MAX_STEPS} steps")
    assert engine.num_free_blocks == engine.num_blocks
    return outputs, most


def stream(seed: int, eos: int | None = None, **params) -> list[tuple[list[int], SamplingParams]]:
    """``NUM_REQUESTS`` requests of up to MAX_NEW tokens (``eos``: each stops there, if it comes)."""
    stops = () if eos is None else (eos,)
    return [(prompt, SamplingParams(max_tokens=MAX_NEW, stop_token_ids=stops, seed=i, **params))
            for i, prompt in enumerate(prompts(seed, NUM_REQUESTS, alphabet=16))]


@pytest.fixture(scope="module")
def tight(target, partial_draft):
    return SpeculativeDecoder(target, partial_draft, config=TIGHT)


@pytest.fixture(scope="module")
def large(target, partial_draft):
    return SpeculativeDecoder(target, partial_draft, config=LARGE)


@pytest.mark.slow
def test_greedy_outputs_equal_autoregressive_through_preemptions(tight, autoregressive):
    requests = stream(1)
    engine = Engine(tight)
    outputs, most = drive(engine, requests)
    expected = autoregressive.generate([p for p, _ in requests], MAX_NEW).tokens
    assert [tokens(outputs, str(i)) for i in range(NUM_REQUESTS)] == expected
    assert most > WORST_CASE_CONCURRENCY and engine.stats.num_preemptions > 0


@pytest.mark.slow
def test_requests_that_stop_early_leave_room_for_more(tight):
    """Requests that stop at an eos long before max_tokens never held blocks for the rest."""
    engine = Engine(tight)
    outputs, most = drive(engine, stream(2, eos=3, temperature=1.0))
    lengths = [len(outs[-1].token_ids) for outs in outputs.values()]
    assert len(lengths) == NUM_REQUESTS and min(lengths) < MAX_NEW      # some stopped early
    assert most > WORST_CASE_CONCURRENCY


@pytest.mark.parametrize("params", [dict(temperature=1.0, top_k=6),
                                    dict(temperature=0.8, repetition_penalty=1.3, frequency_penalty=0.5,
                                         presence_penalty=0.4, logit_bias={5: 2.0}, min_tokens=4)],
                         ids=["sampled", "sampled-penalties"])
@pytest.mark.slow
def test_seeded_sampled_outputs_equal_a_large_pool(tight, large, params):
    """A resumed request draws from its own stream at each position, and its penalties see its whole
    output so far (the control state is rebuilt from its tokens)."""
    requests = stream(3, **params)
    engine = Engine(tight)
    outputs, _ = drive(engine, requests)
    expected, _ = drive(Engine(large), requests)
    assert engine.stats.num_preemptions > 0
    assert [tokens(outputs, str(i)) for i in range(NUM_REQUESTS)] == [tokens(expected, str(i))
                                                                       for i in range(NUM_REQUESTS)]


@pytest.mark.parametrize("drafter", ["ngram", "suffix"])
def test_host_drafters_resume_with_the_output_so_far(target, autoregressive, drafter):
    """A host drafter hears ``finish`` at a preemption, then ``start`` and ``extend`` with the request's
    output so far when it resumes."""
    decoder = SpeculativeDecoder(target, drafter if drafter == "ngram" else SuffixDrafter(), config=TIGHT)
    requests = stream(4)
    engine = Engine(decoder)
    outputs, _ = drive(engine, requests)
    expected = autoregressive.generate([p for p, _ in requests], MAX_NEW).tokens
    assert [tokens(outputs, str(i)) for i in range(NUM_REQUESTS)] == expected
    assert engine.stats.num_preemptions > 0


def test_a_preempted_request_keeps_its_acceptance_counts_and_one_output_stream(tight):
    engine = Engine(tight)
    outputs, _ = drive(engine, stream(5))
    for outs in outputs.values():
        assert sum(o.finished for o in outs) == 1 and outs[-1].finished
        assert outs[-1].num_accepted_tokens <= outs[-1].num_draft_tokens
        assert len(outs[-1].token_ids) == MAX_NEW


def test_aborting_a_preempted_request_frees_nothing_twice(tight):
    engine = Engine(tight)
    for i, (prompt, params) in enumerate(stream(6)):
        engine.add_request(prompt, params, str(i))
    for _ in range(MAX_STEPS):
        engine.step()
        if engine.stats.num_preemptions:
            break
    else:
        raise AssertionError("no preemption")
    for i in range(NUM_REQUESTS):
        engine.abort(str(i))
    ended = engine.step()
    assert len(ended) == NUM_REQUESTS and {o.finish_reason for o in ended} == {"abort"}
    assert engine.num_free_blocks == engine.num_blocks and not engine.has_unfinished()


def test_blocks_short_counts_what_a_row_lacks():
    from scv_jax.decoding.block_pool import BlockPool

    pool = BlockPool(10)
    batch = RequestBatch(2, 64, 8, 8, [pool])
    row = batch.start(list(range(9)), 5, 20, 0, np.zeros(batch.sampling.shape[1], np.float32),
                      np.zeros(2, np.int32), ())
    assert batch.prompt_len[row] == 5 and batch.length[row] == 9 and batch.generated(row) == [5, 6, 7, 8]
    rows = np.array([row])
    assert batch.blocks_short(rows, np.array([17])).tolist() == [3]
    batch.ensure(rows, np.array([9]))
    assert batch.num_blocks[row] == 2 and pool.num_free == 8
    assert batch.blocks_short(rows, np.array([16])).tolist() == [0]
    assert batch.blocks_short(rows, np.array([17])).tolist() == [1]
    batch.finish(rows)
    assert pool.num_free == 10 and not batch.active.size


TREE = TreeConfig(max_depth=3, branching=2, max_nodes=6)


@pytest.mark.parametrize("drafter, tree", [("model", TREE), ("head", None), ("head", TREE)],
                         ids=["model-tree", "head-chain", "head-tree"])
@pytest.mark.slow
def test_trees_and_eagle_heads_resume_with_the_same_output(target, partial_draft, autoregressive, tmp_path_factory,
                                                           drafter, tree):
    """A resumed request's prefill rebuilds the draft cache (and an EAGLE head's features) from its
    tokens so far."""
    draft = partial_draft if drafter == "model" else random_head(target, tmp_path_factory.mktemp("head"), seed=5)
    config = DecoderConfig(**{**vars(TIGHT), "tree": tree, "k": 0 if tree else 2})
    engine = Engine(target, draft, config=config)
    requests = stream(7)
    outputs, _ = drive(engine, requests)
    expected = autoregressive.generate([p for p, _ in requests], MAX_NEW).tokens
    assert [tokens(outputs, str(i)) for i in range(NUM_REQUESTS)] == expected
    assert engine.stats.num_preemptions > 0
