"""commit_draft_kv / gather_kv / slot helpers: every backend against a numpy + ml_dtypes reference."""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import scv_jax
from scv_jax.ops.registry import cuda_available
from scv_jax.ops import registry
import scv_jax.ops.commit.api  # noqa: F401,E402 - registers the op's implementations for registry.implementation

# fp16 inputs of 1e4 * 30 overflow to inf (saturation is tested), and inf / inf scales are NaN.
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]

FP8 = ("float8_e4m3fn", "float8_e5m2")
CACHE_DTYPES = ("float32", "float16", "bfloat16") + FP8
INPUT_DTYPES = ("float32", "float16", "bfloat16")
NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
             "float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}


@dataclasses.dataclass
class Case:
    layout: str
    key_dtype: str
    value_dtype: str
    cache_dtype: str
    scale_mode: str | None
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    num_tokens: int
    seed: int = 0
    magnitude: float = 10.0


def _np_quantize(x: np.ndarray, cache_dtype: str, scale) -> np.ndarray:
    """float32 -> cache dtype, independently of scv_jax: divide, saturate (fp8), round to nearest even."""
    y = x if scale is None else (x / np.asarray(scale, np.float32)).astype(np.float32)
    if cache_dtype in FP8:
        limit = np.float32(ml_dtypes.finfo(NP_DTYPES[cache_dtype]).max)
        y = np.clip(y, -limit, limit)
    return y.astype(NP_DTYPES[cache_dtype])


def numpy_commit(case: Case, pages: dict, scales: dict, new: dict, slots: np.ndarray, mask) -> tuple:
    """Returns updated copies of ``pages`` and ``scales`` ({"k": ..., "v": ...})."""
    pages = {n: p.copy() for n, p in pages.items()}
    scales = {n: None if s is None else np.array(s, np.float32) for n, s in scales.items()}
    fp8_max = {d: np.float32(ml_dtypes.finfo(NP_DTYPES[d]).max) for d in FP8}
    for t, slot in enumerate(slots):
        if slot < 0 or slot >= case.num_blocks * case.block_size or (mask is not None and not mask[t]):
            continue
        block, offset = divmod(int(slot), case.block_size)
        for n in ("k", "v"):
            x = new[n][:, t].astype(np.float32)                        # [L, H, D]
            scale = scales[n]
            if case.scale_mode == "head":
                scale = scale[:, None]
            elif case.scale_mode == "token_head":      # the finite absmax defines the scale
                finite_absmax = np.where(np.isfinite(x), np.abs(x), 0).max(-1)
                token_scale = np.maximum(finite_absmax * np.float32(1 / fp8_max[case.cache_dtype]),
                                         np.float32(np.finfo(np.float32).tiny))
                scales[n][:, block, offset] = token_scale
                scale = token_scale[..., None]
            q = _np_quantize(x, case.cache_dtype, scale)
            if case.layout == "NHD":
                pages[n][:, block, offset] = q
            else:
                pages[n][:, block, :, offset] = q
    return pages, scales


def _random_bits(rng, shape, dtype) -> np.ndarray:
    """Arbitrary bytes (NaNs and infinities included): untouched slots must keep them exactly."""
    dtype = np.dtype(NP_DTYPES[dtype])
    return rng.integers(0, 256, (*shape, dtype.itemsize), np.uint8).view(dtype).reshape(shape)


def make_inputs(case: Case, skip_rate: float = 0.3):
    """A cache with random pages and scales, random new K/V, and slots with skips, OOB and a mask."""
    rng = np.random.default_rng(case.seed)
    cache = scv_jax.PagedKVCache.create(case.num_layers, case.num_blocks, case.block_size, case.num_kv_heads,
                                        case.head_dim, dtype=case.cache_dtype, layout=case.layout,
                                        scale_mode=case.scale_mode)
    shape = cache.k_pages.shape
    pages = {n: _random_bits(rng, shape, case.cache_dtype) for n in ("k", "v")}
    scales = {n: None for n in ("k", "v")}
    if case.scale_mode is not None:
        scales = {n: rng.uniform(0.01, 4.0, np.shape(cache.k_scale)).astype(np.float32) for n in ("k", "v")}
    cache = cache.replace(k_pages=jnp.asarray(pages["k"]), v_pages=jnp.asarray(pages["v"]),
                          k_scale=None if scales["k"] is None else jnp.asarray(scales["k"]),
                          v_scale=None if scales["v"] is None else jnp.asarray(scales["v"]))
    tokens = (case.num_layers, case.num_tokens, case.num_kv_heads, case.head_dim)
    new = {n: (rng.standard_normal(tokens, np.float32) * case.magnitude
               * rng.choice([0.01, 1.0, 30.0], size=tokens[:3] + (1,))).astype(NP_DTYPES[dt])
           for n, dt in (("k", case.key_dtype), ("v", case.value_dtype))}
    num_slots = case.num_blocks * case.block_size
    slots = rng.permutation(num_slots)[:case.num_tokens]
    slots = np.pad(slots, (0, case.num_tokens - len(slots)), constant_values=-1)
    special = rng.random(case.num_tokens)
    slots = np.where(special < skip_rate / 2, -1 - rng.integers(0, 5, case.num_tokens), slots)
    slots = np.where(special > 1 - skip_rate / 4, num_slots + rng.integers(0, 3, case.num_tokens), slots)
    mask = rng.random(case.num_tokens) > skip_rate / 2 if rng.random() < 0.7 else None
    return cache, pages, scales, new, slots.astype(np.int32), mask


def _same_bits(got, expected) -> bool:
    got, expected = np.asarray(got), np.asarray(expected)
    return got.shape == expected.shape and np.array_equal(got.reshape(-1).view(np.uint8),
                                                          expected.reshape(-1).view(np.uint8))


def check_case(case: Case, backend: str) -> None:
    cache, pages, scales, new, slots, mask = make_inputs(case)
    out = scv_jax.commit_draft_kv(cache, jnp.asarray(new["k"]), jnp.asarray(new["v"]), jnp.asarray(slots),
                                  None if mask is None else jnp.asarray(mask), backend=backend)
    want_pages, want_scales = numpy_commit(case, pages, scales, new, slots, mask)
    assert out.layout == case.layout and out.scale_mode == case.scale_mode
    assert out.k_pages.dtype == np.dtype(NP_DTYPES[case.cache_dtype])
    for n in ("k", "v"):
        assert _same_bits(getattr(out, f"{n}_pages"), want_pages[n]), f"{n}_pages differ ({case})"
        if case.scale_mode is not None:
            assert _same_bits(getattr(out, f"{n}_scale"), want_scales[n]), f"{n}_scale differs ({case})"


def kernel_supports(case: Case) -> bool:
    from pallas_kernels.commit_kv import unsupported_reason
    sizes = tuple(np.dtype(NP_DTYPES[d]).itemsize for d in (case.key_dtype, case.value_dtype, case.cache_dtype))
    return not unsupported_reason(case.num_kv_heads, case.head_dim, sizes)


HEAD_DIMS = (64, 80, 96, 112, 128, 256)     # the head sizes of real models
KV_HEADS = (1, 2, 4, 8)


@st.composite
def cases(draw, max_tokens: int = 9, head_dims=HEAD_DIMS, kv_heads=(1, 2, 3, 4, 8)) -> Case:
    cache_dtype = draw(st.sampled_from(CACHE_DTYPES))
    head_dim = draw(st.sampled_from(head_dims))
    heads = draw(st.sampled_from(kv_heads))
    return Case(
        layout=draw(st.sampled_from(["NHD", "HND"])),
        key_dtype=draw(st.sampled_from(INPUT_DTYPES)), value_dtype=draw(st.sampled_from(INPUT_DTYPES)),
        cache_dtype=cache_dtype,
        scale_mode=draw(st.sampled_from([None, "tensor", "head", "token_head"])) if cache_dtype in FP8 else None,
        num_layers=draw(st.integers(1, 3)), num_blocks=draw(st.integers(1, 3)),
        block_size=draw(st.sampled_from([8, 16, 32])), num_kv_heads=heads, head_dim=head_dim,
        num_tokens=draw(st.integers(0, max_tokens)), seed=draw(st.integers(0, 2**32 - 1)),
        magnitude=draw(st.sampled_from([0.01, 1.0, 10.0, 1e4])))


@settings(max_examples=12)   # each example compiles new shapes (~1 s on CI's 2 cores)
@given(case=cases())
def test_xla_matches_numpy(case):
    check_case(case, "xla")


@settings(max_examples=8)
@given(case=cases(max_tokens=5, kv_heads=KV_HEADS))
def test_interpret_matches_numpy_random(case):
    """Every head size of real models with 1-8 kv heads runs in the kernel ("strided" or "tiled")."""
    assert kernel_supports(case)
    check_case(case, "interpret")


# Hand-picked kernel cases: every cache dtype, input dtype, scale mode, layout, block size and head_dim,
# incl. head_dim 80 (1-element accesses), one head, mixed K/V input dtypes, odd T, and the "tiled"
# layout (kv_heads * head_dim not a multiple of 128: 1 x 64, 2 x 80, 3 x 112, 1 x 96).
KERNEL_CASES = [
    Case("NHD", "float32", "bfloat16", "bfloat16", None, 2, 2, 8, 1, 64, 5),
    Case("HND", "bfloat16", "float32", "float8_e4m3fn", "token_head", 2, 2, 16, 2, 80, 4, magnitude=1e4),
    Case("NHD", "float16", "float16", "float8_e5m2", "head", 1, 2, 8, 3, 112, 3),
    Case("HND", "float32", "float32", "float8_e4m3fn", "tensor", 1, 2, 8, 1, 96, 3),
    Case("NHD", "bfloat16", "bfloat16", "bfloat16", None, 2, 3, 16, 2, 64, 5),
    Case("HND", "float32", "float32", "float16", None, 2, 2, 8, 8, 80, 7),
    Case("NHD", "float16", "bfloat16", "float32", None, 1, 2, 32, 1, 256, 3),
    Case("HND", "bfloat16", "bfloat16", "float8_e4m3fn", "tensor", 2, 2, 16, 1, 128, 9, magnitude=1e4),
    Case("NHD", "float32", "float16", "float8_e5m2", "head", 3, 2, 8, 4, 64, 5),
    Case("HND", "bfloat16", "float16", "float8_e4m3fn", "token_head", 2, 2, 32, 2, 128, 3),
    Case("NHD", "float16", "float16", "float8_e5m2", "token_head", 1, 3, 8, 8, 80, 1),
    Case("NHD", "bfloat16", "float32", "float8_e4m3fn", None, 2, 1, 16, 2, 256, 5, magnitude=1e4),
]


@pytest.mark.parametrize("backend", ["xla", "interpret"])
@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: f"{c.layout}-{c.cache_dtype}-{c.scale_mode}-"
                         f"h{c.num_kv_heads}d{c.head_dim}b{c.block_size}")
def test_kernel_cases(case, backend):
    check_case(case, backend)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_skipped_tokens_leave_the_cache_untouched(backend):
    case = Case("HND", "bfloat16", "bfloat16", "float8_e4m3fn", "token_head", 2, 2, 8, 2, 64, 6)
    cache, pages, scales, new, _, _ = make_inputs(case)
    slots = jnp.array([-1, 3, -7, 5, 2**31 - 1, 16], jnp.int32)     # 16 = num_slots: out of range
    mask = jnp.array([True, False, True, False, True, True])
    out = scv_jax.commit_draft_kv(cache, new["k"], new["v"], slots, mask, backend=backend)
    for before, after in zip(jax.tree.leaves(cache), jax.tree.leaves(out)):
        assert _same_bits(after, before)
    written = scv_jax.commit_draft_kv(cache, new["k"], new["v"], slots, ~mask, backend=backend)
    changed = np.flatnonzero(np.any(np.asarray(written.k_scale != cache.k_scale), axis=(0, 3)).reshape(-1))
    assert changed.tolist() == [3, 5]                                # only the accepted in-range slots


def _fp8_midpoints(dtype) -> np.ndarray:
    """Positive values halfway between neighbouring finite fp8 values (exact in float32)."""
    values = np.arange(256, dtype=np.uint8).view(NP_DTYPES[dtype]).astype(np.float32)
    values = np.unique(values[np.isfinite(values) & (values >= 0)])
    return (values[:-1] + values[1:]) / 2


@pytest.mark.parametrize("backend", ["xla", "interpret"])
@pytest.mark.parametrize("mode, heads, head_dim", [("head", 8, 128), ("tensor", 8, 128), ("token_head", 8, 128),
                                                   ("head", 2, 80), ("token_head", 3, 112)])
def test_stored_values_are_true_divisions(backend, mode, heads, head_dim):
    """fp8 values equal round(x / scale) with an IEEE float32 division, as vLLM stores them. Inputs sit
    at scale * (fp8 rounding midpoints), where a multiplication by the reciprocal (one float32 ulp off
    for ~20% of values) rounds to the other fp8 neighbour."""
    rng = np.random.default_rng(heads * head_dim)
    layers, tokens, dtype = 2, 16, "float8_e4m3fn"
    midpoints = _fp8_midpoints(dtype)
    m = rng.choice(midpoints[midpoints < 440], (layers, tokens, heads, head_dim)) * rng.choice([-1, 1], (1, 1, 1, head_dim))
    m = m.astype(np.float32)
    if mode == "token_head":         # one element of each vector sets the scale; the others sit at midpoints
        absmax = rng.uniform(0.5, 50, (layers, tokens, heads)).astype(np.float32)
        scale = np.maximum(absmax * np.float32(1 / 448), np.float32(np.finfo(np.float32).tiny))[..., None]
        x = (m * scale).astype(np.float32)
        x[..., 0] = absmax
        cache_scale = None
    else:
        shape = (heads,) if mode == "head" else ()
        cache_scale = rng.uniform(0.01, 4, shape).astype(np.float32)
        scale = cache_scale[:, None] if mode == "head" else cache_scale
        x = (m * scale).astype(np.float32)
    cache = scv_jax.PagedKVCache.create(layers, 1, tokens, heads, head_dim, dtype=dtype, scale_mode=mode,
                                        k_scale=cache_scale, v_scale=cache_scale)
    out = scv_jax.commit_draft_kv(cache, jnp.asarray(x), jnp.asarray(x), jnp.arange(tokens, dtype=jnp.int32),
                                  backend=backend)
    expected = _np_quantize(x, dtype, scale)                        # numpy: x / scale in float32
    got = np.asarray(out.k_pages)[:, 0]
    assert _same_bits(got, expected), f"{np.mean(got.view(np.uint8) != expected.view(np.uint8)):.1%} differ"


@pytest.mark.parametrize("mode", ["head", "tensor"])
def test_kernel_divides_by_the_scale(mode):
    """The lowered kernel divides (``arith.divf``, which NVPTX emits as IEEE ``div.rn.f32``) and has no
    multiplication that a reciprocal rewrite would leave behind."""
    text = _lowered_text(Case("NHD", "float32", "float32", "float8_e4m3fn", mode, 2, 4, 16, 8, 128, 5))
    assert "arith.divf" in text and "arith.mulf" not in text


def _token_head_commit(backend: str, x: np.ndarray, cache_dtype: str = "float8_e4m3fn"):
    """Commits x [1, T, H, D] float32 at slots 0..T-1 of a token_head cache; returns the read-back
    values [T, H, D] and scales [T, H]."""
    _, t, h, d = x.shape
    cache = scv_jax.PagedKVCache.create(1, 1, t, h, d, dtype=cache_dtype, scale_mode="token_head")
    out = scv_jax.commit_draft_kv(cache, jnp.asarray(x), jnp.asarray(x), jnp.arange(t, dtype=jnp.int32),
                                  backend=backend)
    keys, _ = scv_jax.gather_kv(out, jnp.arange(t))
    return np.asarray(keys)[0], np.asarray(out.k_scale)[0, 0]


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_token_head_scales_ignore_non_finite_elements(backend):
    """A NaN stays in its own element, +-inf saturates to +-(finite absmax), and neither changes the
    scale of its (token, head) vector; an outlier only squeezes its own vector."""
    rng = np.random.default_rng(4)
    t, h, d = 5, 2, 64
    clean = rng.standard_normal((1, t, h, d)).astype(np.float32)
    x = clean.copy()
    x[0, 0, 0, 5] = np.nan                                 # token 0, head 0: one NaN
    x[0, 1, 0, 7], x[0, 1, 1, 3] = np.inf, -np.inf          # token 1: +inf in head 0, -inf in head 1
    x[0, 2, 0, 9] = 1e6                                    # token 2, head 0: a huge finite outlier
    x[0, 3, 1] = np.nan                                    # token 3, head 1: nothing finite
    got, scales = _token_head_commit(backend, x)
    reference, reference_scales = _token_head_commit(backend, np.where(np.isfinite(x), x, 0).astype(np.float32))
    finite = np.isfinite(x[0])
    np.testing.assert_array_equal(got[finite & (x[0] != 1e6)], reference[finite & (x[0] != 1e6)])
    np.testing.assert_array_equal(scales, reference_scales)          # non-finite elements never set a scale
    assert np.isnan(got[0, 0, 5]) and np.isnan(got[3, 1]).all() and not np.isnan(got[finite]).any()
    absmax = np.abs(clean[0, 1]).max(-1)
    np.testing.assert_allclose([got[1, 0, 7], got[1, 1, 3]], [absmax[0], -absmax[1]], rtol=1e-6)
    # The outlier is exact to fp8 precision and defines its vector's scale; elements below half the
    # smallest fp8 subnormal times that scale (1e6 / 448 * 2^-10 ~ 2.2) read back as 0; other heads
    # and tokens keep their own scales.
    scale = np.float32(1e6) * np.float32(1 / 448)
    assert scales[2, 0] == scale and abs(got[2, 0, 9] - 1e6) <= 1e6 * 2**-4
    bound = np.maximum(2**-4 * np.abs(x[0, 2, 0]), scale * 2**-10)
    assert np.all(np.abs(got[2, 0] - x[0, 2, 0]) <= bound)
    assert np.all(got[2, 0][np.abs(x[0, 2, 0]) < scale * 2**-10] == 0)
    np.testing.assert_array_equal(got[2, 1], reference[2, 1])


def test_auto_backend_and_kernel_fallback():
    case = Case("NHD", "float32", "float32", "float8_e4m3fn", None, 1, 2, 8, 1, 6, 3)   # 6 bytes a row
    assert not kernel_supports(case)
    check_case(case, "auto")
    cache, _, _, new, slots, _ = make_inputs(case)
    with pytest.raises(ValueError, match="head_dim = 6 must be a multiple of 4"):
        scv_jax.commit_draft_kv(cache, new["k"], new["v"], slots, backend="interpret")
    with pytest.raises(ValueError, match="does not support these inputs"):
        scv_jax.commit_draft_kv(cache, new["k"], new["v"], slots, backend="pallas")


@pytest.mark.skipif(cuda_available(), reason="checks the error raised without a GPU")
def test_pallas_backend_needs_a_gpu():
    case = KERNEL_CASES[0]
    cache, _, _, new, slots, _ = make_inputs(case)
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        scv_jax.commit_draft_kv(cache, new["k"], new["v"], slots, backend="pallas")


def test_gather_kv_dequantizes():
    case = Case("HND", "float32", "float32", "float8_e4m3fn", "head", 2, 2, 8, 2, 64, 4)
    cache, _, _, new, _, _ = make_inputs(case)
    slots = jnp.array([9, 0, 15, 4])
    out = scv_jax.commit_draft_kv(cache, new["k"], new["v"], slots)
    keys, values = scv_jax.gather_kv(out, jnp.array([0, 9, -1, 99]))
    assert keys.shape == values.shape == (2, 4, 2, 64) and keys.dtype == jnp.float32
    for got, name, token in ((values[:, 1], "v", 0), (keys[:, 0], "k", 1)):
        scale = np.asarray(getattr(out, f"{name}_scale"))[:, None]
        expected = _np_quantize(new[name][:, token], "float8_e4m3fn", scale).astype(np.float32) * scale
        np.testing.assert_array_equal(got, expected)
    assert not np.any(np.asarray(keys[:, 2:]))                        # invalid slots read as zeros


def test_gather_kv_token_head_roundtrip():
    case = Case("NHD", "bfloat16", "bfloat16", "float8_e5m2", "token_head", 1, 2, 16, 4, 64, 3)
    cache, _, _, new, _, _ = make_inputs(case)
    out = scv_jax.commit_draft_kv(cache, new["k"], new["v"], jnp.array([5, 20, 31]))
    keys, _ = scv_jax.gather_kv(out, jnp.array([5, 20, 31]))
    x = new["k"].astype(np.float32)
    error_bound = 0.125 * np.abs(x) + 1e-4 * np.abs(x).max(-1, keepdims=True)   # e5m2: 2 mantissa bits
    assert np.all(np.abs(np.asarray(keys) - x) <= error_bound)


def _donated_commit(backend):
    return jax.jit(functools.partial(scv_jax.commit_draft_kv, backend=backend), donate_argnums=0)


@pytest.mark.parametrize("backend, dtype, mode", [
    ("xla", "bfloat16", None), ("xla", "float32", None), ("xla", "fp8", "token_head"),
    ("interpret", "bfloat16", None), ("interpret", "fp8", "token_head")])
def test_donated_commit_is_in_place(backend, dtype, mode):
    cache = scv_jax.PagedKVCache.create(2, 64, 16, 2, 64, dtype=dtype, layout="HND", scale_mode=mode)
    new = jnp.ones((2, 5, 2, 64), jnp.bfloat16)
    slots = jnp.array([0, 17, -1, 40, 1000], jnp.int32)
    compiled = _donated_commit(backend).lower(cache, new, new, slots, None).compile()
    stats = compiled.memory_analysis()
    cache_bytes = sum(x.nbytes for x in jax.tree.leaves(cache))
    assert stats.alias_size_in_bytes >= cache_bytes
    if not (backend == "xla" and dtype == "fp8"):   # XLA:CPU copies fp8 pages once (see scatter_tokens)
        assert stats.temp_size_in_bytes < cache.k_pages.nbytes // 4
    out = compiled(cache, new, new, slots, None)
    assert cache.k_pages.is_deleted()
    keys, _ = scv_jax.gather_kv(out, jnp.array([17, 1]))
    assert np.all(np.asarray(keys[:, 0]) == 1) and not np.any(np.asarray(keys[:, 1]))


gpu_only = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")


@gpu_only
@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: f"{c.layout}-{c.cache_dtype}-{c.scale_mode}")
def test_pallas_matches_numpy_on_gpu(case):
    check_case(case, "pallas")


@gpu_only
@pytest.mark.parametrize("dtype, mode", [("bfloat16", None), ("fp8", "token_head"), ("fp8_e5m2", "head")])
def test_pallas_donated_commit_is_in_place_on_gpu(dtype, mode):
    cache = scv_jax.PagedKVCache.create(4, 256, 16, 8, 128, dtype=dtype, scale_mode=mode)
    new = jnp.ones((4, 7, 8, 128), jnp.bfloat16)
    slots = jnp.array([0, 17, -1, 40, 1000, 4095, 4096], jnp.int32)
    stats = _donated_commit("pallas").lower(cache, new, new, slots, None).compile().memory_analysis()
    assert stats.alias_size_in_bytes >= sum(x.nbytes for x in jax.tree.leaves(cache))
    assert stats.temp_size_in_bytes < cache.k_pages.nbytes // 4


def _lowered_text(case: Case) -> str:
    cache, _, _, new, slots, mask = make_inputs(case)
    kernel = registry.implementation("commit_draft_kv", "pallas")
    fn = functools.partial(kernel.run, interpret=False)
    args = (cache, jnp.asarray(new["k"]), jnp.asarray(new["v"]),
            jnp.where(mask, slots, -1) if mask is not None else jnp.asarray(slots))
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("case", [
    Case("NHD", "bfloat16", "bfloat16", "bfloat16", None, 32, 4, 16, 8, 128, 16),
    Case("HND", "float32", "bfloat16", "float8_e4m3fn", "tensor", 2, 4, 16, 8, 128, 5),
    Case("NHD", "float16", "float16", "float8_e5m2", "head", 2, 4, 32, 8, 80, 5),
    Case("HND", "bfloat16", "bfloat16", "float8_e4m3fn", "token_head", 2, 4, 8, 4, 256, 5),
    Case("NHD", "float32", "float32", "float16", None, 2, 4, 8, 2, 64, 5),
], ids=lambda c: f"{c.layout}-{c.cache_dtype}-{c.scale_mode}")
def test_kernel_lowers_for_cuda(case):
    text = _lowered_text(case)
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("num_kv_heads", KV_HEADS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_kernel_lowers_for_every_head_size(head_dim, num_kv_heads):
    """Every real head size with 1-8 kv heads lowers (layouts, scale modes and dtypes rotate)."""
    from pallas_kernels.commit_kv import plan_layout
    i = HEAD_DIMS.index(head_dim) + KV_HEADS.index(num_kv_heads)
    cache_dtype, mode = [("bfloat16", None), ("float8_e4m3fn", "token_head"), ("float8_e5m2", "head"),
                         ("float8_e4m3fn", "tensor"), ("float16", None)][i % 5]
    input_dtype = INPUT_DTYPES[i % 3]
    case = Case(("NHD", "HND")[i % 2], input_dtype, input_dtype, cache_dtype, mode, 2, 4, 16, num_kv_heads,
                head_dim, 5)
    sizes = tuple(np.dtype(NP_DTYPES[d]).itemsize for d in (input_dtype, input_dtype, cache_dtype))
    expected = "strided" if (num_kv_heads * head_dim) % 128 == 0 else "tiled"
    assert plan_layout(num_kv_heads, head_dim, sizes).kind == expected
    assert "mosaic_gpu" in _lowered_text(case)


def test_empty_and_jit():
    cache = scv_jax.PagedKVCache.create(2, 2, 8, 2, 64)
    empty = jnp.zeros((2, 0, 2, 64), jnp.float32)
    chex.assert_trees_all_equal(scv_jax.commit_draft_kv(cache, empty, empty, jnp.zeros((0,), jnp.int32)), cache)
    new = jnp.ones((2, 3, 2, 64), jnp.float32)
    out = jax.jit(scv_jax.commit_draft_kv)(cache, new, new, jnp.array([1, 2, 3]), jnp.array([True, False, True]))
    keys, _ = scv_jax.gather_kv(out, jnp.array([1, 2, 3]))
    np.testing.assert_array_equal(keys[0, :, 0, 0], [1, 0, 1])


def _bad_call(**overrides):
    cache = scv_jax.PagedKVCache.create(2, 2, 8, 4, 64)
    args = dict(cache=cache, new_keys=jnp.zeros((2, 3, 4, 64)), new_values=jnp.zeros((2, 3, 4, 64)),
                slot_mapping=jnp.zeros(3, jnp.int32), accept_mask=None, backend="xla")
    args.update(overrides)
    return lambda: scv_jax.commit_draft_kv(**args)


@pytest.mark.parametrize("call, error, match", [
    (_bad_call(new_keys=jnp.zeros((3, 4, 64))), ValueError, r"new_keys must be \[layers, T, kv_heads, head_dim\]"),
    (_bad_call(new_keys=jnp.zeros((2, 3, 2, 64))), ValueError, "kv_heads=4"),
    (_bad_call(new_values=jnp.zeros((2, 3, 4, 80))), ValueError, "new_values .* head_dim=64"),
    (_bad_call(new_keys=jnp.zeros((3, 3, 4, 64))), ValueError, "layers=2"),
    (_bad_call(new_values=jnp.zeros((2, 4, 4, 64))), ValueError, "new_values must have new_keys' shape"),
    (_bad_call(new_keys=jnp.zeros((2, 3, 4, 64), jnp.int32)), TypeError, "new_keys must be a floating"),
    (_bad_call(new_keys=jnp.zeros((2, 3, 4, 64), jnp.float8_e4m3fn)), TypeError, "float32/float16/bfloat16"),
    (_bad_call(slot_mapping=jnp.zeros(4, jnp.int32)), ValueError, "slot_mapping must be int32"),
    (_bad_call(slot_mapping=jnp.zeros(3, jnp.float32)), TypeError, "slot_mapping must be an integer"),
    (_bad_call(slot_mapping=jnp.zeros((3, 1), jnp.int32)), ValueError, "slot_mapping must be int32"),
    (_bad_call(accept_mask=jnp.ones(2, bool)), ValueError, r"accept_mask must be bool\[T\] with T=3"),
    (_bad_call(accept_mask=jnp.ones((3, 1), bool)), ValueError, r"accept_mask must be bool\[T\]"),
    (_bad_call(cache=object()), TypeError, "PagedKVCache"),
    (_bad_call(backend="cuda"), ValueError, "backend must be one of"),
])
def test_static_errors_name_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("slots, mask, num_slots, match", [
    ([1, 2, 1], None, None, "slot 1 more than once"),
    ([1, -1, -1, 2, 2], [1, 1, 1, 1, 0], None, None),
    ([1, 2, 2], [1, 1, 0], 16, None),
    ([1, 16], None, 16, r"slot_mapping\[1\]=16 is outside"),
    ([1, 2], [1, 1, 1], None, "accept_mask must be"),
    ([[1, 2]], None, None, "slot_mapping must be int32"),
])
def test_check_slot_mapping(slots, mask, num_slots, match):
    if match is None:
        scv_jax.check_slot_mapping(np.array(slots), mask, num_slots=num_slots)
    else:
        with pytest.raises(ValueError, match=match):
            scv_jax.check_slot_mapping(np.array(slots), mask, num_slots=num_slots)


def test_check_slot_mapping_accepts_a_cache():
    cache = scv_jax.PagedKVCache.create(1, 2, 8, 1, 8)
    with pytest.raises(ValueError, match="outside the cache's 16 slots"):
        scv_jax.check_slot_mapping([3, 20], num_slots=cache)


@settings(max_examples=10)
@given(data=st.data())
def test_slots_from_block_table(data):
    block_size = data.draw(st.sampled_from([1, 8, 16]))
    batch, max_blocks, width = data.draw(st.integers(1, 4)), data.draw(st.integers(0, 4)), data.draw(st.integers(0, 6))
    table = np.array(data.draw(st.lists(st.integers(-1, 50), min_size=batch * max_blocks,
                                        max_size=batch * max_blocks)), np.int32).reshape(batch, max_blocks)
    positions = np.array(data.draw(st.lists(st.integers(-2, block_size * (max_blocks + 1)), min_size=batch * width,
                                            max_size=batch * width)), np.int32).reshape(batch, width)
    expected = np.full(positions.shape, -1, np.int32)
    for b, s in np.ndindex(positions.shape):
        p = positions[b, s]
        if p >= 0 and p // block_size < max_blocks and table[b, p // block_size] >= 0:
            expected[b, s] = table[b, p // block_size] * block_size + p % block_size
    np.testing.assert_array_equal(scv_jax.slots_from_block_table(table, positions, block_size), expected)
    if batch == 1:
        np.testing.assert_array_equal(
            scv_jax.slots_from_block_table(table[0], positions[0], block_size=block_size), expected[0])


def test_slots_from_block_table_errors():
    with pytest.raises(ValueError, match="block_size"):
        scv_jax.slots_from_block_table(np.zeros((1, 2), np.int32), np.zeros((1, 2), np.int32), 0)
    with pytest.raises(ValueError, match=r"block_table must be int32\[B, max_blocks\]"):
        scv_jax.slots_from_block_table(np.zeros((2, 2), np.int32), np.zeros((3, 2), np.int32), 8)
