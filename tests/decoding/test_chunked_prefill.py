"""Chunked prefill under a token budget (``DecoderConfig.max_num_batched_tokens``): a long prompt is
prefilled over several steps while the running requests keep emitting a token or more every step;
chunk boundaries (unaligned with the blocks) leave every output exact with every drafter, through
preemptions and prefix-cache hits; an abort during a chunked prefill frees everything; nothing compiles
after warm-up."""

from __future__ import annotations

import pytest

from scv_jax import DecoderConfig, Engine, SamplingParams, SpeculativeDecoder, TreeConfig
from scv_jax.decoding.config import DEFAULT_MAX_NUM_BATCHED_TOKENS
from tests.decoding.common import MAX_NEW, SMALL, prompts
from tests.decoding.test_eagle3_decoding import random_head
from tests.decoding.test_engine import MAX_STEPS, tokens
from tests.decoding.test_preemption import drive

# a step computes 20 tokens: two requests decoding at k = 2 (6 tokens) leave one 16-token chunk
CHUNKED = DecoderConfig(**{**vars(SMALL), "k": 2, "max_num_batched_tokens": 20})
LONG = 49                                 # prompt tokens: 48 to prefill, 3 chunks of 16
# chunks of 5 tokens (blocks of 8), one a step while a request decodes; a pool of 12 blocks
ODD = DecoderConfig(**{**vars(SMALL), "k": 2, "prefill_chunk": 5, "max_num_batched_tokens": 1, "num_blocks": 12})


def mixed_prompts(seed: int) -> list[list[int]]:
    """Eight prompts: short ones, and long ones sharing their first 24 tokens (prefix-cache hits)."""
    shared = prompts(seed, 1, alphabet=16)[0] * 3
    long = [(shared * 2)[:24] + p for p in prompts(seed + 1, 4, alphabet=16)]
    short = prompts(seed + 2, 4, alphabet=16)
    return [p for pair in zip(long, short) for p in pair]


@pytest.mark.slow
def test_running_requests_emit_every_step_while_a_long_prompt_prefills(target, partial_draft, autoregressive):
    engine = Engine(SpeculativeDecoder(target, partial_draft, config=CHUNKED))
    short = prompts(3, 2, alphabet=16)
    long_prompt = (prompts(4, 1, alphabet=16)[0] * LONG)[:LONG]
    requests = [(short[0], 40, "0"), (short[1], 40, "1"), (long_prompt, MAX_NEW, "long")]
    outputs: dict[str, list] = {}

    def step() -> set[str]:
        """One engine step; the ids of the requests that emitted tokens in it."""
        done = engine.step()
        for out in done:
            outputs.setdefault(out.request_id, []).append(out)
        return {out.request_id for out in done if out.new_token_ids}

    for prompt, max_tokens, request_id in requests[:2]:
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens), request_id)
    for _ in range(3):                        # both prefilled (the second after the first if they share no step)
        step()
    assert engine.num_prefilling == engine.num_waiting == 0
    engine.add_request(long_prompt, SamplingParams(max_tokens=MAX_NEW), "long")
    emitted, prefilling = [], []
    late = int(engine.overlaps)               # with one step in flight a step's tokens come with the next call
    for _ in range(3 + late):                 # 48 tokens to prefill: 16 a step (room for one chunk)
        emitted.append(step())
        prefilling.append(engine.num_prefilling)
    assert all(e >= {"0", "1"} for e in emitted)
    assert ["long" in e for e in emitted] == [False] * (2 + late) + [True] and prefilling == [1, 1] + [0] * (1 + late)
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished():
            break
        step()
    expected = autoregressive.generate(short, 40).tokens + autoregressive.generate([long_prompt], MAX_NEW).tokens
    assert [tokens(outputs, r) for _, _, r in requests] == expected
    assert engine.num_free_blocks == engine.num_blocks


@pytest.fixture(scope="module")
def odd(target, partial_draft):
    return SpeculativeDecoder(target, partial_draft, config=ODD)


@pytest.fixture(scope="module")
def head(target, tmp_path_factory):
    return random_head(target, tmp_path_factory.mktemp("head"), seed=3)


TREE = TreeConfig(max_depth=3, branching=2, max_nodes=6)


@pytest.mark.parametrize("drafter, fields", [("draft", {}), ("draft", {"tree": TREE}), ("ngram", {}), ("head", {})])
@pytest.mark.slow
def test_chunk_boundaries_keep_every_output_exact(target, partial_draft, head, odd, autoregressive, drafter, fields):
    """Chunks of 5 over blocks of 8, a draft model's cache, n-gram indexes, EAGLE-head features, prefix
    hits and preemptions in a pool of 12 blocks: greedy equals autoregressive."""
    draft = {"draft": partial_draft, "ngram": "ngram", "head": head}[drafter]
    decoder = odd if drafter == "draft" and not fields else SpeculativeDecoder(
        target, draft, config=DecoderConfig(**{**vars(ODD), **fields}))
    requests = [(p, SamplingParams(max_tokens=MAX_NEW)) for p in mixed_prompts(5)]
    engine = Engine(decoder)
    outputs, most = drive(engine, requests)
    expected = autoregressive.generate([p for p, _ in requests], MAX_NEW).tokens
    assert [tokens(outputs, str(i)) for i in range(len(requests))] == expected
    assert engine.stats.num_preemptions > 0 and engine.stats.prefix_cache_hits > 0


@pytest.mark.slow
def test_seeded_sampling_is_unchanged_by_the_budget(odd):
    """Chunked (a 5-token chunk a step) and whole-prompt prefill draw the same tokens, with logit
    controls (written when a request is admitted) and through preemptions (a pool of 12 blocks)."""
    params = dict(temperature=0.9, repetition_penalty=1.3, frequency_penalty=0.5, logit_bias={5: 2.0}, min_tokens=4)
    requests = [(p, SamplingParams(max_tokens=MAX_NEW, seed=i, **params)) for i, p in enumerate(mixed_prompts(6))]
    results = []
    for budget in (None, 1000):               # ODD's 1 (a 5-token chunk a step), and whole prompts
        outputs, _ = drive(Engine(odd, max_num_batched_tokens=budget), requests)
        results.append([tokens(outputs, str(i)) for i in range(len(requests))])
    assert results[0] == results[1]


def test_aborting_during_a_chunked_prefill_frees_everything(odd):
    engine = Engine(odd)
    engine.add_request(mixed_prompts(7)[0], SamplingParams(max_tokens=MAX_NEW), "long")
    engine.step()
    assert engine.num_prefilling == engine.num_running == 1        # 5 of its 29 tokens prefilled
    engine.abort("long")
    assert [(o.request_id, o.finish_reason) for o in engine.step()] == [("long", "abort")]
    assert engine.num_free_blocks == engine.num_blocks and not engine.has_unfinished()


@pytest.mark.slow
def test_nothing_compiles_after_warmup_with_chunks(target, partial_draft):
    """Chunks run the prefill executable at the batch buckets warm-up compiles (a fresh decoder)."""
    config = DecoderConfig(**{**vars(ODD), "batch_buckets": (2, 4)})
    engine = Engine(SpeculativeDecoder(target, partial_draft, config=config))
    engine.warmup(4, ODD.max_seq_len, temperatures=0.0)
    drive(engine, [(p, SamplingParams(max_tokens=MAX_NEW)) for p in mixed_prompts(8)])
    assert engine.stats.compiled == [] and engine.stats.num_preemptions > 0


def test_the_budget_defaults_to_the_platform_s_and_is_checked(autoregressive):
    assert Engine(autoregressive).max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS["cpu"]
    assert Engine(autoregressive, max_num_batched_tokens=7).max_num_batched_tokens == 7
    with pytest.raises(ValueError, match="DecoderConfig.max_num_batched_tokens must be an int >= 1 or None"):
        DecoderConfig(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="Engine: max_num_batched_tokens must be an int >= 1"):
        Engine(autoregressive, max_num_batched_tokens=0)
