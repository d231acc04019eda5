"""Attention math shared by the full-sequence and the paged + staged forward passes.

Keys come from three places, concatenated along the key axis: committed K/V read from the paged
cache, K/V of earlier in-flight tokens (a staging buffer), and the new tokens' own K/V. Masks keep
every query to keys at or before its position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG_INF = -1e30


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding (rotate-half form). x: [B, T, heads, head_dim]; positions: int32[B, T]."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq          # [B, T, half]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def grouped_query_attention(q: jax.Array, keys: jax.Array, values: jax.Array,
                            mask: jax.Array) -> jax.Array:
    """Softmax attention with query heads grouped over K/V heads.

    q: [B, T, heads, D]; keys, values: [B, N, kv_heads, D]; mask: bool[B, T, N] (True = attend).
    Returns [B, T, heads, D]. A query row with no visible key returns zeros.
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


def causal_mask(batch: int, num_tokens: int) -> jax.Array:
    """bool[B, T, T]: token i sees tokens j <= i."""
    idx = jnp.arange(num_tokens)
    return jnp.broadcast_to(idx[None, :] <= idx[:, None], (batch, num_tokens, num_tokens))


def prefix_mask(lengths: jax.Array, capacity: int, num_tokens: int) -> jax.Array:
    """bool[B, T, capacity]: key n is visible to every query when n < lengths[b]."""
    visible = jnp.arange(capacity)[None, :] < lengths[:, None]
    return jnp.broadcast_to(visible[:, None, :], (lengths.shape[0], num_tokens, capacity))
