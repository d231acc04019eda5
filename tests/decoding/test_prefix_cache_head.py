"""Prefix caching with an EAGLE-3 head drafting: a block is cached once the head's rows of its positions
are committed, under a hash that takes the token after the block too (the head's row at a block's last
position pairs it with that token); a request reuses its longest cached prefix in the target's cache
and the head's alike. Outputs and the head's drafts (drafted and accepted counts per position) are
identical with the cache on and off (chains, trees, seeded sampling, chunked prefill, preemptions), a
shared block is never written, and a chat hits the cache as often as without speculation."""

from __future__ import annotations

import numpy as np
import pytest

from scv_jax import DecoderConfig, Engine, SamplingParams, SpeculativeDecoder, TreeConfig
from scv_jax.decoding.block_pool import BlockPool, chain_hashes, prefix_root
from scv_jax.decoding.requests import RequestBatch
from tests.decoding.common import MAX_NEW, prompts
from tests.decoding.test_chunked_prefill import ODD, mixed_prompts
from tests.decoding.test_eagle3_decoding import FIT_PROMPTS, fit, random_head
from tests.decoding.test_engine import tokens
from tests.decoding.test_preemption import drive
from tests.decoding.test_prefix_cache import CACHED, GREEDY, chat, run_one
from tests.models.fixtures import TINY

TREE = DecoderConfig(**{**vars(CACHED), "tree": TreeConfig(max_depth=3, branching=2, max_nodes=6)})


def without_cache(config: DecoderConfig) -> DecoderConfig:
    return DecoderConfig(**{**vars(config), "enable_prefix_caching": False})


def drafting(out) -> tuple:
    """What a request's drafts were: drafted, accepted, accepted per position."""
    return out.num_draft_tokens, out.num_accepted_tokens, out.num_accepted_per_pos


@pytest.fixture(scope="module")
def head(target, autoregressive, tmp_path_factory):
    """A head fitted briefly to the target's continuations of ``FIT_PROMPTS``: some drafts accepted, some
    not, so drafts computed from wrong rows of its cache would show in the acceptance counts."""
    model = random_head(target, tmp_path_factory.mktemp("head"), seed=4, draft_vocab=TINY.vocab_size)
    continuations = autoregressive.generate(FIT_PROMPTS, 2 * MAX_NEW).tokens
    fit(model, target, [p + c for p, c in zip(FIT_PROMPTS, continuations)], steps=60)
    return model


@pytest.fixture(scope="module")
def text(autoregressive):
    """A 25-token prompt the head learned (3 full blocks of 8 and the pending token), and its output."""
    prompt = FIT_PROMPTS[0] + autoregressive.generate([FIT_PROMPTS[0]], 19).tokens[0]
    return prompt, autoregressive.generate([prompt], MAX_NEW).tokens[0]


@pytest.mark.slow
def test_a_cached_prefix_serves_the_head_and_drafts_are_unchanged(target, head, text):
    """The same prompt again (every block cached: the head's rows reach its pending token), one with
    another last token (the last block's head row pairs it with the old one: not reused), one that
    continues the first output (its blocks cached after the head's last rows were topped up), one
    sharing a block: each request's tokens and drafts as in an engine without the cache."""
    prompt, first = text
    requests = [("a", prompt, 0), ("b", prompt, 24), ("c", prompt[:-1] + [(prompt[-1] + 1) % 16], 16),
                ("d", prompt + first[:10], 32), ("e", prompt[:9] + [15] * 8, 8)]
    engines = {on: Engine(target, head, config=CACHED if on else without_cache(CACHED)) for on in (True, False)}
    accepted = 0
    for request_id, tokens_in, cached in requests:
        got = {on: run_one(engine, tokens_in, request_id=request_id) for on, engine in engines.items()}
        assert got[True][0] == got[False][0]
        assert drafting(got[True][1]) == drafting(got[False][1]), request_id
        assert (got[True][1].num_cached_tokens, got[False][1].num_cached_tokens) == (cached, 0), request_id
        accepted += got[True][1].num_accepted_tokens
    assert accepted > 0
    for engine in engines.values():
        assert engine.num_free_blocks == engine.num_blocks
    # the head's K/V rows of the blocks "c" left cached (its first two reused) are those "c" computes alone
    # without the cache (its blocks the pool's first, in order)
    sequence = prompt[:-1] + [(prompt[-1] + 1) % 16] + got[True][0]
    blocks = engines[True].runner.pool.shards[0].cached_prefix(
        chain_hashes(engines[True].runner.prefix_root, np.asarray(sequence), 8, lookahead=1))
    alone = Engine(target, head, config=without_cache(CACHED))
    run_one(alone, sequence[:len(prompt)], request_id="c")
    assert len(blocks) == (len(sequence) - 1) // 8 == 4
    np.testing.assert_allclose(head_kv(engines[True], blocks[:3]), head_kv(alone, [0, 1, 2]), atol=1e-5)


def head_kv(engine: Engine, blocks: list[int]) -> np.ndarray:
    """The head cache's K and V pages of ``blocks``."""
    caches = engine.runner.caches.take()
    engine.runner.caches.put(*caches)
    return np.stack([np.asarray(caches[1].kv.k_pages)[:, blocks], np.asarray(caches[1].kv.v_pages)[:, blocks]])


def test_a_shared_block_is_never_written_with_a_head(target, head, text):
    """The pages of the blocks a request reuses, in the target's cache and every page of the head's
    (K/V, features, tokens), are bit for bit what they were after their first request: a request whose
    prefix is cached up to its pending token runs the head's last row again for its hidden state but
    does not commit it."""
    prompt, _ = text
    decoder = SpeculativeDecoder(target, head, config=CACHED)
    engine, runner = Engine(decoder), decoder.runner
    run_one(engine, prompt, request_id="a")
    blocks = decoder.pool.shards[0].cached_prefix(chain_hashes(runner.prefix_root, np.asarray(prompt), 8, lookahead=1))
    assert len(blocks) == 3

    def pages() -> list[np.ndarray]:
        target_cache, head_cache = runner.caches.take()
        runner.caches.put(target_cache, head_cache)
        kv = [target_cache, head_cache.kv]
        pages = [np.asarray(getattr(cache, name))[:, blocks] for cache in kv for name in ("k_pages", "v_pages")]
        return pages + [np.asarray(head_cache.features)[blocks], np.asarray(head_cache.tokens)[blocks]]

    # marked (+0.5 on the head's keys): a rewrite, even of the values they held, would show
    target_cache, head_cache = runner.caches.take()
    k_pages = head_cache.kv.k_pages.at[:, np.asarray(blocks)].add(0.5)
    runner.caches.put(target_cache, head_cache._replace(kv=head_cache.kv.replace(k_pages=k_pages)))
    before = pages()
    for request_id, tokens_in in (("b", prompt), ("c", prompt + [1, 2]), ("d", prompt[:-1] + [7])):
        run_one(engine, tokens_in, request_id=request_id)
    assert all(np.array_equal(a, b) for a, b in zip(before, pages()))


@pytest.mark.parametrize("config", [CACHED, TREE], ids=["chain", "tree"])
def test_a_chat_with_a_head_is_unchanged_by_the_cache(target, head, config):
    """Each turn's prompt is the last prompt + its answer + a new message: each turn after the first finds
    at least the last turn's prompt blocks cached, and tokens and drafts are the cache-off run's."""
    runs = {on: chat(Engine(target, head, config=config if on else without_cache(config)), 13, 3)
            for on in (True, False)}
    assert [answer for _, answer, _ in runs[True]] == [answer for _, answer, _ in runs[False]]
    assert [drafting(last) for *_, last in runs[True]] == [drafting(last) for *_, last in runs[False]]
    cached = [last.num_cached_tokens for *_, last in runs[True]]
    assert cached[0] == 0 and all(c >= len(prompt) // 8 * 8 for c, (prompt, *_) in zip(cached[1:], runs[True]))


@pytest.mark.slow
def test_seeded_sampling_with_a_head_through_chunks_and_preemptions_is_unchanged_by_the_cache(target, head):
    """Chunks of 5 over blocks of 8, eight seeded sampled requests sharing 24-token prefixes in a pool of
    12 blocks: prefix hits and preemptions happen, and tokens and drafts are the cache-off run's (greedy:
    tests/decoding/test_chunked_prefill.py)."""
    requests = [(p, SamplingParams(max_tokens=MAX_NEW, temperature=1.0, seed=i))
                for i, p in enumerate(mixed_prompts(5))]
    results = {}
    for on in (True, False):
        engine = Engine(target, head, config=ODD if on else without_cache(ODD))
        outputs, _ = drive(engine, requests)
        results[on] = [(tokens(outputs, str(i)), drafting(outputs[str(i)][-1])) for i in range(len(requests))]
        assert engine.stats.num_preemptions > 0 and engine.num_free_blocks == engine.num_blocks
        assert (engine.stats.prefix_cache_hits > 0) == on
    assert results[True] == results[False]


def test_a_head_hits_the_cache_as_often_as_target_only(target, head):
    """A chat's prefix-cache hits and queries are the same drafting with a head (chains, trees) as
    without speculation."""
    hits = {}
    for name, draft, config in (("target only", None, DecoderConfig(**{**vars(CACHED), "k": 0})),
                                ("head chain", head, CACHED), ("head tree", head, TREE)):
        engine = Engine(target, draft, config=config)
        chat(engine, 14, 3)
        hits[name] = (engine.stats.prefix_cache_hits, engine.stats.prefix_cache_queries)
    assert len(set(hits.values())) == 1 and hits["target only"][0] > 0, hits


def test_block_hashes_take_the_token_after_the_block_with_a_head():
    """A block is hashed with the token after it, so a prompt has as many cacheable blocks as without."""
    root = prefix_root("test")
    batch, plain = (RequestBatch(2, 64, 8, 8, [BlockPool(8)], root, lookahead) for lookahead in (1, 0))
    tokens_in = prompts(3, 1, alphabet=16)[0] * 3
    for length in (16, 17, 18, 25):
        assert len(batch.prefix_hashes(tokens_in[:length])) == len(plain.prefix_hashes(tokens_in[:length])) \
            == (length - 1) // 8
    a, b = (batch.prefix_hashes(tokens_in[:16] + [t, 0]) for t in (1, 2))     # block 1 hashed with token 16
    assert a[0] == b[0] and a[1] != b[1] and a[1] == batch.prefix_hashes(tokens_in[:16] + [1, 5])[1]
    c, d = (plain.prefix_hashes(tokens_in[:16] + [t, 0]) for t in (1, 2))
    assert c == d
