"""Predicted outputs (``SamplingParams.prediction``) and requests that share a prompt (``n > 1``).

The alignment rule of ``PredictionIndex`` on hand-made outputs; on the engine: greedy output with a
prediction equals the output without one (chains and trees, n-gram and suffix drafters), an exact
prediction is accepted (and only rejected where it is wrong), sampled tokens keep the target's
distribution (chi-square), engines that cannot draft from a prediction refuse it; requests of one prompt
added together share its full blocks (the later ones wait for the first's prefill and find them cached)
and decode as they would alone."""

from __future__ import annotations

import numpy as np
import pytest

from scv_jax import DecoderConfig, Engine, NgramDrafter, SamplingParams, SpeculativeDecoder, TreeConfig
from scv_jax.decoding.proposers.prediction import PredictionIndex, Predictions
from scv_jax.decoding.proposers.suffix import SuffixDrafter
from tests.decoding.common import SMALL
from tests.decoding.test_engine import first_two_tokens_follow_the_target, run, target_logits, tokens  # noqa: F401

K3 = DecoderConfig(**{**vars(SMALL), "k": 3})
PROMPT = [3, 1, 4, 1, 5]
MAX_TOKENS = 24


def _propose(prediction: list[int], outputs: list[list[int]], k: int = 4, prompt_len: int = 2) -> list[list[int]]:
    """The index's proposal after each output in turn (a request growing step by step)."""
    index = PredictionIndex(prediction, prompt_len)
    return [index.propose(np.array([9, 9, *out]), k) for out in outputs]


def test_the_alignment_rule():
    p = [10, 11, 12, 13, 14, 15, 16, 17]
    # no output yet: the prediction's start; then the tokens after where the output lines up
    assert _propose(p, [[], [10], [10, 11, 12]]) == [[10, 11, 12, 13], [11, 12, 13, 14], [13, 14, 15, 16]]
    # diverged (20, 21 replace 12, 13) then re-aligned on two tokens: the rest after them
    assert _propose(p, [[10, 11, 20], [10, 11, 20, 21], [10, 11, 20, 21, 14, 15]], k=3) == [[], [], [16, 17]]
    # one common token re-aligns only right at the alignment point, never further on
    assert _propose(p, [[10, 11, 20, 15]]) == [[]]
    assert _propose(p, [[10], [10, 11, 12, 13, 14, 15, 16, 17]]) == [[11, 12, 13, 14], []]   # used up
    assert _propose(p, [[10, 11, 12]], k=0) == [[]]
    # a match before the alignment point is not taken again (the prediction is consumed in order)
    assert _propose([1, 2, 3, 1, 2, 4], [[1, 2, 3], [1, 2, 3, 1, 2]], k=2) == [[1, 2], [4]]
    predictions = Predictions()
    assert not predictions
    predictions.start("a", 2, p)
    assert predictions.propose(["b", "a"], [np.array([9, 9]), np.array([9, 9, 10])], np.array([3, 2])) == \
        [[], [11, 12]]
    predictions.finish("a")
    assert not predictions


def _greedy(engine: Engine, prompt: list[int], prediction=(), request_id: str = "r"):
    outputs = run(engine, {0: [(prompt, SamplingParams(max_tokens=MAX_TOKENS, prediction=prediction), request_id)]})
    return tokens(outputs, request_id), outputs[request_id][-1]


@pytest.fixture(scope="module")
def decoders(target):
    tree = DecoderConfig(**{**vars(SMALL), "k": 3, "tree": TreeConfig(max_depth=3, max_nodes=4, branching=2)})
    return {"ngram": SpeculativeDecoder(target, NgramDrafter(1, 3), config=K3),
            "suffix": SpeculativeDecoder(target, SuffixDrafter(), config=K3),
            "ngram tree": SpeculativeDecoder(target, NgramDrafter(1, 3), config=tree)}


@pytest.mark.parametrize("name", ["ngram", "suffix", "ngram tree"])
def test_greedy_output_with_a_prediction_is_the_output_without(decoders, autoregressive, name):
    engine = Engine(decoders[name])
    expected = autoregressive.generate([PROMPT], MAX_TOKENS).tokens[0]
    plain, out = _greedy(engine, PROMPT)
    assert plain == expected and out.num_accepted_prediction_tokens == out.num_rejected_prediction_tokens == 0
    exact, out = _greedy(engine, PROMPT, expected)
    assert exact == expected
    assert out.num_accepted_prediction_tokens >= MAX_TOKENS // 2 and out.num_rejected_prediction_tokens == 0
    assert out.num_accepted_tokens >= out.num_accepted_prediction_tokens
    # wrong in the middle: rejected there, accepted again once the output re-aligns past the change
    edited = expected[:8] + [(t + 1) % 16 for t in expected[8:11]] + expected[11:]
    again, out = _greedy(engine, PROMPT, edited)
    assert again == expected
    assert out.num_rejected_prediction_tokens > 0 and out.num_accepted_prediction_tokens > 8
    wrong, out = _greedy(engine, PROMPT, [(t + 1) % 16 for t in expected])
    assert wrong == expected and out.num_rejected_prediction_tokens > 0
    assert engine.num_running == engine.num_waiting == 0 and engine.num_free_blocks == engine.num_blocks


def test_sampled_tokens_with_a_prediction_follow_the_target(target, target_logits, autoregressive):  # noqa: F811
    """Tokens 1 and 2 of many seeded requests whose prediction drafts both (one in four greedy)."""
    engine = Engine(target, NgramDrafter(1, 2), config=DecoderConfig(**{**vars(SMALL), "k": 2}))
    params = SamplingParams(max_tokens=3, temperature=1.0)
    greedy = autoregressive.generate([PROMPT], 3).tokens[0]
    count = 400
    arrivals = {0: [(PROMPT, SamplingParams(max_tokens=3, prediction=greedy) if i % 4 == 0 else
                     SamplingParams(**{**vars(params), "seed": i, "prediction": greedy}), str(i)) for i in range(count)]}
    outputs = run(engine, arrivals, max_steps=count)
    assert all(tokens(outputs, str(i)) == greedy for i in range(0, count, 4))
    first_two_tokens_follow_the_target([tokens(outputs, str(i)) for i in range(count) if i % 4], PROMPT, params,
                                       target_logits)
    last = [outputs[str(i)][-1] for i in range(count)]
    assert sum(o.num_accepted_prediction_tokens for o in last) > 0 and sum(o.num_rejected_prediction_tokens
                                                                            for o in last) > 0


def test_engines_that_cannot_draft_from_a_prediction_refuse_it(target, partial_draft, decoders):
    for engine in (Engine(target, None, config=SMALL), Engine(target, partial_draft, config=K3)):
        with pytest.raises(ValueError, match="SamplingParams.prediction needs an engine with a host drafter"):
            engine.add_request(PROMPT, SamplingParams(prediction=[1, 2]))
    with pytest.raises(ValueError, match="SamplingParams.prediction .* token ids in \\[0, vocab_size=16\\)"):
        Engine(decoders["ngram"]).add_request(PROMPT, SamplingParams(prediction=[1, 16]))
    with pytest.raises(TypeError, match="SamplingParams.prediction must be a sequence of ints >= 0"):
        SamplingParams(prediction="abc")


def test_requests_of_one_prompt_share_its_blocks(decoders, autoregressive):
    """Three requests of one 21-token prompt added together (an ``n = 3`` request): the second and third
    wait for the first's prefill and find its two full blocks of 8 cached; greedy ones decode as alone,
    seeded ones as they do when run alone."""
    engine = Engine(decoders["ngram"])
    prompt = list(np.arange(21) % 7)
    alone = {}
    for i, params in enumerate([SamplingParams(max_tokens=6), SamplingParams(max_tokens=6, temperature=1.0, seed=4)]):
        engine.reset_prefix_cache()
        alone[i] = _alone = tokens(run(engine, {0: [(prompt, params, "x")]}), "x")
        assert engine.reset_prefix_cache()
        hits = engine.stats.prefix_cache_hits
        outputs = run(engine, {0: [(prompt, params, f"{i}-{j}") for j in range(3)]})
        firsts = [outputs[f"{i}-{j}"][0] for j in range(3)]
        assert [o.num_cached_tokens for o in firsts] == [0, 16, 16]
        assert engine.stats.prefix_cache_hits - hits == 32
        assert [tokens(outputs, f"{i}-{j}") for j in range(3)] == [_alone] * 3
    assert alone[0] == autoregressive.generate([prompt], 6).tokens[0]
