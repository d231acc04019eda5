"""Roundings written as float round trips survive XLA:GPU.

XLA:GPU folds ``convert(convert(x, narrow), wide)`` into ``x`` (its excess-precision simplification, on
by default; XLA:CPU keeps the round trip), so a bf16 hi/lo split loses its lo part there and in-flight
K/V are no longer rounded as the cache will hold them. The first native GPU run of the attention kernel
showed it (float32 attention at bf16 accuracy, benchmarks/RESULTS.md, 2026-12-04). CI has no GPU, so
these tests check the traced programs instead: no float narrowed by one convert is widened by the next
without ``pallas_kernels.fp8.keep_rounding`` between them. (A round trip split across two traced
functions would escape this check; every one the code writes is inside one function.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scv_jax
from pallas_kernels.fp8 import keep_rounding
from pallas_kernels.paged_attention import bf16_parts
from scv_jax.ops.commit.reference import as_stored


def _jaxprs(jaxpr):
    """``jaxpr`` and every jaxpr nested in its equations' parameters (jit, scan, cond, kernels)."""
    yield jaxpr
    for eqn in jaxpr.eqns:
        for value in eqn.params.values():
            for item in value if isinstance(value, (list, tuple)) else (value,):
                inner = getattr(item, "jaxpr", item)
                if hasattr(inner, "eqns"):
                    yield from _jaxprs(inner)


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def foldable_round_trips(fn, *args) -> list[str]:
    """Each convert that widens a float which the equation before it narrowed (``a -> b -> c`` with b
    narrower than c), as "a -> b -> c"."""
    found = []
    for jaxpr in _jaxprs(jax.make_jaxpr(fn)(*args).jaxpr):
        narrowed = {}
        for eqn in jaxpr.eqns:
            if eqn.primitive.name != "convert_element_type":
                continue
            source, out = eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype
            if not (_is_float(source) and _is_float(out)):
                continue
            if jnp.finfo(out).bits < jnp.finfo(source).bits:
                narrowed[eqn.outvars[0]] = source
            elif eqn.invars[0] in narrowed and jnp.finfo(out).bits > jnp.finfo(source).bits:
                found.append(f"{np.dtype(narrowed[eqn.invars[0]])} -> {np.dtype(source)} -> {np.dtype(out)}")
    return found


def test_the_check_finds_a_bare_round_trip():
    x = jnp.ones(4, jnp.float32)
    assert foldable_round_trips(lambda x: x - x.astype(jnp.bfloat16).astype(jnp.float32), x) == [
        "float32 -> bfloat16 -> float32"]
    kept = lambda x: x - keep_rounding(x.astype(jnp.bfloat16)).astype(jnp.float32)  # noqa: E731
    assert foldable_round_trips(kept, x) == []


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_bf16_split_keeps_its_lo_part(dtype):
    x = jnp.asarray(np.random.default_rng(0).standard_normal(64), dtype)
    assert foldable_round_trips(lambda x: bf16_parts(x, 2), x) == []
    hi, lo = bf16_parts(x, 2)
    # hi + lo carries 16 significant bits: float16's 11 exactly, float32 to 2^-16 relative
    np.testing.assert_allclose(np.asarray(hi, np.float64) + np.asarray(lo, np.float64), np.asarray(x, np.float64),
                               rtol=0 if dtype == jnp.float16 else 2.0 ** -15, atol=0)


@pytest.mark.parametrize("cache_dtype,scale_mode", [("bfloat16", None), ("float16", None),
                                                    ("float8_e4m3fn", "tensor"), ("float8_e5m2", "head"),
                                                    ("float8_e4m3fn", "token_head"), ("float8_e4m3fn", None)])
def test_in_flight_kv_is_rounded_as_stored(cache_dtype, scale_mode):
    cache = scv_jax.PagedKVCache.create(1, 2, 8, 2, 16, dtype=cache_dtype, scale_mode=scale_mode)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 2, 16)), jnp.float32)
    assert foldable_round_trips(lambda x: as_stored(x, cache, cache.k_scale), x) == []


@pytest.mark.parametrize("backend", ["xla", "interpret"])
@pytest.mark.parametrize("q_dtype,cache_dtype", [("float32", "float32"), ("float16", "float16"),
                                                 ("float32", "bfloat16"), ("bfloat16", "float8_e4m3fn")])
def test_attention_programs_keep_their_roundings(backend, q_dtype, cache_dtype):
    """The whole op as traced for each backend: the kernel's operand packing (hi/lo q and in-flight K/V)
    and its body, or the reference."""
    cache = scv_jax.PagedKVCache.create(1, 4, 16, 2, 64, dtype=cache_dtype)
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((2, 3, 4, 64)), q_dtype)
    new = jnp.asarray(rng.standard_normal((2, 3, 2, 64)), q_dtype)
    staged = jnp.asarray(rng.standard_normal((2, 2, 2, 64)), q_dtype)

    def attention(q, new, staged):
        return scv_jax.paged_attention(q, cache, 0, jnp.zeros((2, 2), jnp.int32), jnp.array([5, 20]),
                                       new_keys=new, new_values=new, staged_keys=staged, staged_values=staged,
                                       staged_lens=jnp.array([1, 2]), backend=backend)

    assert foldable_round_trips(attention, q, new, staged) == []
