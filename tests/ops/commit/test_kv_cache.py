"""PagedKVCache construction, dtype/layout/scale parsing, and the fp8 helpers against ml_dtypes."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, strategies as st

import scv_jax
from pallas_kernels import fp8
from scv_jax.ops.commit.kv_cache import parse_cache_dtype

L, NB, BS, H, D = 2, 3, 8, 4, 16


@pytest.mark.parametrize("layout, shape", [("NHD", (L, NB, BS, H, D)), ("HND", (L, NB, H, BS, D))])
def test_create_shapes_and_metadata(layout, shape):
    cache = scv_jax.PagedKVCache.create(L, NB, BS, H, D, layout=layout)
    assert cache.k_pages.shape == cache.v_pages.shape == shape
    assert cache.k_pages.dtype == jnp.bfloat16 and not np.any(np.asarray(cache.k_pages, np.float32))
    assert cache.k_scale is None and cache.v_scale is None and cache.scale_mode is None
    assert (cache.num_layers, cache.num_blocks, cache.block_size, cache.num_kv_heads, cache.head_dim) == \
        (L, NB, BS, H, D)
    assert cache.num_slots == NB * BS and cache.layout == layout


@pytest.mark.parametrize("name, expected", [
    ("float32", jnp.float32), ("float16", jnp.float16), ("bfloat16", jnp.bfloat16),
    ("float8_e4m3fn", jnp.float8_e4m3fn), ("float8_e5m2", jnp.float8_e5m2), ("auto", jnp.bfloat16),
    ("fp8", jnp.float8_e4m3fn), ("fp8_e4m3", jnp.float8_e4m3fn), ("fp8_e5m2", jnp.float8_e5m2),
    (jnp.float16, jnp.float16), (np.dtype(ml_dtypes.float8_e5m2), jnp.float8_e5m2)])
def test_dtype_names(name, expected):
    assert parse_cache_dtype(name) == np.dtype(expected)
    assert scv_jax.PagedKVCache.create(1, 1, 8, 1, 8, dtype=name).k_pages.dtype == expected


@pytest.mark.parametrize("bad", ["int8", "fp8_e4m3fnuz", "float64", "FP8", "", jnp.int32, "bf16"])
def test_bad_dtype_names(bad):
    with pytest.raises(ValueError, match="unsupported KV cache dtype"):
        scv_jax.PagedKVCache.create(1, 1, 8, 1, 8, dtype=bad)


@pytest.mark.parametrize("bad", ["nhd", "NDH", "BHSD", None])
def test_bad_layout(bad):
    with pytest.raises(ValueError, match="layout"):
        scv_jax.PagedKVCache.create(1, 1, 8, 1, 8, layout=bad)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_bad_sizes(bad):
    with pytest.raises(ValueError, match="num_blocks"):
        scv_jax.PagedKVCache.create(1, bad, 8, 1, 8)


@pytest.mark.parametrize("scale, mode", [
    (2.0, "tensor"), (jnp.float32(0.5), "tensor"), (np.full(H, 0.25, np.float32), "head"),
    (np.ones((L, NB, BS, H), np.float32), "token_head")])
def test_scale_mode_inferred_from_shape(scale, mode):
    cache = scv_jax.PagedKVCache.create(L, NB, BS, H, D, dtype="fp8", k_scale=scale)
    assert cache.scale_mode == mode
    assert cache.k_scale.shape == np.shape(scale) and cache.k_scale.dtype == jnp.float32
    np.testing.assert_array_equal(cache.v_scale, np.ones(np.shape(scale), np.float32))


@pytest.mark.parametrize("mode, shape", [("tensor", ()), ("head", (H,)), ("token_head", (L, NB, BS, H))])
def test_default_scales_are_ones(mode, shape):
    cache = scv_jax.PagedKVCache.create(L, NB, BS, H, D, dtype="fp8_e5m2", scale_mode=mode)
    for scale in (cache.k_scale, cache.v_scale):
        np.testing.assert_array_equal(scale, np.ones(shape, np.float32))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(k_scale=np.ones(3)), ValueError, "fits no scale mode"),
    (dict(k_scale=np.ones((H, 1))), ValueError, "fits no scale mode"),
    (dict(scale_mode="head", k_scale=1.0), ValueError, r"k_scale must have shape \(4,\)"),
    (dict(scale_mode="token_head", v_scale=np.ones((L, NB, H, BS))), ValueError, "v_scale must have shape"),
    (dict(k_scale=1.0, v_scale=np.ones(H)), ValueError, "different scale modes"),
    (dict(scale_mode="channel"), ValueError, "scale_mode must be one of"),
    (dict(scale_mode="tensor", k_scale=-1.0), ValueError, "positive finite"),
    (dict(scale_mode="tensor", k_scale=np.inf), ValueError, "positive finite"),
    (dict(scale_mode="tensor", dtype="bfloat16"), ValueError, "needs an fp8 cache dtype"),
])
def test_bad_scales(kwargs, error, match):
    kwargs = {"dtype": "fp8", **kwargs}
    with pytest.raises(error, match=match):
        scv_jax.PagedKVCache.create(L, NB, BS, H, D, **kwargs)


def test_replace_and_its_checks():
    cache = scv_jax.PagedKVCache.create(L, NB, BS, H, D, dtype="fp8", scale_mode="head")
    pages = jnp.ones_like(cache.k_pages)
    new = cache.replace(k_pages=pages, v_scale=jnp.full((H,), 2.0))
    assert new.k_pages is pages and new.scale_mode == "head" and float(new.v_scale[0]) == 2.0
    assert cache.k_pages is not pages
    with pytest.raises(ValueError, match="k_pages and v_pages must match"):
        cache.replace(k_pages=pages.astype(jnp.float8_e5m2))
    with pytest.raises(ValueError, match="rank 5"):
        cache.replace(v_pages=pages[0])
    with pytest.raises(ValueError, match="v_scale must have shape"):
        cache.replace(v_scale=jnp.ones(H + 1))
    with pytest.raises(ValueError, match="unsupported KV cache dtype"):
        cache.replace(k_pages=pages.astype(jnp.int8), v_pages=pages.astype(jnp.int8))
    for bad in (0.0, np.nan, -1.0, np.inf):            # as create: concrete scales must be positive and finite
        with pytest.raises(ValueError, match="k_scale must hold positive finite scales"):
            cache.replace(k_scale=jnp.full((H,), bad))


def test_cache_is_a_pytree_with_static_metadata():
    cache = scv_jax.PagedKVCache.create(L, NB, BS, H, D, dtype="fp8", layout="HND", scale_mode="tensor")
    leaves, treedef = jax.tree.flatten(cache)
    assert len(leaves) == 4
    out = jax.jit(lambda c: c.replace(k_scale=c.k_scale * 2))(cache)
    assert out.layout == "HND" and out.scale_mode == "tensor" and float(out.k_scale) == 2.0
    assert len(jax.tree.leaves(scv_jax.PagedKVCache.create(1, 1, 8, 1, 8))) == 2


FP8 = [jnp.float8_e4m3fn, jnp.float8_e5m2]
finite_f32 = st.floats(-1e6, 1e6, allow_nan=False, width=32)


@pytest.mark.parametrize("dtype", FP8)
@given(values=st.lists(finite_f32 | st.sampled_from([448.0, 464.0, -480.0, 57344.0, 61440.0, 1e9,
                                                     np.inf, -np.inf, 0.0, -0.0]), min_size=1, max_size=64),
       scale=st.sampled_from([None, 1.0, 0.03125, 3.7, 250.0]))
def test_quantize_matches_ml_dtypes_with_saturation(dtype, values, scale):
    x = np.asarray(values, np.float32)
    y = x if scale is None else x / np.float32(scale)
    limit = np.float32(ml_dtypes.finfo(dtype).max)
    expected = np.clip(y, -limit, limit).astype(dtype)
    got = np.asarray(fp8.quantize(jnp.asarray(x), dtype, None if scale is None else jnp.float32(scale)))
    np.testing.assert_array_equal(got.view(np.uint8), expected.view(np.uint8))
    assert np.all(np.isfinite(got.astype(np.float32)))


def test_dynamic_scale_and_dequantize():
    absmax = jnp.array([0.0, 1e-40, 448.0, 896.0], jnp.float32)
    scale = fp8.dynamic_scale(absmax, jnp.float8_e4m3fn)
    np.testing.assert_array_equal(scale, np.maximum(np.asarray(absmax) * np.float32(1 / 448),
                                                    np.finfo(np.float32).tiny))
    q = fp8.quantize(jnp.array([896.0, -448.0, 1.0]), jnp.float8_e4m3fn, jnp.float32(2.0))
    np.testing.assert_array_equal(fp8.dequantize(q, jnp.float32(2.0)), [896.0, -448.0, 1.0])
    assert fp8.fp8_max(jnp.float8_e5m2) == 57344.0 and not fp8.is_fp8(jnp.bfloat16)
