"""Pure-JAX reference of the K/V commit: quantise the new tokens, then one XLA scatter per page array
with skipped tokens sent out of range (``mode="drop"``). Under ``jax.jit(..., donate_argnums=...)``
the scatter updates the donated cache in place."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.fp8 import dequantize, dynamic_scale, finite_magnitudes, is_fp8, keep_rounding, quantize
from scv_jax.ops.commit.kv_cache import PagedKVCache


def effective_slots(slot_mapping: jax.Array, accept_mask: jax.Array | None, num_slots: int) -> jax.Array:
    """int32[T]: the slot each token writes, or -1 when skipped (negative slot, slot >= num_slots,
    or ``accept_mask`` False)."""
    slots = jnp.asarray(slot_mapping, jnp.int32)
    keep = (slots >= 0) & (slots < num_slots)
    if accept_mask is not None:
        keep &= jnp.asarray(accept_mask).astype(jnp.bool_)
    return jnp.where(keep, slots, -1)


def _block_and_offset(slots: jax.Array, cache: PagedKVCache) -> tuple[jax.Array, jax.Array]:
    """Block and offset of each slot; a negative slot maps to block ``num_blocks`` (out of range)."""
    valid = slots >= 0
    block = jnp.where(valid, slots // cache.block_size, cache.num_blocks)
    offset = jnp.where(valid, slots % cache.block_size, 0)
    return block, offset


def quantize_tokens(x: jax.Array, cache: PagedKVCache, scale: jax.Array | None):
    """[..., kv_heads, head_dim] input -> (cache-dtype values, float32 [..., kv_heads] dynamic
    scales or None). Non-finite inputs follow ``pallas_kernels.fp8``'s policy."""
    x = x.astype(jnp.float32)
    if cache.scale_mode == "token_head":
        token_scale = dynamic_scale(jnp.max(finite_magnitudes(x), axis=-1), cache.dtype)
        return quantize(x, cache.dtype, token_scale[..., None]), token_scale
    if cache.scale_mode == "head":
        scale = scale[:, None]
    return quantize(x, cache.dtype, scale), None


def as_stored(x: jax.Array, cache: PagedKVCache, scale: jax.Array | None) -> jax.Array:
    """K or V ``[..., kv_heads, head_dim]`` as a commit stores them and a read gives them back: quantised
    as ``quantize_tokens`` does (``scale``: the cache's k_scale or v_scale; "token_head" takes each
    vector's own dynamic scale, the one its commit computes), then dequantised as ``gather_reference``
    does. Attention reads in-flight K/V through this, so that a token's K/V look the same before and
    after their commit.

    Returns float32 for a scaled cache, else values exact in x's dtype promoted with the cache's
    (x's own dtype for fp8); ``x`` itself, untouched and untraced, when the cache holds x exactly (a
    float32 cache, or a cache of x's dtype).
    """
    if not is_fp8(cache.dtype) and cache.dtype in (np.dtype(jnp.float32), np.dtype(x.dtype)):
        return x
    q, token_scale = quantize_tokens(x, cache, scale)
    q = keep_rounding(q)   # widened below: XLA:GPU would otherwise drop the rounding to the cache's dtype
    if cache.scale_mode is None:
        return q.astype(x.dtype if is_fp8(cache.dtype) else jnp.promote_types(x.dtype, cache.dtype))
    if cache.scale_mode == "token_head":
        scale = token_scale
    return dequantize(q, scale if cache.scale_mode == "tensor" else scale[..., None])


def scatter_tokens(pages: jax.Array, values: jax.Array, slots: jax.Array, cache: PagedKVCache) -> jax.Array:
    """Writes ``values`` [layers, T, kv_heads, head_dim] at ``slots`` (-1 = dropped).

    fp8 pages are scattered as uint8: XLA:CPU widens an fp8 scatter to float16, which quietens the NaN
    payloads of untouched slots. (The uint8 view still costs XLA:CPU one copy of the pages; 16- and
    32-bit pages are updated in place.)"""
    bits = jnp.uint8 if is_fp8(pages.dtype) else None
    if bits is not None:
        pages, values = lax.bitcast_convert_type(pages, bits), lax.bitcast_convert_type(values, bits)
    block, offset = _block_and_offset(slots, cache)
    if cache.layout == "NHD":
        out = pages.at[:, block, offset].set(values, mode="drop")
    else:
        out = pages.at[:, block, :, offset].set(jnp.swapaxes(values, 0, 1), mode="drop")
    return out if bits is None else lax.bitcast_convert_type(out, cache.dtype)


def commit_reference(cache: PagedKVCache, new_keys: jax.Array, new_values: jax.Array,
                     slots: jax.Array) -> PagedKVCache:
    """Writes each token with ``slots[t] >= 0`` (see ``effective_slots``) into all layers' pages."""
    fields = {}
    for name, x in (("k", new_keys), ("v", new_values)):
        scale = getattr(cache, f"{name}_scale")
        q, token_scale = quantize_tokens(x, cache, scale)
        fields[f"{name}_pages"] = scatter_tokens(getattr(cache, f"{name}_pages"), q, slots, cache)
        if token_scale is not None:
            block, offset = _block_and_offset(slots, cache)
            fields[f"{name}_scale"] = scale.at[:, block, offset].set(token_scale, mode="drop")
    return dataclasses.replace(cache, **fields)


def gather_reference(cache: PagedKVCache, slots: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Dequantised float32 [layers, S, kv_heads, head_dim] keys and values at ``slots``; slots outside
    [0, num_slots) read as zeros."""
    slots = jnp.asarray(slots, jnp.int32)
    slots = jnp.where((slots >= 0) & (slots < cache.num_slots), slots, -1)
    block, offset = _block_and_offset(slots, cache)
    out = []
    for name in ("k", "v"):
        pages, scale = getattr(cache, f"{name}_pages"), getattr(cache, f"{name}_scale")
        if cache.layout == "NHD":
            q = pages.at[:, block, offset].get(mode="fill", fill_value=0)
        else:
            q = jnp.swapaxes(pages.at[:, block, :, offset].get(mode="fill", fill_value=0), 0, 1)
        if cache.scale_mode == "head":
            scale = scale[:, None]
        elif cache.scale_mode == "token_head":
            scale = scale.at[:, block, offset].get(mode="fill", fill_value=0)[..., None]
        out.append(dequantize(q, scale))
    return out[0], out[1]
