"""The fused verify step: acceptance + commit, padding invisibility in graph mode, no recompiles after
warm-up, and the one-transfer host fetch."""

import functools

import chex
import jax
import numpy as np
import pytest
from hypothesis import given, strategies as st

import scv_jax
from scv_jax import CompileCounter, PagedKVCache, fetch_step_output, start_fetch, verify_step, verify_step_cache

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, VOCAB = 2, 8, 4, 2, 8, 11
NUM_SLOTS = BLOCKS * BLOCK_SIZE
BATCH_BUCKETS, SPEC_LENS = (1, 2, 4), (1, 2, 4)
plain_verify = jax.jit(verify_step, static_argnames=("max_spec_len", "kv_layout", "backend"))


def random_cache(seed):
    rng = np.random.default_rng(seed)
    cache = PagedKVCache.create(LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, dtype="float32")
    shape = cache.k_pages.shape
    return cache.replace(k_pages=jax.numpy.asarray(rng.standard_normal(shape), np.float32),
                         v_pages=jax.numpy.asarray(rng.standard_normal(shape), np.float32))


def random_step(seed, num_requests, max_drafts, *, layout="drafts", sampling=False):
    """Host-side (numpy) inputs of one step, as a scheduler would hold them."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, max_drafts + 1, num_requests)
    cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    num_slots = int(cu[-1])
    drafts = rng.integers(0, VOCAB, num_slots).astype(np.int32)
    rows = {"drafts": num_slots, "query": num_slots + num_requests, "grid": num_requests * (max_drafts + 1)}[layout]
    kv = rng.standard_normal((2, LAYERS, rows, HEADS, HEAD_DIM)).astype(np.float32)
    args = dict(new_keys=kv[0], new_values=kv[1],
                slot_mapping=rng.permutation(NUM_SLOTS)[:rows].astype(np.int32),
                draft_token_ids=drafts, cu_num_draft_tokens=cu,
                bonus_token_ids=rng.integers(0, VOCAB, num_requests).astype(np.int32),
                max_spec_len=max_drafts, kv_layout=layout)
    if sampling:
        probs = rng.random((2, num_slots, VOCAB)).astype(np.float32) ** 4
        args.update(target_probs=probs[0] / probs[0].sum(-1, keepdims=True),
                    draft_probs=probs[1] / probs[1].sum(-1, keepdims=True), key=jax.random.key(seed))
    else:
        matches = rng.random(num_slots) < 0.7
        args["target_token_ids"] = np.where(matches, drafts, rng.integers(0, VOCAB, num_slots)).astype(np.int32)
    return args


def expected_commit_rows(args, num_accepted, request_mask):
    """Rows to commit, per the layout contract, from the host's view."""
    cu, rows = args["cu_num_draft_tokens"], []
    for b, n in enumerate(num_accepted):
        if not request_mask[b]:
            continue
        if args["kv_layout"] == "drafts":
            rows += list(range(cu[b], cu[b] + n))
        elif args["kv_layout"] == "query":
            rows += list(range(cu[b] + b, cu[b] + b + n + 1))
        else:
            width = args["max_spec_len"] + 1
            rows += list(range(b * width, b * width + n + 1))
    return rows


@pytest.mark.parametrize("layout", ["drafts", "query", "grid"])
@pytest.mark.parametrize("sampling", [False, True])
def test_verify_step_matches_acceptance_and_commits_only_accepted(layout, sampling):
    args = random_step(11, 4, 3, layout=layout, sampling=sampling)
    request_mask = np.array([True, True, False, True])
    cache, out = plain_verify(random_cache(0), **args, request_mask=request_mask, backend="xla")
    accept_args = {k: args[k] for k in ("draft_token_ids", "cu_num_draft_tokens", "bonus_token_ids",
                                        "max_spec_len")}
    if sampling:
        ref = scv_jax.rejection_sample(draft_probs=args["draft_probs"], target_probs=args["target_probs"],
                                       key=args["key"], backend="xla", **accept_args)
    else:
        ref = scv_jax.accept_greedy(target_token_ids=args["target_token_ids"], backend="xla", **accept_args)
    tokens, num_accepted = np.array(ref.output_token_ids), np.array(ref.num_accepted)
    tokens[~request_mask], num_accepted[~request_mask] = -1, 0
    np.testing.assert_array_equal(np.asarray(out.output_token_ids), tokens)
    np.testing.assert_array_equal(np.asarray(out.num_accepted), num_accepted)
    host = fetch_step_output(out)
    assert host.token_lists() == [list(r[r >= 0]) for r in tokens]
    np.testing.assert_array_equal(host.num_emitted, np.where(request_mask, num_accepted + 1, 0))

    expected_k = np.asarray(random_cache(0).k_pages).reshape(LAYERS, NUM_SLOTS, HEADS, HEAD_DIM).copy()
    for row in expected_commit_rows(args, num_accepted, request_mask):
        expected_k[:, args["slot_mapping"][row]] = args["new_keys"][:, row]
    np.testing.assert_array_equal(np.asarray(cache.k_pages).reshape(expected_k.shape), expected_k)


# One graph-mode cache per layout, shared by the hypothesis examples below.
@functools.cache
def graph_cache(layout):
    return verify_step_cache(batch_buckets=BATCH_BUCKETS, spec_lens=SPEC_LENS, kv_layout=layout)


@given(num_requests=st.integers(0, 4), max_drafts=st.integers(1, 4), seed=st.integers(0, 2**16),
       layout=st.sampled_from(["drafts", "query"]), sampling=st.booleans())
@pytest.mark.slow
def test_padding_does_not_change_results(num_requests, max_drafts, seed, layout, sampling):
    args = random_step(seed, num_requests, max_drafts, layout=layout, sampling=sampling)
    want_cache, want = plain_verify(random_cache(seed), **args, backend="xla")
    step = graph_cache(layout)
    got_cache, got = step(random_cache(seed), **args, backend="xla")
    plan = step.plan(random_cache(seed), **args, backend="xla")
    assert got.output_token_ids.shape == (plan.padded["batch"], plan.statics["max_spec_len"] + 1)
    got_tokens = np.asarray(got.output_token_ids)
    np.testing.assert_array_equal(got_tokens[:num_requests, :max_drafts + 1], np.asarray(want.output_token_ids))
    assert np.all(got_tokens[num_requests:] == -1) and np.all(got_tokens[:, max_drafts + 1:] == -1)
    np.testing.assert_array_equal(np.asarray(got.num_accepted)[:num_requests], np.asarray(want.num_accepted))
    assert np.all(np.asarray(got.num_accepted)[num_requests:] == 0)
    np.testing.assert_array_equal(np.asarray(got.accept_mask)[:args["draft_token_ids"].shape[0]],
                                  np.asarray(want.accept_mask))
    assert fetch_step_output(got, num_requests).token_lists() == fetch_step_output(want).token_lists()
    for name in ("k_pages", "v_pages"):
        np.testing.assert_array_equal(np.asarray(getattr(got_cache, name)), np.asarray(getattr(want_cache, name)))


@pytest.mark.parametrize("layout", ["drafts", "query"])
def test_greedy_from_logits_equals_greedy_from_their_argmax(layout):
    args = random_step(7, 3, 4, layout=layout)
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((args["draft_token_ids"].shape[0], VOCAB)).astype(np.float32)
    logits[np.arange(logits.shape[0]), args.pop("target_token_ids")] = 10.0       # the argmax per slot
    want_cache, want = plain_verify(random_cache(1), **args, target_token_ids=np.argmax(logits, -1).astype(np.int32))
    got_cache, got = plain_verify(random_cache(1), **args, target_logits=logits)
    chex.assert_trees_all_equal((got_cache, got), (want_cache, want))
    assert 0 < int(np.asarray(got.num_accepted).sum()) < args["draft_token_ids"].shape[0]


def test_no_recompiles_after_warmup_and_no_sync_in_the_step():
    step = verify_step_cache(batch_buckets=BATCH_BUCKETS, spec_lens=SPEC_LENS)
    cache = random_cache(0)
    report = step.warmup(cache, **random_step(0, 2, 2), backend="xla", max_workers=2, progress=False)
    assert report.buckets == report.compiled == len(BATCH_BUCKETS) * len(SPEC_LENS)
    rng = np.random.default_rng(1)
    emitted = real_tokens = padded_tokens = 0
    with CompileCounter() as compiles:
        for i in range(30):
            num_requests, k = int(rng.integers(1, 5)), int(rng.integers(1, 5))
            args = random_step(i, num_requests, k)
            plan = step.plan(cache, **args, backend="xla")
            real_tokens += plan.real["tokens"]
            padded_tokens += plan.padded["tokens"]
            with jax.transfer_guard_device_to_host("disallow"):
                cache, out = step(cache, **args, backend="xla")
            pending = start_fetch(out, num_requests)        # the step's one device->host transfer
            host = pending.result()
            assert host.output_token_ids.shape[0] == num_requests
            emitted += int(host.num_emitted.sum())
    assert (compiles.traces, compiles.count, compiles.loads) == (0, 0, 0)
    assert step.stats.hits == 30 and step.stats.misses == 0 and step.stats.fallbacks == 0
    assert emitted >= 30 and step.stats.padding_ratio("tokens") == padded_tokens / real_tokens
    assert step.stats.unaliased_donations == 0


def test_kv_cache_is_donated_in_place():
    step = verify_step_cache(batch_buckets=(2,), spec_lens=(2,))
    cache = random_cache(0)
    args = random_step(0, 2, 2)
    new_cache, _ = step(cache, **args, backend="xla")
    assert cache.k_pages.is_deleted()
    analysis = step.executable(step.plan(new_cache, **args, backend="xla").key).memory_analysis()
    assert analysis.alias_size_in_bytes >= 2 * cache.k_pages.size * 4


def test_clear_errors():
    args = random_step(0, 2, 2)
    with pytest.raises(ValueError, match="exactly one of target_token_ids or target_logits"):
        verify_step(random_cache(0), **args, target_probs=np.ones((4, VOCAB), np.float32))
    one_more = lambda x: np.concatenate([x, x[:, :1]], axis=1)   # noqa: E731
    bad = dict(args, new_keys=one_more(args["new_keys"]), new_values=one_more(args["new_values"]),
               slot_mapping=np.append(args["slot_mapping"], -1).astype(np.int32))
    with pytest.raises(ValueError, match="kv_layout='drafts' needs new_keys"):
        verify_step(random_cache(0), **bad)
    with pytest.raises(ValueError, match="kv_layout must be"):
        verify_step(random_cache(0), **dict(args, kv_layout="paged"))
    grid = random_step(0, 2, 2, layout="grid")
    with pytest.raises(ValueError, match=r"kv_layout='grid' needs new_keys .* \(max_spec_len \+ 1\) = 8 rows, got 6"):
        verify_step(random_cache(0), **dict(grid, max_spec_len=3))
    with pytest.raises(ValueError, match="verify_step_cache: kv_layout must be 'drafts' or 'query'"):
        verify_step_cache(kv_layout="grid")
