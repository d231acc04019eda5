"""Prefix caching: blocks full of verified tokens (prompt and output) stay cached after their request
ends; a request starts from the cached blocks of its longest cached prefix (``num_cached_tokens``
exact, its last token always computed), a shared block is never written, eviction under pressure
takes the least recently used, and outputs are identical with the cache on and off (greedy and
seeded sampling, draft models, n-gram, trees, fp8), with speculation hitting as often as without
(an EAGLE head's: test_prefix_cache_head.py)."""

from __future__ import annotations

import numpy as np
import pytest

from scv_jax import DecoderConfig, Engine, NgramDrafter, SamplingParams, SpeculativeDecoder, TreeConfig
from scv_jax.decoding.block_pool import BlockPool, chain_hashes, prefix_root
from tests.decoding.common import MAX_NEW, SMALL, prompts
from tests.decoding.test_engine import MAX_STEPS, tokens

CACHED = DecoderConfig(**{**vars(SMALL), "k": 2})                  # blocks of 8 positions
UNCACHED = DecoderConfig(**{**vars(CACHED), "enable_prefix_caching": False})
GREEDY = SamplingParams(max_tokens=MAX_NEW)


def run_one(engine: Engine, prompt: list[int], params: SamplingParams = GREEDY, request_id: str = "r"):
    """Runs one request alone to its end; its last output."""
    engine.add_request(prompt, params, request_id)
    outputs = {}
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished():
            return tokens(outputs, request_id), outputs[request_id][-1]
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError("the engine did not finish")


def chat(engine: Engine, seed: int, turns: int, params: SamplingParams = GREEDY) -> list[tuple[list[int], list, object]]:
    """A multi-turn chat, one turn after the other: each turn's prompt is the last prompt + its answer + a
    new 4-token message. Each turn's (prompt, output tokens, last output)."""
    rng = np.random.default_rng(seed)
    prompt, out = rng.integers(0, 16, 9).tolist(), []
    for i in range(turns):
        answer, last = run_one(engine, prompt, params, str(i))
        out.append((prompt, answer, last))
        prompt = prompt + answer + rng.integers(0, 16, 4).tolist()
    return out


@pytest.fixture(scope="module")
def with_draft(target, partial_draft):
    return SpeculativeDecoder(target, partial_draft, config=CACHED)


def test_a_shared_prefix_is_served_from_the_cache(with_draft, autoregressive):
    engine = Engine(with_draft)
    prompt = prompts(11, 1, alphabet=16)[0] * 2 + [3, 1]          # > 2 full blocks
    first, out = run_one(engine, prompt, request_id="a")
    assert out.num_cached_tokens == 0
    assert engine.stats.prefix_cache_queries == len(prompt) and engine.stats.prefix_cache_hits == 0
    # the same prompt: every full block of its tokens but the last (always computed)
    again, out = run_one(engine, prompt, request_id="b")
    assert again == first and out.num_cached_tokens == (len(prompt) - 1) // 8 * 8
    # a prompt that continues the first request's output: its output blocks are cached too
    longer = prompt + first[:10]
    expected = autoregressive.generate([longer], MAX_NEW).tokens[0]
    got, out = run_one(engine, longer, request_id="c")
    assert got == expected and out.num_cached_tokens == (len(prompt) + 9) // 8 * 8 > len(prompt) // 8 * 8
    # a prompt sharing the first 9 tokens only: one block
    _, out = run_one(engine, prompt[:9] + [15] * 8, request_id="d")
    assert out.num_cached_tokens == 8
    assert engine.num_free_blocks == engine.num_blocks        # cached blocks no request holds count as free


def test_a_shared_block_is_never_written(with_draft):
    """The pages of the blocks a request reuses are bit for bit what they were after their first
    request, in both caches, after a second request ran on them."""
    engine, runner = Engine(with_draft), with_draft.runner
    prompt = prompts(12, 1, alphabet=16)[0] * 2 + [1] * 9
    run_one(engine, prompt, request_id="a")
    hashes = chain_hashes(runner.prefix_root, np.asarray(prompt[:-1]), CACHED.block_size)
    blocks = with_draft.pool.shards[0].cached_prefix(hashes)
    assert len(blocks) == len(hashes) >= 2

    def pages() -> list[np.ndarray]:
        caches = runner.caches.take()
        runner.caches.put(*caches)
        return [np.asarray(getattr(cache, name))[:, blocks] for cache in caches for name in ("k_pages", "v_pages")]

    before = pages()
    _, out = run_one(engine, prompt[:-1] + [7], request_id="b")   # the same blocks, another last token
    assert out.num_cached_tokens == len(blocks) * CACHED.block_size
    assert all(np.array_equal(a, b) for a, b in zip(before, pages()))


@pytest.mark.parametrize("drafter, config, params", [
    ("model", CACHED, GREEDY),
    ("model", CACHED, SamplingParams(max_tokens=MAX_NEW, temperature=1.0, seed=5)),
    ("ngram", CACHED, GREEDY),
    ("model", DecoderConfig(**{**vars(CACHED), "tree": TreeConfig(max_depth=3, branching=2, max_nodes=6)}), GREEDY),
    ("model", DecoderConfig(**{**vars(CACHED), "cache_dtype": "fp8"}), GREEDY),
    (None, DecoderConfig(**{**vars(CACHED), "k": 0}), GREEDY),
], ids=["model", "model-sampled", "ngram", "tree", "fp8", "target-only"])
@pytest.mark.slow
def test_outputs_are_identical_with_the_cache_on_and_off(target, partial_draft, drafter, config, params):
    """A multi-turn chat: each turn after the first finds at least the last turn's prompt blocks cached."""
    draft = {"model": partial_draft, "ngram": NgramDrafter(1, 3), None: None}[drafter]
    runs = {caching: chat(Engine(target, draft, config=DecoderConfig(**{**vars(config), "enable_prefix_caching": caching})),
                          13, 3, params) for caching in (True, False)}
    assert [answer for _, answer, _ in runs[True]] == [answer for _, answer, _ in runs[False]]
    cached = [last.num_cached_tokens for _, _, last in runs[True]]
    assert cached[0] == 0 and all(c >= len(prompt) // 8 * 8 for c, (prompt, _, _) in zip(cached[1:], runs[True]))
    assert all(last.num_cached_tokens == 0 for _, _, last in runs[False])


def test_speculation_hits_the_cache_as_often_as_target_only(target, partial_draft):
    """Rejected drafts never reach a cache, so a chat's hit rate is the same with and without drafts."""
    hits = {}
    for name, draft, k in (("target only", None, 0), ("draft model", partial_draft, 2), ("n-gram", "ngram", 2)):
        engine = Engine(target, draft, config=DecoderConfig(**{**vars(CACHED), "k": k}))
        chat(engine, 14, 3)
        hits[name] = (engine.stats.prefix_cache_hits, engine.stats.prefix_cache_queries)
    assert len(set(hits.values())) == 1 and hits["target only"][0] > 0, hits


def test_eviction_takes_the_least_recently_used_and_outputs_stay_exact(target, partial_draft, autoregressive):
    """A pool of 12 blocks serving 32 distinct prompts evicts cached blocks as it needs them."""
    config = DecoderConfig(**{**vars(CACHED), "num_blocks": 12, "batch_buckets": (8,)})
    engine = Engine(target, partial_draft, config=config)
    batch = prompts(15, 32, alphabet=16)
    for i, prompt in enumerate(batch):
        engine.add_request(prompt, GREEDY, str(i))
    outputs = {}
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert [tokens(outputs, str(i)) for i in range(32)] == autoregressive.generate(batch, MAX_NEW).tokens
    pool = engine.runner.pool.shards[0]
    assert engine.num_free_blocks == 12 and 0 < pool.num_cached <= 12


def test_the_pool_evicts_least_recently_used_unheld_blocks_first():
    pool = BlockPool(4)
    root = prefix_root("test")
    a, b = chain_hashes(root, np.arange(8), 4), chain_hashes(root, np.arange(8) + 1, 4)
    first, second = pool.allocate(2), pool.allocate(2)
    for block, digest in zip(first + second, a + b):
        pool.register(block, digest)
    pool.free(first)                              # a's blocks unheld first: least recently used
    pool.free(second)
    assert pool.num_free == 4 and pool.num_cached == 4
    assert pool.cached_prefix(a) == first and pool.cached_prefix([b[0], root, a[0]]) == [second[0]]   # up to a miss
    pool.hold(first)                             # a request reuses a's prefix
    assert pool.num_free == 2 and pool.num_unheld(first) == 0 and pool.num_unheld(second) == 2
    taken = pool.allocate(1)                     # evicts b's tail block first (a table's tail goes first)
    assert taken == [second[1]] and pool.cached_prefix(b) == [second[0]]
    with pytest.raises(ValueError, match="invalid, unheld or duplicate"):
        pool.free([second[0]])                   # no request holds it
    pool.free(first + taken)
    assert pool.num_free == 4


def test_aborting_a_request_after_its_prefill_frees_everything(with_draft):
    engine = Engine(with_draft)
    engine.add_request(list(range(16)) * 3, SamplingParams(max_tokens=4), "long")   # 3 prefill chunks
    engine.step()
    engine.abort("long")
    assert [o.finish_reason for o in engine.step()] == ["abort"]
    assert engine.num_free_blocks == engine.num_blocks and not engine.has_unfinished()


def test_enable_prefix_caching_must_be_a_bool_or_none():
    with pytest.raises(ValueError, match="DecoderConfig.enable_prefix_caching must be a bool or None, got 1"):
        DecoderConfig(enable_prefix_caching=1)


def test_reset_prefix_cache_forgets_every_block_no_request_holds(with_draft):
    engine = Engine(with_draft)
    prompt = prompts(16, 1, alphabet=16)[0] * 3
    run_one(engine, prompt, request_id="a")
    engine.add_request(prompt, GREEDY, "b")
    engine.step()                                    # "b" holds the cached blocks of its prefix
    assert engine.reset_prefix_cache() is False
    engine.abort("b")
    engine.step()
    assert engine.reset_prefix_cache() is True and with_draft.pool.shards[0].num_cached == 0
    _, out = run_one(engine, prompt, request_id="c")
    assert out.num_cached_tokens == 0 and engine.num_free_blocks == engine.num_blocks
