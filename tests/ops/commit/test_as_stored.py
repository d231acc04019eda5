"""``as_stored``: in-flight K/V read exactly as a commit stores them and ``gather_kv`` reads them back."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import scv_jax
from scv_jax.ops.commit.reference import as_stored

FP8 = ("float8_e4m3fn", "float8_e5m2")
SCALED = [(dtype, mode) for dtype in FP8 for mode in (None, "tensor", "head", "token_head")]
UNSCALED = [(dtype, None) for dtype in ("float16", "bfloat16")]


def committed(cache: scv_jax.PagedKVCache, x: jax.Array, backend: str) -> tuple[np.ndarray, np.ndarray]:
    """x [T, kv_heads, head_dim] committed as keys and as values into one-layer ``cache``, gathered back."""
    slots = jnp.arange(x.shape[0], dtype=jnp.int32)
    keys, values = scv_jax.gather_kv(scv_jax.commit_draft_kv(cache, x[None], x[None], slots, backend=backend), slots)
    return np.asarray(keys[0]), np.asarray(values[0])


@settings(max_examples=10)
@given(config=st.sampled_from(SCALED + UNSCALED), input_dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
       magnitude=st.sampled_from([0.01, 1.0, 30.0]), seed=st.integers(0, 2 ** 16), layout=st.sampled_from(["NHD", "HND"]))
def test_as_stored_is_what_a_commit_stores(config, input_dtype, magnitude, seed, layout):
    """Bit for bit, for K's and V's scales (different ones), every fp8 dtype and scale mode; non-finite
    elements included (NaN stays NaN, inf saturates)."""
    dtype, mode = config
    rng = np.random.default_rng(seed)
    tokens, kv_heads, head_dim = 5, 2, 16
    scales = {}
    if mode in ("tensor", "head"):
        shape = () if mode == "tensor" else (kv_heads,)
        scales = {name: jnp.asarray(rng.uniform(0.003, 0.2, shape), jnp.float32) for name in ("k_scale", "v_scale")}
    cache = scv_jax.PagedKVCache.create(1, 2, 4, kv_heads, head_dim, dtype=dtype, layout=layout, scale_mode=mode,
                                        **scales)
    x = rng.standard_normal((tokens, kv_heads, head_dim)) * magnitude
    x[0, 0, :3] = [np.inf, -np.inf, np.nan]
    x = jnp.asarray(x, input_dtype)
    keys, values = committed(cache, x, "xla")
    np.testing.assert_array_equal(np.asarray(as_stored(x, cache, cache.k_scale), np.float32), keys)
    np.testing.assert_array_equal(np.asarray(as_stored(x, cache, cache.v_scale), np.float32), values)


@pytest.mark.parametrize("dtype, mode", [("float8_e4m3fn", "token_head"), ("float8_e5m2", "head")])
def test_as_stored_matches_the_commit_kernel(dtype, mode):
    """The Mosaic GPU commit (interpreted off a GPU) stores the same bits as ``as_stored`` reads."""
    rng = np.random.default_rng(1)
    cache = scv_jax.PagedKVCache.create(1, 2, 8, 2, 64, dtype=dtype, scale_mode=mode,
                                        **({"k_scale": jnp.asarray([0.05, 0.11], jnp.float32)} if mode == "head" else {}))
    x = jnp.asarray(rng.standard_normal((6, 2, 64)) * 3, jnp.float32)
    keys, values = committed(cache, x, "interpret")
    np.testing.assert_array_equal(np.asarray(as_stored(x, cache, cache.k_scale)), keys)
    np.testing.assert_array_equal(np.asarray(as_stored(x, cache, cache.v_scale)), values)


@pytest.mark.parametrize("cache_dtype, input_dtype", [("float32", "float32"), ("float32", "bfloat16"),
                                                      ("float32", "float16"), ("bfloat16", "bfloat16"),
                                                      ("float16", "float16")])
def test_as_stored_is_untouched_where_the_cache_holds_the_input_exactly(cache_dtype, input_dtype):
    """No rounding is traced for a float32 cache or a cache of the model's dtype: the input itself."""
    cache = scv_jax.PagedKVCache.create(1, 1, 4, 1, 8, dtype=cache_dtype)
    x = jnp.ones((2, 1, 8), input_dtype)
    assert as_stored(x, cache, None) is x
    jaxpr = jax.make_jaxpr(lambda x: as_stored(x, cache, None))(x)
    assert not jaxpr.eqns


def test_float32_inputs_to_a_bfloat16_cache_are_rounded():
    """A float32 model with a bf16 cache: in-flight K/V read as bf16 values (float32 dtype)."""
    cache = scv_jax.PagedKVCache.create(1, 1, 4, 1, 8, dtype="bfloat16")
    x = jnp.full((1, 1, 8), 1 + 2 ** -10, jnp.float32)
    out = as_stored(x, cache, None)
    assert out.dtype == jnp.float32 and float(out[0, 0, 0]) == 1.0
