"""Continuous batching (``generate(max_num_seqs=...)``): at most that many requests decode at once, the
others join as running ones finish. Output does not depend on the schedule (greedy: autoregressive
decoding; sampling: the same seed gives the same tokens), every block goes back to the pool, a stream
that only fits the cache a few requests at a time runs, and an adaptive decoder's controller weighs
the stream's throughput while requests wait."""

from __future__ import annotations

import pytest

from scv_jax import DecoderConfig, NgramDrafter, SpeculativeDecoder
from scv_jax.decoding.runner import StepRunner
from tests.decoding.common import MAX_NEW, SMALL, prompts
from tests.decoding.test_drafting import Spy
from tests.models.fixtures import TINY

ADAPTIVE_PACKED = DecoderConfig(**{**vars(SMALL), "adaptive": True, "k_values": (0, 1, 2, 3), "packed_verify": True})


def _running_sizes(monkeypatch) -> list[int]:
    """Records the number of requests each decode step runs (the ``DecodeWork`` each ``StepRunner.dispatch``
    is given; ``generate`` runs one engine)."""
    sizes, dispatch = [], StepRunner.dispatch

    def recording(runner, work, *args, **kwargs):
        sizes.append(len(work.rows))
        return dispatch(runner, work, *args, **kwargs)

    monkeypatch.setattr(StepRunner, "dispatch", recording)
    return sizes


@pytest.mark.parametrize("drafter, config", [("model", DecoderConfig(**{**vars(SMALL), "k": 3})),
                                             ("ngram", ADAPTIVE_PACKED), ("model", ADAPTIVE_PACKED)],
                         ids=["model-k3", "ngram-adaptive-packed", "model-adaptive-packed"])
@pytest.mark.slow
def test_greedy_output_does_not_depend_on_max_num_seqs(target, partial_draft, autoregressive, drafter, config,
                                                      monkeypatch):
    draft = NgramDrafter(1, 3) if drafter == "ngram" else partial_draft
    decoder = SpeculativeDecoder(target, draft, config=config)
    sizes = _running_sizes(monkeypatch)
    batch_prompts = prompts(5, 7, alphabet=4 if drafter == "ngram" else 16)
    free = autoregressive.generate(batch_prompts, MAX_NEW).tokens
    eos = max(range(TINY.vocab_size), key=lambda v: len({len(t[:t.index(v) + 1] if v in t else t) for t in free}))
    expected = autoregressive.generate(batch_prompts, MAX_NEW, eos_token_id=eos).tokens
    assert len({len(t) for t in expected}) > 1               # requests finish at different steps
    for limit in (1, 3, 7):
        sizes.clear()
        out = decoder.generate(batch_prompts, MAX_NEW, eos_token_id=eos, max_num_seqs=limit)
        assert out.tokens == expected
        assert max(sizes) == min(limit, 4) and out.stats.generated_tokens   # 4: the largest batch bucket == sum(map(len, expected))
        assert decoder.pool.num_free == SMALL.num_blocks


@pytest.mark.parametrize("drafter", [None, "model"])
@pytest.mark.slow
def test_sampled_output_does_not_depend_on_max_num_seqs(target, partial_draft, drafter):
    """Each request's random stream is keyed by its index in the call and its position, so the schedule
    changes nothing."""
    decoder = SpeculativeDecoder(target, partial_draft if drafter else None,
                                 config=DecoderConfig(**{**vars(SMALL), "k": 2}))
    batch_prompts = prompts(6, 6)
    together = decoder.generate(batch_prompts, MAX_NEW, temperature=1.0, seed=3).tokens
    assert decoder.generate(batch_prompts, MAX_NEW, temperature=1.0, seed=3, max_num_seqs=2).tokens == together
    assert decoder.generate(batch_prompts, MAX_NEW, temperature=1.0, seed=4, max_num_seqs=2).tokens != together


@pytest.mark.slow
def test_a_stream_larger_than_the_cache_runs_a_few_at_a_time(target, monkeypatch):
    """A pool that holds 2 of these requests' worst cases: the requests share their prompt's cached blocks
    and take the rest on demand, so more than 2 run at once (none is refused, a step never runs out of
    blocks: the most recent is preempted first), and every block is back in the pool at the end."""
    config = DecoderConfig(**{**vars(SMALL), "num_blocks": 8})       # 2 requests of <= 4 blocks each
    decoder = SpeculativeDecoder(target, "ngram", config=DecoderConfig(**{**vars(config), "k": 2}))
    batch_prompts = [[1, 2, 3] * 6] * 5
    sizes = _running_sizes(monkeypatch)
    for max_num_seqs in (None, 3):
        out = decoder.generate(batch_prompts, MAX_NEW, max_num_seqs=max_num_seqs)
        assert len(set(map(tuple, out.tokens))) == 1 and len(out.tokens[0]) == MAX_NEW
        assert max(sizes) > 2 and decoder.pool.num_free == 8


@pytest.mark.parametrize("value", [0, -1, 2.0, "2", True])
def test_bad_max_num_seqs(autoregressive, value):
    with pytest.raises(ValueError, match="generate: max_num_seqs must be an int >= 1, got"):
        autoregressive.generate([[1, 2]], 4, max_num_seqs=value)


@pytest.mark.slow
def test_the_controller_is_told_each_running_requests_remaining_tokens(target, partial_draft, autoregressive):
    """While requests wait for a slot and once none wait, ``next_k`` gets each running request's remaining
    tokens (its E(k) is capped there), one per request id, never more than the call's budget."""
    decoder = SpeculativeDecoder(target, partial_draft, config=ADAPTIVE_PACKED)
    spy = decoder.controllers["greedy"] = Spy(decoder.controllers["greedy"].config)
    batch_prompts = prompts(8, 6, alphabet=16)
    out = decoder.generate(batch_prompts, MAX_NEW, max_num_seqs=2)
    assert out.tokens == autoregressive.generate(batch_prompts, MAX_NEW).tokens
    assert spy.asked
    for _, ids, _, remaining in spy.asked:
        assert remaining.shape == ids.shape and (remaining >= 1).all() and (remaining <= MAX_NEW).all()


@pytest.mark.slow
def test_warmup_of_the_running_batch_and_one_admission_compiles_everything(target, partial_draft):
    from scv_jax.graph.compile_counter import CompileCounter

    decoder = SpeculativeDecoder(target, partial_draft,
                                 config=DecoderConfig(**{**vars(SMALL), "k": 3, "batch_buckets": (1, 4)}))
    decoder.warmup([1, 4], 40)
    with CompileCounter() as compiles:
        out = decoder.generate(prompts(9, 7), MAX_NEW, max_num_seqs=4)
    assert compiles.count == compiles.loads == 0 and out.stats.compile_count == 0
