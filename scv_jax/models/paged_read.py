"""Reading one layer's committed K/V out of a ``PagedKVCache`` through block tables."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _gather_pages(pages: jax.Array, layer: jax.Array | int, block_tables: jax.Array, layout: str) -> jax.Array:
    """[B, max_blocks * block_size, kv_heads, head_dim] (NHD or HND pages, one layer)."""
    block_tables = jnp.maximum(block_tables, 0)       # unallocated (-1) entries are masked by the caller
    blocks = pages[layer, block_tables]               # NHD: [B, MB, BS, H, D]; HND: [B, MB, H, BS, D]
    if layout == "HND":
        blocks = jnp.swapaxes(blocks, 2, 3)
    batch, max_blocks, block_size = blocks.shape[:3]
    return blocks.reshape(batch, max_blocks * block_size, *blocks.shape[3:])


def _dequantize(values: jax.Array, scale, layer: jax.Array | int, block_tables: jax.Array,
                layout: str) -> jax.Array:
    """float32 values times the cache's scale (None, scalar, [kv_heads] or token-head scale pages)."""
    values = values.astype(jnp.float32)
    if scale is None:
        return values
    scale = jnp.asarray(scale, jnp.float32)
    if scale.ndim == 4:                                # [layers, blocks, block_size, kv_heads]
        token_scale = scale[layer, jnp.maximum(block_tables, 0)]       # [B, MB, BS, H]
        return values * token_scale.reshape(values.shape[:3])[..., None]
    if scale.ndim == 1:                                # [kv_heads]
        return values * scale[:, None]
    return values * scale


def read_layer_kv(cache, layer: jax.Array | int, block_tables: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Committed keys and values of ``layer`` for every request, dequantized to float32.

    Args:
      cache: a ``scv_jax.PagedKVCache``.
      layer: layer index, a Python int or a traced int32 scalar (e.g. under a scan over layers).
      block_tables: int32[B, max_blocks]; the cache blocks of each request, in order.
    Returns:
      keys, values: float32[B, max_blocks * block_size, kv_heads, head_dim]; entry n is the token at
      position n (valid for n < the request's committed length; the caller masks the rest).
    """
    layout = getattr(cache, "layout", "NHD")
    keys = _gather_pages(cache.k_pages, layer, block_tables, layout)
    values = _gather_pages(cache.v_pages, layer, block_tables, layout)
    return (_dequantize(keys, getattr(cache, "k_scale", None), layer, block_tables, layout),
            _dequantize(values, getattr(cache, "v_scale", None), layer, block_tables, layout))
