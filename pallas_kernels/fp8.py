"""Cache-dtype quantisation shared by the XLA reference and the Mosaic GPU commit kernel.

Storing divides by the scale (when there is one) with a true IEEE float32 division, as vLLM does,
saturates to the finite range of an fp8 dtype (a plain cast of an overflow to float8_e4m3fn gives
NaN) and casts with round-to-nearest-even; reading casts to float32 and multiplies by the scale. All
functions are plain ``jnp`` arithmetic, so the kernel and the reference produce the same bits.

True division: XLA's algebraic simplifier rewrites ``x / broadcast(s)`` into ``x * broadcast(1 / s)``,
which differs from ``x / s`` by one float32 ulp for ~20% of values and so, after fp8 rounding, stores
a value one fp8 step off whenever ``x / s`` lies next to an fp8 rounding midpoint (from ~1e-5 of
generic random values to ~10% of values placed at midpoints; tests use the latter). ``quantize`` hides the broadcast divisor behind an
``optimization_barrier`` (materialising it: one extra float32 array per quantised tensor on the XLA
path; in the kernel the divisor is already in registers and Mosaic lowers ``/`` to ``div.rn.f32``).

Non-finite inputs and dynamic ("token_head") scales:
  * the scale of a (token, head) vector comes from its *finite* absmax: NaN and +-inf elements are
    ignored (``finite_magnitudes``), so they never poison the other elements of their vector;
  * +-inf is stored saturated (+-fp8_max, i.e. read back as +-the vector's finite absmax); NaN is
    stored as NaN in its own element only;
  * precision: the scale is absmax / fp8_max, so an element x is stored with fp8's relative precision
    (error <= 2^-4 |x| for e4m3fn, 2^-3 |x| for e5m2) down to fp8's subnormals; below half the
    smallest subnormal times the scale it flushes to zero: |x| < absmax / 458752 for e4m3fn
    (2^-10 * absmax / 448), |x| < absmax / 7.5e9 for e5m2. In general |x - read(x)| <=
    max(2^-4 |x|, 2^-10 scale) for e4m3fn. One huge outlier therefore squeezes the small elements of
    its own (token, head) vector as far as fp8's range dictates (a 1e6 outlier flushes every element
    of its vector below ~2.2 to 0), and nothing else. The scale's input is not clamped: the outlier
    itself stays exact to fp8 precision (vLLM's optional ``scale_ub`` clamp would saturate it instead).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

FP8_DTYPES: tuple[np.dtype, ...] = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))
# The smallest dynamic scale: keeps all-zero (or all non-finite) vectors finite (0 / tiny == 0).
MIN_SCALE = float(np.finfo(np.float32).tiny)


def is_fp8(dtype) -> bool:
    return np.dtype(dtype) in FP8_DTYPES


def fp8_max(dtype) -> float:
    """The largest finite value of an fp8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    return float(jnp.finfo(dtype).max)


def quantize(x: jax.Array, cache_dtype, scale: jax.Array | float | None = None) -> jax.Array:
    """float32 values -> cache dtype: ``x / scale`` (a true division), saturated for fp8, rounded to
    nearest even. NaN stays NaN; +-inf saturates to +-fp8_max.

    Args:
      x: float32 values of any shape.
      cache_dtype: the cache's dtype.
      scale: None, or float32 broadcastable to ``x`` (per tensor, head or token-head).
    """
    if scale is not None:
        x = x / lax.optimization_barrier(jnp.broadcast_to(scale, x.shape))
    if is_fp8(cache_dtype):
        limit = np.float32(fp8_max(cache_dtype))
        x = jnp.clip(x, -limit, limit)
    return x.astype(cache_dtype)


def keep_rounding(narrow: jax.Array) -> jax.Array:
    """``narrow`` (a value just rounded to a narrower float dtype) behind an optimization barrier, so
    that widening it again keeps the rounding.

    XLA:GPU's excess-precision simplification (``xla_allow_excess_precision``, on by default) folds
    ``convert(convert(x, bfloat16), float32)`` into ``x``: a round trip written to round (a bf16 hi/lo
    split, K/V read as the cache will hold them) silently does nothing there, while XLA:CPU keeps it.
    A barrier between the two converts stops the fold. Use it only on small arrays: the barrier also
    stops XLA fusing across it.
    """
    return lax.optimization_barrier(narrow)


def dequantize(q: jax.Array, scale: jax.Array | None = None) -> jax.Array:
    """Cache values -> float32: ``q * scale``. ``scale`` broadcastable to ``q`` or None."""
    x = q.astype(jnp.float32)
    return x if scale is None else x * scale


def finite_magnitudes(x: jax.Array) -> jax.Array:
    """|x| where x is finite, else 0: the values whose maximum defines a dynamic scale."""
    magnitude = jnp.abs(x)
    return jnp.where(magnitude < jnp.inf, magnitude, 0.0)


def dynamic_scale(absmax: jax.Array, cache_dtype) -> jax.Array:
    """Per-token-head scale from the float32 finite absolute maximum: ``max(absmax / fp8_max, tiny)``.

    The division is written as a product with the float32 reciprocal of fp8_max (a compile-time
    constant, so every backend computes the same product; it can differ from a true division by one
    ulp, which only changes the scale, not its consistency between store and read).
    """
    return jnp.maximum(absmax * np.float32(1.0 / fp8_max(cache_dtype)), np.float32(MIN_SCALE))
