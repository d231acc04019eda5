"""``SuffixDrafter`` in the engine: greedy output equals the target's alone (chains and trees, requests
arriving mid-flight, aborts, repeated prompts drafted from earlier outputs), sampled tokens keep the
filtered target distribution, and every request's own index is gone once it ends."""

from __future__ import annotations

import pytest

from scv_jax import DecoderConfig, Engine, SamplingParams, SuffixDrafter, TreeConfig
from tests.decoding.common import MAX_NEW, SMALL, prompts
from tests.decoding.test_engine import FILTERS, first_two_tokens_follow_the_target, run, target_logits, tokens  # noqa: F401

CHAIN = DecoderConfig(**{**vars(SMALL), "k": 4})
TREE = DecoderConfig(**{**vars(SMALL), "tree": TreeConfig(max_depth=3, branching=2, max_nodes=6)})
VERIFIERS = {"chain": CHAIN, "tree": TREE}


@pytest.mark.parametrize("verifier", list(VERIFIERS))
def test_greedy_output_is_the_targets_as_requests_come_go_and_repeat(target, autoregressive, verifier):
    drafter = SuffixDrafter()
    engine = Engine(target, drafter, config=VERIFIERS[verifier], eos_token_id=None)
    batch = prompts(21, 3, alphabet=4)
    free = autoregressive.generate(batch, MAX_NEW).tokens
    params = SamplingParams(max_tokens=MAX_NEW)
    arrivals = {0: [(batch[0], params, "a"), (batch[1], params, "b")], 2: [(batch[2], params, "c")],
                3: [(batch[1], params, "aborted")]}
    engine.add_request(batch[0], params, "never-runs")         # aborted while waiting
    engine.abort("never-runs")
    outputs = {}
    for step in range(60):
        for prompt, p, request_id in arrivals.pop(step, []):
            engine.add_request(prompt, p, request_id)
        if step == 5:
            engine.abort("aborted")
        if not engine.has_unfinished() and not arrivals:
            break
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert [tokens(outputs, r) for r in "abc"] == free
    assert outputs["aborted"][-1].finish_reason == "abort"
    first = {r: outputs[r][-1] for r in "abc"}
    again = run(engine, {0: [(p, params, f"{r}-again") for r, p in zip("abc", batch)]})   # drafted from "a", "b", "c"
    assert [tokens(again, f"{r}-again") for r in "abc"] == free
    accepted = [(first[r].num_accepted_tokens, again[f"{r}-again"][-1].num_accepted_tokens) for r in "abc"]
    assert sum(a for _, a in accepted) > sum(f for f, _ in accepted), accepted
    assert drafter.num_running == 0 and drafter.cached_requests == 7       # 3 + the abort + 3 again


@pytest.mark.parametrize("verifier", list(VERIFIERS))
def test_sampled_tokens_follow_the_filtered_target(target, target_logits, verifier):  # noqa: F811
    """As ``test_engine.test_sampled_tokens_follow_the_filtered_target``: 400 requests of one prompt, each
    drafted from its own text and from the outputs of those that finished before it."""
    drafter = SuffixDrafter(min_token_prob=0.0)
    engine = Engine(target, drafter, config=VERIFIERS[verifier])
    prompt, count = [3, 1, 4, 3, 1], 400
    params = SamplingParams(max_tokens=3, **FILTERS["all"])
    outputs = run(engine, {0: [(prompt, SamplingParams(**{**vars(params), "seed": i}), str(i)) for i in range(count)]},
                  max_steps=2 * count)
    sampled = [tokens(outputs, str(i)) for i in range(count)]

    first_two_tokens_follow_the_target(sampled, prompt, params, target_logits)
    assert sum(outputs[str(i)][-1].num_accepted_tokens for i in range(count)) > 0
    assert drafter.num_running == 0
