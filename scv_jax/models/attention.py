"""Attention of the full-sequence and the paged + staged forward passes.

``paged_attention`` is the one place where a layer attends over the paged KV cache: keys come from
the committed cache (read through block tables), the staging buffer of earlier in-flight tokens and
the new tokens themselves, concatenated along the key axis. A fused paged-attention kernel replaces
this function and nothing else.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from scv_jax.models.paged_read import read_layer_kv

_NEG_INF = -1e30


def grouped_query_attention(q: jax.Array, keys: jax.Array, values: jax.Array,
                            mask: jax.Array) -> jax.Array:
    """Softmax attention with query heads grouped over K/V heads (scores and softmax in float32).

    q: [B, T, heads, D]; keys, values: [B, N, kv_heads, D]; mask: bool[B, T, N] (True = attend).
    Returns [B, T, heads, D] in ``values``' dtype. A query row with no visible key returns zeros.
    """
    batch, num_tokens, num_heads, head_dim = q.shape
    kv_heads = keys.shape[2]
    q = q.reshape(batch, num_tokens, kv_heads, num_heads // kv_heads, head_dim)
    scores = jnp.einsum("btkgd,bnkd->bkgtn", q, keys, preferred_element_type=jnp.float32)
    scores = scores * (head_dim ** -0.5)
    scores = jnp.where(mask[:, None, None], scores, _NEG_INF)
    weights = jax.nn.softmax(scores, axis=-1) * mask[:, None, None]
    out = jnp.einsum("bkgtn,bnkd->btkgd", weights.astype(values.dtype), values)
    return out.reshape(batch, num_tokens, num_heads, head_dim)


def visibility(query_positions: jax.Array, key_positions: jax.Array, key_valid: jax.Array,
               sliding_window: int | None) -> jax.Array:
    """bool[B, T, N]: valid keys at or before each query's position (and inside its window).

    query_positions: int32[B, T]; key_positions: int32[B, N]; key_valid: bool[B, N].
    """
    q, k = query_positions[:, :, None], key_positions[:, None, :]
    mask = key_valid[:, None, :] & (k <= q)
    if sliding_window is not None:
        mask &= k > q - sliding_window
    return mask


def causal_attention(q: jax.Array, keys: jax.Array, values: jax.Array, positions: jax.Array, *,
                     sliding_window: int | None = None) -> jax.Array:
    """Attention among the tokens of a sequence: q [B, T, heads, D], keys/values [B, T, kv_heads, D],
    positions int32[B, T]. Returns [B, T, heads, D]."""
    mask = visibility(positions, positions, jnp.ones(positions.shape, jnp.bool_), sliding_window)
    return grouped_query_attention(q, keys, values, mask)


def paged_attention(q: jax.Array, cache, layer: jax.Array | int, block_tables: jax.Array,
                    context_lens: jax.Array, staged_keys: jax.Array | None, staged_values: jax.Array | None,
                    staged_lens: jax.Array, new_keys: jax.Array, new_values: jax.Array, *,
                    sliding_window: int | None = None) -> jax.Array:
    """Attention of new tokens over the paged cache, the staged tokens and themselves.

    Args:
      q: [B, T, heads, D], RoPE applied; token t of request b is at position
        ``context_lens[b] + staged_lens[b] + t``.
      cache: a ``scv_jax.PagedKVCache`` (read, never written).
      layer: the layer index (an int or a traced int32 scalar, e.g. under a scan over layers).
      block_tables: int32[B, max_blocks]; context_lens: int32[B], committed positions per request.
      staged_keys, staged_values: [B, S, kv_heads, D] K/V of in-flight tokens at positions
        ``context_lens + s``, or None; staged_lens: int32[B], entries s < staged_lens[b] are valid.
      new_keys, new_values: [B, T, kv_heads, D], the new tokens' own K/V (RoPE applied to keys).
      sliding_window: None or W (see ``TransformerConfig.sliding_window``).
    Returns:
      [B, T, heads, D] in ``new_values``' dtype.
    """
    batch, num_tokens = q.shape[:2]
    positions = (context_lens + staged_lens)[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)
    cached_keys, cached_values = read_layer_kv(cache, layer, block_tables)
    capacity = cached_keys.shape[1]
    cached_positions = jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32), (batch, capacity))
    sources = [(cached_keys, cached_values, cached_positions, cached_positions < context_lens[:, None])]
    if staged_keys is not None:
        slots = jnp.arange(staged_keys.shape[1], dtype=jnp.int32)
        sources.append((staged_keys, staged_values, context_lens[:, None] + slots,
                        slots[None, :] < staged_lens[:, None]))
    sources.append((new_keys, new_values, positions, jnp.ones(positions.shape, jnp.bool_)))
    keys = jnp.concatenate([k.astype(new_keys.dtype) for k, _, _, _ in sources], axis=1)
    values = jnp.concatenate([v.astype(new_values.dtype) for _, v, _, _ in sources], axis=1)
    mask = visibility(positions, jnp.concatenate([p for _, _, p, _ in sources], axis=1),
                      jnp.concatenate([m for _, _, _, m in sources], axis=1), sliding_window)
    return grouped_query_attention(q, keys, values, mask)
