"""Token trees in the decoder (``DecoderConfig(tree=TreeConfig(...))``): greedy output equals autoregressive
decoding with a draft model's tree and with n-gram tries (odd prompt lengths, requests arriving mid-flight;
eos and stop ids: test_stops.py); sampled tokens follow the filtered target distribution (chi-square); a step writes the pending
token and the accepted path only; nothing compiles after warm-up."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scv_jax import DecoderConfig, Engine, NgramDrafter, SamplingParams, SpeculativeDecoder, TreeConfig, decoder_mesh
from scv_jax.decoding.device_step import SamplingColumn, SplitModel, StepRow
from scv_jax.decoding.proposers.ngram import NgramDrafter as _Drafter
from scv_jax.decoding.proposers.ngram_trie import build_trie, continuations, propose_tries
from scv_jax.decoding.step_fn import make_decode_step
from scv_jax.decoding.tree_verifier import TreeVerifier, tree_inputs
from scv_jax.graph.compile_counter import CompileCounter
from scv_jax.ops.commit.kv_cache import PagedKVCache
from tests.decoding.common import MAX_NEW, SMALL, prompts
from tests.decoding.test_engine import first_two_tokens_follow_the_target, run, target_logits, tokens  # noqa: F401 (a fixture)
from scv_jax.models import TransformerConfig
from tests.models.fixtures import TINY, TINY_DRAFT, tiny_model

TREE = TreeConfig(max_depth=3, branching=2, max_nodes=6)        # a draft model's tree: 6 of 10 candidates
TREE_CONFIG = DecoderConfig(**{**vars(SMALL), "tree": TREE})


@pytest.fixture(scope="module")
def tree_decoders(target, partial_draft):
    return {"model": SpeculativeDecoder(target, partial_draft, config=TREE_CONFIG),
            "ngram": SpeculativeDecoder(target, NgramDrafter(1, 3), config=TREE_CONFIG)}


@pytest.mark.parametrize("drafter", ["model", "ngram"])
@pytest.mark.slow
def test_greedy_trees_equal_autoregressive_decoding(tree_decoders, autoregressive, drafter):
    """Greedy requests of odd lengths and budgets, some arriving while others run (6 > 4 rows: one waits),
    one sampled request in the batch: each greedy one is its autoregressive output, trees accept drafts."""
    engine = Engine(tree_decoders[drafter])
    batch = prompts(33, 6, alphabet=3 if drafter == "ngram" else TINY.vocab_size)
    sampled = SamplingParams(temperature=1.0, top_p=0.8, seed=5, max_tokens=9)
    arrivals = {0: [(batch[0], SamplingParams(max_tokens=MAX_NEW), "a"), (batch[1], sampled, "b")],
                2: [(batch[2], SamplingParams(max_tokens=5), "c")],
                3: [(batch[3], SamplingParams(max_tokens=MAX_NEW), "d"), (batch[4], SamplingParams(max_tokens=1), "e"),
                    (batch[5], SamplingParams(max_tokens=11), "f")]}
    outputs = run(engine, arrivals)
    for request_id, prompt, budget in (("a", batch[0], MAX_NEW), ("c", batch[2], 5), ("d", batch[3], MAX_NEW),
                                       ("e", batch[4], 1), ("f", batch[5], 11)):
        assert tokens(outputs, request_id) == autoregressive.generate([prompt], budget).tokens[0], request_id
    assert len(tokens(outputs, "b")) == 9
    assert engine.num_free_blocks == engine.num_blocks and not engine.has_unfinished()
    assert sum(o[-1].num_accepted_tokens for o in outputs.values()) > 0


def _random_cache(seed: int, num_blocks: int, block_size: int, config) -> PagedKVCache:
    rng = np.random.default_rng(seed)
    cache = PagedKVCache.create(config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim,
                                dtype="float32")
    k, v = (rng.standard_normal(cache.k_pages.shape).astype(np.float32) for _ in range(2))
    return dataclasses.replace(cache, k_pages=jnp.asarray(k), v_pages=jnp.asarray(v))


def _written(before: PagedKVCache, after: PagedKVCache, tables: np.ndarray, block_size: int) -> list[set[int]]:
    """Each request's cache positions whose K or V changed (every byte of the other blocks unchanged)."""
    changed = np.any(np.asarray(before.k_pages) != np.asarray(after.k_pages), axis=(0, 3, 4)) | np.any(
        np.asarray(before.v_pages) != np.asarray(after.v_pages), axis=(0, 3, 4))           # [blocks, block_size]
    owned = set(tables[tables >= 0].tolist())
    assert not changed[[b for b in range(changed.shape[0]) if b not in owned]].any()
    return [{int(j) * block_size + o for j, blk in enumerate(row) if blk >= 0 for o in np.flatnonzero(changed[blk])}
            for row in tables]


@pytest.mark.parametrize("source", ["model", "host"])
@pytest.mark.parametrize("greedy", [True, False])
def test_a_step_writes_the_pending_token_and_the_accepted_path_only(target, source, greedy):
    """Random caches, a draft equal to the target (long accepted paths) or a host tree: the target cache
    changes at the pending token's and the accepted nodes' positions only, the draft cache at its lag
    tokens' and the accepted nodes' but the last."""
    block_size, num_blocks, context = 4, 12, np.array([5, 9])
    tables = np.array([[3, 7, 1, 8], [0, 2, 5, 6]], np.int32)
    lag, cap = np.array([1, 2]), np.array([3, 2])
    rows = np.zeros((2, StepRow.WIDTH), np.int32)
    rows[:, StepRow.LAG], rows[:, StepRow.CONTEXT], rows[:, StepRow.NUM_DRAFTS] = lag, context, cap
    rows[:, StepRow.KEY:StepRow.KEY + 2] = [[1, 2], [3, 4]]
    rows[:, StepRow.STOP:StepRow.TOKENS] = -1
    rows[:, StepRow.TOKENS:] = [[2, 7], [4, 1]]
    sampling = np.zeros((2, SamplingColumn.WIDTH), np.float32)
    if not greedy:
        sampling[:, SamplingColumn.TEMPERATURE] = 1.0
    split_target, target_params = SplitModel.split(target)
    draft = tiny_model(TINY, seed=0)
    split_draft, draft_params = SplitModel.split(draft)
    target_cache = _random_cache(1, num_blocks, block_size, TINY)
    draft_cache = _random_cache(1, num_blocks, block_size, TINY)
    step = jax.jit(make_decode_step(split_target, split_draft, block_size, TreeVerifier(TREE)),
                   static_argnames=("k", "greedy", "backend"))
    if source == "model":
        args = dict(draft_params=draft_params, drafts=None)
        k = TREE.draft_nodes()
    else:        # the target's greedy tokens off the first branch: node 1, then node 3 below it
        greedy_tokens = []
        for b in range(2):
            path = [int(rows[b, -1])]
            for _ in range(2):
                logits = target.forward_paged(jnp.array([path], jnp.int32), target_cache, jnp.asarray(tables[b:b + 1]),
                                              jnp.asarray(context[b:b + 1]), backend="xla").logits
                path.append(int(jnp.argmax(logits[0, -1])))
            greedy_tokens.append(path[1:])
        drafts = [[[(t1 + 1) % TINY.vocab_size, t1, 0, t2], [-1, -1, 0, 1]] for t1, t2 in greedy_tokens]
        args = dict(draft_params=None, drafts=jnp.array(drafts, jnp.int32))
        k = 4
    new_target, new_draft, summary = step(target_params, args["draft_params"], target_cache, draft_cache,
                                          jnp.asarray(tables), jnp.asarray(rows), jnp.asarray(sampling),
                                          args["drafts"], k=k, greedy=greedy, backend="xla")
    packed = np.asarray(summary.packed)
    accepted = packed[:, -3]
    assert np.all(accepted <= cap)
    for b, positions in enumerate(_written(target_cache, new_target, tables, block_size)):
        assert positions == set(range(context[b], context[b] + accepted[b] + 1)), (b, accepted)
        # the written K/V are a chain forward's over [pending, the accepted tokens]
        path = [int(rows[b, -1])] + packed[b, :accepted[b]].tolist()
        chain = target.forward_paged(jnp.array([path], jnp.int32), target_cache, jnp.asarray(tables[b:b + 1]),
                                     jnp.asarray(context[b:b + 1]), backend="xla")
        slots = [tables[b, p // block_size] * block_size + p % block_size for p in range(context[b], context[b] + len(path))]
        stored = np.asarray(new_target.k_pages).reshape(TINY.num_layers, -1, TINY.num_kv_heads, TINY.head_dim)[:, slots]
        np.testing.assert_allclose(stored, np.asarray(chain.keys)[:, 0], atol=1e-5, rtol=1e-5)
    if source == "model":
        assert accepted.max() >= 2              # the draft is the target: its best child is the target's token
        draft_lens = context + 1 - lag
        for b, positions in enumerate(_written(draft_cache, new_draft, tables, block_size)):
            n = draft_lens[b] + lag[b]
            assert positions == set(range(draft_lens[b], n)) | set(range(n, n + max(accepted[b] - 1, 0))), b
    else:
        assert accepted[0] == 2 or not greedy             # nodes 1 and 3
        assert new_draft is draft_cache or _written(draft_cache, new_draft, tables, block_size) == [set(), set()]


@pytest.mark.slow
def test_a_draft_equal_to_the_target_accepts_everything_and_caches_what_the_target_does(target):
    """The target as its own draft: every step accepts its whole depth cap, and the draft cache ends up
    holding the target cache's K/V at every position but the last ones its lag leaves out (the accepted
    nodes' K/V come from the expansion forwards, with tree attention; the lag bookkeeping leaves no hole)."""
    config = DecoderConfig(**{**vars(TREE_CONFIG), "batch_buckets": (1,)})
    decoder = SpeculativeDecoder(target, tiny_model(TINY, seed=0), config=config)
    prompt = prompts(37, 1)[0]
    out = decoder.generate([prompt], MAX_NEW)
    assert out.stats.acceptance_rate == 1.0 and out.stats.mean_accepted_length > TREE.max_depth
    target_cache, draft_cache = decoder.runner.caches.take()
    decoder.runner.caches.put(target_cache, draft_cache)
    flat = [np.asarray(c.k_pages).reshape(TINY.num_layers, -1, TINY.num_kv_heads * TINY.head_dim)
            for c in (target_cache, draft_cache)]          # the request had blocks 0, 1, ... in order
    target_written, draft_written = (np.any(f != 0, axis=(0, 2)) for f in flat)
    total = len(prompt) + MAX_NEW - 1                       # positions the target committed
    assert target_written[:total].all() and not target_written[total:].any()
    assert draft_written[:total - 2].all() and not draft_written[total:].any()
    np.testing.assert_allclose(flat[1][:, draft_written], flat[0][:, draft_written], atol=1e-4, rtol=1e-4)


def test_tree_inputs_cut_stops_depth_and_bad_parents():
    tokens = jnp.array([[4, 5, 6, 7, 8]], jnp.int32)
    parents = jnp.array([[-1, 0, 1, -1, 7]], jnp.int32)       # node 4's parent is out of range
    stops = jnp.array([[5, -1]], jnp.int32)
    forward, accept = tree_inputs(tokens, parents, jnp.array([3]), stops)
    assert forward.tolist() == [[-1, 0, 1, 2, 0, 0]]
    # node 1 (a stop token) stays; node 2 (below it) and node 4 (bad parent) are cut
    assert accept.tolist() == [[-1, 0, 2, -1, 4]]
    _, accept = tree_inputs(tokens, parents, jnp.array([1]), jnp.full((1, 2), -1, jnp.int32))
    assert accept.tolist() == [[-1, 1, 2, -1, 4]]             # depth cap 1: nodes 1 and 2 are too deep


def test_ngram_trie():
    text = np.array([1, 2, 3, 1, 2, 4, 1, 2, 3, 9, 1, 2])
    assert [c.tolist() for c in continuations(text, (3, 2, 1), 3)] == [[3, 9, 1], [4, 1, 2], [3, 1, 2]]
    trie = build_trie(continuations(text, (3, 2, 1), 3), max_nodes=4)
    # "3" twice, then "4", "3 9" / "3 1" once each: the more recent first
    assert trie.tokens == [3, 4, 9, 1] and trie.parents == [-1, -1, 0, 1] and trie.depth == 2
    # no earlier (3, 4, 2) nor (4, 2): the 1-gram (2,) and what followed it
    assert [c.tolist() for c in continuations(np.array([1, 2, 3, 4, 2]), (3, 2, 1), 2)] == [[3, 4]]
    assert continuations(np.array([1, 2, 3]), (2, 1), 2) == []
    index = _Drafter(1, 3).index(text.tolist())
    assert propose_tries([index], 6, np.array([0]))[0].tokens == []
    assert propose_tries([index], 6, np.array([1]))[0].tokens == [3, 4]


@pytest.mark.slow
def test_no_compile_after_warmup(target):
    """Warm-up compiles every node bucket of n-gram tries, greedy and sampled; a run with requests joining
    and leaving then compiles nothing."""
    engine = Engine(target, NgramDrafter(1, 2), config=TREE_CONFIG)
    engine.warmup(4, SMALL.max_seq_len, temperatures=(0.0, 1.0))
    batch = prompts(81, 6, alphabet=3)
    kinds = [SamplingParams(max_tokens=9), SamplingParams(temperature=0.7, top_p=0.9, max_tokens=7, seed=1)]
    arrivals: dict[int, list] = {}
    for i, step in enumerate((0, 0, 1, 3, 4, 6)):
        arrivals.setdefault(step, []).append((batch[i], kinds[i % 2], str(i)))
    with CompileCounter() as compiles:
        outputs = run(engine, arrivals)
    assert compiles.count == compiles.loads == 0 and engine.stats.compiled == []
    assert len(outputs) == 6 and engine.num_free_blocks == engine.num_blocks
    assert len(engine.stats.k_histogram) >= 3           # several node buckets ran


@pytest.fixture(scope="module")
def sampling_tree_decoders(target):
    """A poor draft model (most nodes rejected) and n-gram tries (candidates: point masses)."""
    return {"model": SpeculativeDecoder(target, tiny_model(TINY_DRAFT, seed=9, scale=1.0), config=TREE_CONFIG),
            "ngram": SpeculativeDecoder(target, NgramDrafter(1, 2), config=TREE_CONFIG)}


@pytest.mark.parametrize("drafter", ["model", "ngram"])
@pytest.mark.slow
def test_sampled_tree_tokens_follow_the_filtered_target(target_logits, autoregressive, sampling_tree_decoders,
                                                        drafter):
    """Tokens 1 and 2 of many seeded requests (one in four greedy, in the same batches) against the filtered
    target distribution: token 1's, and token 2's after the most frequent token 1."""
    engine = Engine(sampling_tree_decoders[drafter])
    prompt = [3, 1, 4, 3, 1, 5, 3, 1]                        # the trie after (3, 1): 4 and 5
    params = SamplingParams(max_tokens=3, temperature=1.2, top_k=6)
    count = 400
    arrivals = {0: [(prompt, SamplingParams(max_tokens=3) if i % 4 == 0 else
                     SamplingParams(**{**vars(params), "seed": i}), str(i)) for i in range(count)]}
    outputs = run(engine, arrivals, max_steps=count)
    greedy = autoregressive.generate([prompt], 3).tokens[0]
    sampled = [tokens(outputs, str(i)) for i in range(count) if i % 4]
    assert all(tokens(outputs, str(i)) == greedy for i in range(0, count, 4))

    first_two_tokens_follow_the_target(sampled, prompt, params, target_logits)
    accepted = sum(outputs[str(i)][-1].num_accepted_tokens for i in range(count))
    assert accepted > 0


def test_tree_refusals(target, partial_draft):
    engine = Engine(target, partial_draft, config=TREE_CONFIG)
    with pytest.raises(ValueError, match="add_request: SamplingParams.logprobs needs chain drafts"):
        engine.add_request([1, 2], SamplingParams(max_tokens=3, logprobs=2))
    with pytest.raises(ValueError, match=r"^warmup: logprobs needs chain drafts \(DecoderConfig.tree=None\)") as error:
        engine.warmup(2, 16, logprobs=True)         # up front: nothing compiled
    assert "\n" not in str(error.value) and engine.runner.graph_stats["decode"].compiles == 0
    with pytest.raises(ValueError, match="SpeculativeDecoder: DecoderConfig.tree needs one device"):
        SpeculativeDecoder(target, partial_draft, config=TREE_CONFIG, mesh=decoder_mesh(1, 1))
    wide = DecoderConfig(**{**vars(SMALL), "tree": TreeConfig(max_depth=2, branching=17, max_nodes=8)})
    with pytest.raises(ValueError, match="TreeConfig.branching 17 exceeds vocab_size 16"):
        SpeculativeDecoder(target, partial_draft, config=wide)
    assert SpeculativeDecoder(target, None, config=TREE_CONFIG).config.tree is None   # no drafter: plain decoding


@pytest.mark.slow
def test_greedy_trees_are_lossless_with_every_kernel_interpreted():
    """The Mosaic kernels in interpret mode (tree attention, the tree walk, the commit) give the XLA path's
    tokens; head_dim 64 and kv_heads * head_dim = 128 put every op on its kernel."""
    wide = TransformerConfig(vocab_size=32, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, head_dim=64,
                             ffn_dim=96)
    geometry = dict(block_size=16, num_blocks=16, max_seq_len=64, prefill_chunk=16, batch_buckets=(2,),
                    context_buckets=(4,))
    target, draft = tiny_model(wide), tiny_model(wide, seed=0, scale=2.0)
    prompts_ = [[1, 2, 3, 4, 5], [7, 8, 9]]
    want = SpeculativeDecoder(target, None, config=DecoderConfig(backend="xla", **geometry)).generate(prompts_, 6)
    config = DecoderConfig(tree=TreeConfig(max_depth=2, branching=2, max_nodes=4), backend="interpret", **geometry)
    out = SpeculativeDecoder(target, draft, config=config).generate(prompts_, 6)
    assert out.tokens == want.tokens and out.stats.acceptance_rate > 0
