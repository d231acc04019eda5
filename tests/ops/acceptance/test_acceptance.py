"""Acceptance ops: every backend against a numpy loop, kernels against references, losslessness."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import scv_jax
from scv_jax.ops.acceptance import reference as acceptance_ref
from scv_jax.ops.acceptance.randomness import normalize_keys, slot_randomness
from tests.ops.acceptance.cases import (DraftBatch, as_jax, assert_result_equal, draft_batches,
                                    greedy_oracle, keys_for, random_probs, rejection_oracle)

from scv_jax.ops.registry import cuda_available

# On a GPU the kernels run natively; on CPU in Mosaic GPU interpret mode.
BACKENDS = ["xla", "pallas" if cuda_available() else "interpret"]


def _slot_randomness(key, batch: DraftBatch):
    keys = normalize_keys("test", key, len(batch.cu) - 1)
    randomness = jax.jit(slot_randomness, static_argnums=2)(keys, jnp.asarray(batch.cu), len(batch.draft))
    return [np.asarray(a) for a in randomness]


@pytest.mark.parametrize("backend", BACKENDS)
@given(batch=draft_batches())
def test_greedy_matches_oracle(backend, batch):
    result = scv_jax.accept_greedy(*as_jax(batch.draft, batch.cu, batch.target, batch.bonus),
                                   max_spec_len=batch.max_spec_len, backend=backend)
    assert_result_equal(result, greedy_oracle(batch))


@pytest.mark.parametrize("backend", BACKENDS)
@given(batch=draft_batches(spec_lens=(1, 6), batch_sizes=(2, 6), vocab_sizes=(12,)),
       kind=st.sampled_from(["dirichlet", "sparse", "onehot", "none"]),
       seed=st.integers(0, 2**20))
@pytest.mark.slow
def test_rejection_matches_oracle(backend, batch, kind, seed):
    rng = np.random.default_rng(seed)
    t, v = len(batch.draft), batch.vocab_size
    target_probs = random_probs(rng, (t, v), "dirichlet" if kind == "none" else kind)
    draft_probs = None if kind == "none" else random_probs(rng, (t, v), kind)
    key = jax.random.key(seed)
    result = scv_jax.rejection_sample(*as_jax(batch.draft, batch.cu), draft_probs, jnp.asarray(target_probs),
                                      jnp.asarray(batch.bonus), key=key, max_spec_len=batch.max_spec_len,
                                      backend=backend)
    uniforms, seeds = _slot_randomness(key, batch)
    assert_result_equal(result, rejection_oracle(batch, draft_probs, target_probs, uniforms, seeds))


def _kernel_interpret() -> bool:
    return not cuda_available()


@pytest.mark.parametrize("vocab_size,with_draft_probs,dtype", [
    (5000, True, jnp.float32),      # several tiles, V not a multiple of the tile
    (2048, False, jnp.bfloat16),    # exactly one large tile, q = one-hot(draft)
    (700, True, jnp.float16),       # between the small and the large tile
    (3, True, jnp.float32),         # padded up to one small tile (with NaN, which never wins)
])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_recovered_token_kernel_matches_reference(vocab_size, with_draft_probs, dtype, num_splits):
    """The race runs only at each request's first rejected slot, for any number of vocab splits."""
    from pallas_kernels.recovered_tokens import recover_rejected_tokens
    rng = np.random.default_rng(vocab_size)
    cu = jnp.array([0, 3, 3, 5, 8], jnp.int32)          # requests of 3, 0, 2, 3 drafts
    num_accepted = jnp.array([1, 0, 2, 0], jnp.int32)   # 1 rejects at slot 1, 2 accepts all, 3 at slot 5
    t, k = 8, 3
    p = jnp.asarray(random_probs(rng, (t, vocab_size), "dirichlet"), dtype)
    q = jnp.asarray(random_probs(rng, (t, vocab_size), "dirichlet"), dtype) if with_draft_probs else None
    draft = jnp.asarray(rng.integers(0, vocab_size, t), jnp.int32)
    seeds = jnp.asarray(rng.integers(0, 2**32, t, dtype=np.uint64), jnp.uint32)
    tokens = jnp.full((4, k + 1), -7, jnp.int32)
    got = np.asarray(recover_rejected_tokens(tokens, num_accepted, cu, draft, q, p, seeds, max_spec_len=k,
                                             num_splits=num_splits, interpret=_kernel_interpret()))
    recovered = np.asarray(acceptance_ref.recovered_tokens_reference(draft, q, p, seeds))
    expected = np.full((4, k + 1), -7, np.int32)
    expected[0, 1], expected[3, 0] = recovered[1], recovered[5]
    np.testing.assert_array_equal(got, expected)


def _special_logits(rng, shape, dtype) -> np.ndarray:
    """Logits with exact ties at the maximum, NaNs, infinities and all-NaN / all -inf rows."""
    x = rng.standard_normal(shape).astype(np.float32)
    t, v = shape
    top = rng.integers(0, v, (t, 2))
    x[np.arange(t), top[:, 0]] = x[np.arange(t), top[:, 1]] = 9.0      # a tie (or one max)
    x[rng.random(shape) < 0.05] = np.nan
    x[rng.random(shape) < 0.02] = -np.inf
    x[0] = np.nan
    if t > 1:
        x[1] = -np.inf
    if t > 2:
        x[2, v // 2] = np.inf
    return np.asarray(jnp.asarray(x, dtype))


def _argmax_ignoring_nan_np(x: np.ndarray) -> np.ndarray:
    return np.argmax(np.where(np.isnan(x), -np.inf, x.astype(np.float32)), axis=1).astype(np.int32)


@settings(max_examples=30)
@given(n=st.sampled_from([1, 127, 128, 129, 300, 1024]), rows=st.integers(1, 4), with_nan=st.booleans(),
       seed=st.integers(0, 2**20))
def test_argmax_ignoring_nan_matches_numpy(n, rows, with_nan, seed):
    """Blocked argmax: ties within and across blocks, the maximum in a short last block, NaN and infinities."""
    from pallas_kernels.sampling_math import argmax_ignoring_nan
    rng = np.random.default_rng(seed)
    x = rng.choice(np.array([-np.inf, -1.0, 0.0, 2.0, 3.0, np.inf], np.float32), (rows, n),
                   p=[0.1, 0.3, 0.3, 0.2, 0.09, 0.01])
    if with_nan:
        x[rng.random((rows, n)) < 0.2] = np.nan
        x[0] = np.nan
    np.testing.assert_array_equal(np.asarray(jax.jit(argmax_ignoring_nan)(jnp.asarray(x))),
                                  _argmax_ignoring_nan_np(x))


@pytest.mark.parametrize("vocab_size,dtype", [(5000, jnp.float32), (700, jnp.bfloat16), (3, jnp.float16)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_argmax_kernel_matches_reference(vocab_size, dtype, num_splits):
    from pallas_kernels.sampling_math import argmax_ignoring_nan
    from pallas_kernels.target_argmax import argmax_splits
    from pallas_kernels.vocab_tiles import plan_splits
    logits = _special_logits(np.random.default_rng(vocab_size), (5, vocab_size), dtype)
    maxima, indices = argmax_splits(jnp.asarray(logits), num_splits=num_splits, interpret=_kernel_interpret())
    assert maxima.shape[1] == plan_splits(5, vocab_size, num_splits).num_splits
    maxima, indices = np.asarray(maxima), np.asarray(indices)
    best = np.zeros(5, np.int32)
    for row in range(5):                                   # the scan's rule: first split among the best
        best[row] = indices[row, np.argmax(maxima[row])]
    expected = _argmax_ignoring_nan_np(logits)
    np.testing.assert_array_equal(best, expected)
    np.testing.assert_array_equal(np.asarray(argmax_ignoring_nan(jnp.asarray(logits))), expected)
    assert expected[0] == 0 and (vocab_size < 3 or expected[2] == vocab_size // 2)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=10)
@given(batch=draft_batches(spec_lens=(1, 4), batch_sizes=(2, 5), vocab_sizes=(12,)),
       vocab_size=st.sampled_from([3, 600]), dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
       seed=st.integers(0, 2**20))
def test_greedy_from_logits_matches_oracle(backend, batch, vocab_size, dtype, seed):
    rng = np.random.default_rng(seed)
    t = len(batch.draft)
    logits = _special_logits(rng, (t, vocab_size), dtype)
    target = _argmax_ignoring_nan_np(logits)
    draft = np.where(rng.random(t) < 0.7, target, rng.integers(0, vocab_size, t)).astype(np.int32)
    case = DraftBatch(batch.cu, draft, target, np.clip(batch.bonus, 0, vocab_size - 1), batch.max_spec_len,
                      vocab_size)
    result = scv_jax.accept_greedy_from_logits(*as_jax(draft, batch.cu, logits, case.bonus),
                                               max_spec_len=batch.max_spec_len, backend=backend)
    assert result.accept_mask.dtype == jnp.bool_
    assert_result_equal(result, greedy_oracle(case))


def test_greedy_from_logits_auto_falls_back_for_other_dtypes():
    from scv_jax.ops import registry
    assert registry.select("accept_greedy_from_logits", "auto", dtypes=(np.dtype(np.float32),)).name == (
        "pallas" if cuda_available() else "xla")
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        registry.select("accept_greedy_from_logits", "interpret", dtypes=(np.dtype(jnp.float8_e4m3fn),))


def _lowered_text(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_greedy_kernel_lowers_for_cuda():
    from pallas_kernels.accept_scan import accept_greedy_kernel
    b, k = 256, 8
    t = b * k
    ints = lambda n: jnp.zeros((n,), jnp.int32)  # noqa: E731
    text = _lowered_text(lambda d, cu, tg, bo: accept_greedy_kernel(d, cu, tg, bo, max_spec_len=k),
                         ints(t), ints(b + 1), ints(t), ints(b))
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("vocab_size,dtype", [(151_936, jnp.float32), (700, jnp.bfloat16)])
def test_greedy_from_logits_kernel_lowers_for_cuda(vocab_size, dtype):
    from pallas_kernels.accept_scan import accept_greedy_from_logits_kernel
    b, k = 32, 8
    t = b * k
    ints = lambda n: jnp.zeros((n,), jnp.int32)  # noqa: E731
    text = _lowered_text(lambda d, cu, lg, bo: accept_greedy_from_logits_kernel(d, cu, lg, bo, max_spec_len=k),
                         ints(t), ints(b + 1), jnp.zeros((t, vocab_size), dtype), ints(b))
    assert text.count("mosaic_gpu") >= 2


@pytest.mark.parametrize("with_draft_probs,dtype", [(True, jnp.float32), (False, jnp.bfloat16)])
def test_rejection_kernels_lower_for_cuda(with_draft_probs, dtype):
    from pallas_kernels.accept_scan import rejection_scan_kernel
    from pallas_kernels.recovered_tokens import recover_rejected_tokens
    t, b, v, k = 64, 16, 151_936, 4

    def step(draft, cu, q, p, bonus, uniforms, seeds):
        tokens, num_accepted, mask = rejection_scan_kernel(draft, cu, q, p, bonus, uniforms, max_spec_len=k)
        return recover_rejected_tokens(tokens, num_accepted, cu, draft, q, p, seeds, max_spec_len=k), mask

    q = jnp.zeros((t, v), dtype) if with_draft_probs else None
    text = _lowered_text(step, jnp.zeros(t, jnp.int32), jnp.zeros(b + 1, jnp.int32), q,
                         jnp.zeros((t, v), dtype), jnp.zeros(b, jnp.int32), jnp.zeros(t, jnp.float32),
                         jnp.zeros(t, jnp.uint32))
    assert text.count("mosaic_gpu") >= 3


def test_accept_mask_is_bool_in_the_kernel():
    """The scan kernel declares a bool[T] output: no int32 mask and no conversion pass after it."""
    from pallas_kernels.accept_scan import accept_greedy_kernel
    ints = lambda n: jnp.zeros((n,), jnp.int32)  # noqa: E731
    jaxpr = jax.make_jaxpr(lambda d, cu, tg, bo: accept_greedy_kernel(d, cu, tg, bo, max_spec_len=2))(
        ints(6), ints(4), ints(6), ints(3))
    assert jaxpr.out_avals[2].dtype == jnp.bool_
    assert not any(e.primitive.name == "convert_element_type" for e in jaxpr.jaxpr.eqns)


def _chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    from math import erfc, sqrt
    n = counts.sum()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    expected = n * probs[keep]
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    dof = int(keep.sum()) - 1
    # Wilson-Hilferty normal approximation of the chi-square tail.
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / sqrt(2 / (9 * dof))
    return 0.5 * erfc(z / sqrt(2))


def _sample_two_drafts(num_requests: int, p_rows, q_rows, seed: int, backend: str = "xla"):
    """num_requests independent requests, each drafting 2 tokens from q; returns emitted tokens."""
    rng = np.random.default_rng(seed)
    drafts = np.stack([rng.choice(len(q_rows[i]), size=num_requests, p=q_rows[i]) for i in range(2)], 1)
    t = 2 * num_requests
    cu = jnp.arange(0, t + 1, 2, dtype=jnp.int32)
    p = jnp.tile(jnp.asarray(p_rows, jnp.float32), (num_requests, 1))
    q = jnp.tile(jnp.asarray(q_rows, jnp.float32), (num_requests, 1))
    bonus = jnp.asarray(rng.integers(0, p_rows.shape[1], num_requests), jnp.int32)
    result = scv_jax.rejection_sample(jnp.asarray(drafts.reshape(-1), jnp.int32), cu, q, p, bonus,
                                      key=keys_for(num_requests, seed), max_spec_len=2, backend=backend)
    return np.asarray(result.output_token_ids), drafts


@pytest.mark.parametrize("num_samples", [4_000, 40_000])
def test_sampling_is_lossless(num_samples):
    """The first emitted token follows p_0 and, given the first draft was accepted, the second p_1."""
    rng = np.random.default_rng(7)
    vocab = 10
    p_rows = rng.dirichlet(np.ones(vocab), 2)
    p_rows[0, 3] = 0.0                              # a token the target never emits
    p_rows /= p_rows.sum(1, keepdims=True)
    q_rows = rng.dirichlet(np.ones(vocab), 2)       # a draft distribution far from the target
    tokens, drafts = _sample_two_drafts(num_samples, p_rows, q_rows, seed=num_samples)
    first = np.bincount(tokens[:, 0], minlength=vocab)
    assert _chi_square_p_value(first, p_rows[0]) > 1e-4
    # Not the draft's distribution: the test has the power to tell them apart.
    assert _chi_square_p_value(first, q_rows[0]) < 1e-6
    accepted_first = tokens[:, 0] == drafts[:, 0]
    second = np.bincount(tokens[accepted_first, 1], minlength=vocab)
    assert _chi_square_p_value(second, p_rows[1]) > 1e-4


def test_sampling_lossless_without_draft_probs():
    """An n-gram style draft (no distribution) still yields the target distribution."""
    rng = np.random.default_rng(3)
    vocab, n = 8, 20_000
    p = rng.dirichlet(np.ones(vocab))
    drafts = jnp.asarray(rng.integers(0, vocab, n), jnp.int32)
    result = scv_jax.rejection_sample(drafts, jnp.arange(n + 1, dtype=jnp.int32), None,
                                      jnp.tile(jnp.asarray(p, jnp.float32), (n, 1)), jnp.zeros(n, jnp.int32),
                                      key=jax.random.key(1), max_spec_len=1, backend="xla")
    first = np.bincount(np.asarray(result.output_token_ids)[:, 0], minlength=vocab)
    assert _chi_square_p_value(first, p) > 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
def test_same_keys_same_output_and_batch_invariance(backend):
    rng = np.random.default_rng(0)
    b, k, v = 5, 3, 9
    counts = np.array([3, 0, 2, 3, 1])
    cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    t = int(cu[-1])
    draft = rng.integers(0, v, t).astype(np.int32)
    p, q = random_probs(rng, (t, v), "dirichlet"), random_probs(rng, (t, v), "dirichlet")
    bonus = rng.integers(0, v, b).astype(np.int32)
    keys = keys_for(b, 11)

    def run(sel):
        slots = np.concatenate([np.arange(cu[r], cu[r + 1]) for r in sel]).astype(np.int32)
        sub_cu = np.concatenate([[0], np.cumsum(counts[sel])]).astype(np.int32)
        return scv_jax.rejection_sample(jnp.asarray(draft[slots]), jnp.asarray(sub_cu), jnp.asarray(q[slots]),
                                        jnp.asarray(p[slots]), jnp.asarray(bonus[sel]), key=keys[np.array(sel)],
                                        max_spec_len=k, backend=backend)

    full = run(list(range(b)))
    again = run(list(range(b)))
    np.testing.assert_array_equal(np.asarray(full.output_token_ids), np.asarray(again.output_token_ids))
    for r in range(b):
        alone = run([r])
        np.testing.assert_array_equal(np.asarray(alone.output_token_ids)[0], np.asarray(full.output_token_ids)[r])


def test_legacy_uint32_keys_are_accepted():
    batch_args = (jnp.array([1, 2], jnp.int32), jnp.array([0, 1, 2], jnp.int32), None,
                  jnp.full((2, 4), 0.25, jnp.float32), jnp.array([0, 1], jnp.int32))
    typed = scv_jax.rejection_sample(*batch_args, key=jax.random.key(5), max_spec_len=1, backend="xla")
    legacy = scv_jax.rejection_sample(*batch_args, key=jax.random.PRNGKey(5), max_spec_len=1, backend="xla")
    np.testing.assert_array_equal(np.asarray(typed.output_token_ids), np.asarray(legacy.output_token_ids))
    per_request = scv_jax.rejection_sample(*batch_args, key=jax.random.split(jax.random.PRNGKey(5), 2),
                                           max_spec_len=1, backend="xla")
    assert per_request.output_token_ids.shape == (2, 2)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=15)
@given(data=st.data())
def test_adversarial_inputs_stay_in_range(backend, data):
    """Malformed offsets, out-of-vocabulary drafts and degenerate probabilities: ids stay in [-1, V)."""
    t, b, k, v = data.draw(st.sampled_from([(10, 4, 4, 9), (4, 1, 1, 1), (7, 3, 2, 5)]))
    cu = np.array(data.draw(st.lists(st.integers(-3, t + 3), min_size=b + 1, max_size=b + 1)), np.int32)
    draft = np.array(data.draw(st.lists(st.integers(-5, v + 5), min_size=t, max_size=t)), np.int32)
    bonus = np.array(data.draw(st.lists(st.integers(-5, v + 5), min_size=b, max_size=b)), np.int32)
    kind = data.draw(st.sampled_from(["zeros", "equal", "onehot"]))
    rng = np.random.default_rng(data.draw(st.integers(0, 1000)))
    p = random_probs(rng, (t, v), "onehot" if kind == "onehot" else "dirichlet")
    q = {"zeros": np.zeros((t, v), np.float32), "equal": p, "onehot": random_probs(rng, (t, v), "onehot")}[kind]
    result = scv_jax.rejection_sample(*as_jax(draft, cu, q, p, bonus), key=jax.random.key(0), max_spec_len=k,
                                      backend=backend)
    tokens = np.asarray(result.output_token_ids)
    assert tokens.shape == (b, k + 1)
    assert np.all((tokens >= -1) & (tokens < v))
    assert np.all((np.asarray(result.num_accepted) >= 0) & (np.asarray(result.num_accepted) <= k))
    greedy = scv_jax.accept_greedy(*as_jax(draft, cu, draft, bonus), max_spec_len=k, backend=backend)
    assert np.all(np.asarray(greedy.num_accepted) <= k)


def test_nan_probabilities_never_win_and_backends_agree():
    """NaN in p or q: a NaN race score never wins (a row of NaN resamples token 0), on every backend."""
    rng = np.random.default_rng(5)
    t, v, k = 12, 600, 3
    cu = np.array([0, 3, 6, 9, 12], np.int32)
    p, q = random_probs(rng, (t, v), "dirichlet"), random_probs(rng, (t, v), "dirichlet")
    p[rng.random((t, v)) < 0.3] = np.nan
    q[rng.random((t, v)) < 0.3] = np.nan
    p[3:6] = np.nan                                       # request 1: every score NaN
    draft = rng.integers(0, v, t).astype(np.int32)
    outs = [scv_jax.rejection_sample(*as_jax(draft, cu, q, p, np.zeros(4, np.int32)), key=jax.random.key(1),
                                     max_spec_len=k, backend=backend) for backend in BACKENDS]
    for out in outs[1:]:
        assert_result_equal(out, (np.asarray(outs[0].output_token_ids), np.asarray(outs[0].num_accepted),
                                  np.asarray(outs[0].accept_mask)))
    tokens, num_accepted = np.asarray(outs[0].output_token_ids), np.asarray(outs[0].num_accepted)
    assert tokens[1, 0] == 0 and num_accepted[1] == 0     # NaN p(x): rejected; all-NaN row: token 0
    for r in range(4):
        if num_accepted[r] < k:
            slot, token = cu[r] + num_accepted[r], tokens[r, num_accepted[r]]
            assert 0 <= token < v and (r == 1 or not np.isnan(p[slot, token] - q[slot, token]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batches(backend):
    empty = scv_jax.accept_greedy(jnp.zeros(0, jnp.int32), jnp.zeros(1, jnp.int32), jnp.zeros(0, jnp.int32),
                                  jnp.zeros(0, jnp.int32), max_spec_len=3, backend=backend)
    assert empty.output_token_ids.shape == (0, 4) and empty.accept_mask.shape == (0,)
    no_drafts = scv_jax.rejection_sample(jnp.zeros(0, jnp.int32), jnp.zeros(3, jnp.int32), None,
                                         jnp.zeros((0, 5), jnp.float32), jnp.array([4, 2], jnp.int32),
                                         key=jax.random.key(0), max_spec_len=2, backend=backend)
    np.testing.assert_array_equal(np.asarray(no_drafts.output_token_ids), [[4, -1, -1], [2, -1, -1]])


def test_works_under_jit():
    batch_args = as_jax(np.array([1, 2, 3], np.int32), np.array([0, 2, 3], np.int32),
                        np.array([1, 5, 3], np.int32), np.array([7, 8], np.int32))
    jitted = jax.jit(lambda *a: scv_jax.accept_greedy(*a, max_spec_len=2, backend="interpret"))
    np.testing.assert_array_equal(np.asarray(jitted(*batch_args).output_token_ids), [[1, 5, -1], [3, 8, -1]])


@pytest.mark.parametrize("call,match", [
    (lambda: scv_jax.accept_greedy(jnp.zeros((2, 2), jnp.int32), jnp.zeros(2, jnp.int32), jnp.zeros(4, jnp.int32),
                                   jnp.zeros(1, jnp.int32), max_spec_len=2), "draft_token_ids must be int32\\[T\\]"),
    (lambda: scv_jax.accept_greedy(jnp.zeros(4, jnp.float32), jnp.zeros(2, jnp.int32), jnp.zeros(4, jnp.int32),
                                   jnp.zeros(1, jnp.int32), max_spec_len=2), "draft_token_ids must be an integer"),
    (lambda: scv_jax.accept_greedy(jnp.zeros(4, jnp.int32), jnp.zeros(2, jnp.int32), jnp.zeros(3, jnp.int32),
                                   jnp.zeros(1, jnp.int32), max_spec_len=2), "target_token_ids"),
    (lambda: scv_jax.accept_greedy(jnp.zeros(4, jnp.int32), jnp.zeros(3, jnp.int32), jnp.zeros(4, jnp.int32),
                                   jnp.zeros(1, jnp.int32), max_spec_len=2), "bonus_token_ids"),
    (lambda: scv_jax.accept_greedy(jnp.zeros(4, jnp.int32), jnp.zeros(2, jnp.int32), jnp.zeros(4, jnp.int32),
                                   jnp.zeros(1, jnp.int32), max_spec_len=-1), "max_spec_len"),
    (lambda: scv_jax.accept_greedy(jnp.zeros(4, jnp.int32), jnp.zeros(2, jnp.int32), jnp.zeros(4, jnp.int32),
                                   jnp.zeros(1, jnp.int32), max_spec_len=2, backend="cuda"), "backend"),
    (lambda: scv_jax.rejection_sample(jnp.zeros(4, jnp.int32), jnp.zeros(2, jnp.int32), None,
                                      jnp.zeros((4, 8)), jnp.zeros(1, jnp.int32), key=None, max_spec_len=2), "key"),
    (lambda: scv_jax.rejection_sample(jnp.zeros(4, jnp.int32), jnp.zeros(2, jnp.int32), jnp.zeros((4, 7)),
                                      jnp.zeros((4, 8)), jnp.zeros(1, jnp.int32), key=jax.random.key(0),
                                      max_spec_len=2), "draft_probs"),
    (lambda: scv_jax.rejection_sample(jnp.zeros(4, jnp.int32), jnp.zeros(2, jnp.int32), None,
                                      jnp.zeros((3, 8)), jnp.zeros(1, jnp.int32), key=jax.random.key(0),
                                      max_spec_len=2), "target_probs"),
    (lambda: scv_jax.rejection_sample(jnp.zeros(4, jnp.int32), jnp.zeros(2, jnp.int32), None,
                                      jnp.zeros((4, 8), jnp.int32), jnp.zeros(1, jnp.int32), key=jax.random.key(0),
                                      max_spec_len=2), "target_probs must be a floating"),
    (lambda: scv_jax.rejection_sample(jnp.zeros(4, jnp.int32), jnp.zeros(3, jnp.int32), None,
                                      jnp.zeros((4, 8)), jnp.zeros(2, jnp.int32),
                                      key=jax.random.split(jax.random.key(0), 3), max_spec_len=2), "one key or 2 keys"),
    (lambda: scv_jax.accept_greedy_from_logits(jnp.zeros(4, jnp.int32), jnp.zeros(2, jnp.int32), jnp.zeros((4,)),
                                               jnp.zeros(1, jnp.int32), max_spec_len=2), "target_logits must be float"),
    (lambda: scv_jax.accept_greedy_from_logits(jnp.zeros(4, jnp.int32), jnp.zeros(2, jnp.int32),
                                               jnp.zeros((3, 8)), jnp.zeros(1, jnp.int32), max_spec_len=2),
     "target_logits must be float\\[T, V\\] with T=4"),
    (lambda: scv_jax.accept_greedy_from_logits(jnp.zeros(4, jnp.int32), jnp.zeros(2, jnp.int32),
                                               jnp.zeros((4, 8), jnp.int32), jnp.zeros(1, jnp.int32), max_spec_len=2),
     "target_logits must be a floating"),
    pytest.param(lambda: scv_jax.accept_greedy(jnp.zeros(4, jnp.int32), jnp.zeros(2, jnp.int32),
                                               jnp.zeros(4, jnp.int32), jnp.zeros(1, jnp.int32), max_spec_len=2,
                                               backend="pallas"), "needs a CUDA GPU",
                 marks=pytest.mark.skipif(cuda_available(), reason="checks the error raised without a GPU")),
])
def test_static_errors_name_the_argument(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


@pytest.mark.parametrize("cu,kwargs,match", [
    ([1, 2], {}, "cu_num_draft_tokens\\[0\\] must be 0"),
    ([0, 3, 2], {}, "non-decreasing"),
    ([0, 5], {}, "more than max_spec_len"),
    ([0, 2, 4], {"num_slots": 3}, "exceeds the number of draft slots"),
    ([0, 2], {"draft_token_ids": [0, 9], "vocab_size": 9}, "draft_token_ids\\[1\\]=9"),
])
def test_check_draft_batch(cu, kwargs, match):
    with pytest.raises(ValueError, match=match):
        scv_jax.check_draft_batch(np.array(cu), max_spec_len=4, **kwargs)
    scv_jax.check_draft_batch(np.array([0, 2, 2, 6]), max_spec_len=4, num_slots=8,
                              draft_token_ids=np.arange(8), vocab_size=8)
