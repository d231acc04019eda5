"""Cache-dtype quantisation shared by the XLA reference and the Mosaic GPU commit kernel.

Storing divides by the scale (when there is one), saturates to the finite range of an fp8 dtype
(a plain cast of an overflow to float8_e4m3fn gives NaN) and casts with round-to-nearest-even;
reading casts to float32 and multiplies by the scale. All functions are plain ``jnp`` arithmetic, so
the kernel and the reference produce the same bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FP8_DTYPES: tuple[np.dtype, ...] = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))
# The smallest dynamic scale: keeps all-zero tokens finite (0 / tiny == 0).
MIN_SCALE = float(np.finfo(np.float32).tiny)


def is_fp8(dtype) -> bool:
    return np.dtype(dtype) in FP8_DTYPES


def fp8_max(dtype) -> float:
    """The largest finite value of an fp8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    return float(jnp.finfo(dtype).max)


def quantize(x: jax.Array, cache_dtype, scale: jax.Array | float | None = None) -> jax.Array:
    """float32 values -> cache dtype: ``x / scale``, saturated for fp8, rounded to nearest even.

    Args:
      x: float32 values of any shape.
      cache_dtype: the cache's dtype.
      scale: None, or float32 broadcastable to ``x`` (per tensor, head or token-head).
    """
    if scale is not None:
        x = x / scale
    if is_fp8(cache_dtype):
        limit = np.float32(fp8_max(cache_dtype))
        x = jnp.clip(x, -limit, limit)
    return x.astype(cache_dtype)


def dequantize(q: jax.Array, scale: jax.Array | None = None) -> jax.Array:
    """Cache values -> float32: ``q * scale``. ``scale`` broadcastable to ``q`` or None."""
    x = q.astype(jnp.float32)
    return x if scale is None else x * scale


def dynamic_scale(absmax: jax.Array, cache_dtype) -> jax.Array:
    """Per-token-head scale from the float32 absolute maximum: ``max(absmax / fp8_max, tiny)``.

    The division is written as a product with the float32 reciprocal of fp8_max, because XLA rewrites
    division by a constant that way on some platforms and not others; the product is the same bits on
    XLA:CPU, XLA:GPU and in the kernel (it can differ from a true division by one ulp).
    """
    return jnp.maximum(absmax * np.float32(1.0 / fp8_max(cache_dtype)), np.float32(MIN_SCALE))
