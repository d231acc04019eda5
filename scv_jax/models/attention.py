"""Attention of the full-sequence forward pass (the paged forward uses ``scv_jax.ops.attention``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


_NEG_INF = -1e30


def grouped_query_attention(q: jax.Array, keys: jax.Array, values: jax.Array, mask: jax.Array,
                            sinks: jax.Array | None = None) -> jax.Array:
    """Softmax attention with query heads grouped over K/V heads (scores and softmax in float32).

    q: [B, T, heads, D]; keys, values: [B, N, kv_heads, D]; mask: bool[B, T, N] (True = attend);
    sinks: None or [heads], one more logit per head in every softmax, with a zero value (gpt-oss).
    Returns [B, T, heads, D] in ``values``' dtype. A query row with no visible key returns zeros.
    """
    batch, num_tokens, num_heads, head_dim = q.shape
    kv_heads = keys.shape[2]
    q = q.reshape(batch, num_tokens, kv_heads, num_heads // kv_heads, head_dim)
    scores = jnp.einsum("btkgd,bnkd->bkgtn", q, keys, preferred_element_type=jnp.float32)
    scores = scores * (head_dim ** -0.5)
    scores = jnp.where(mask[:, None, None], scores, _NEG_INF)
    if sinks is not None:
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, kv_heads, -1, 1, 1), (*scores.shape[:-1], 1))
        weights = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1] * mask[:, None, None]
    else:
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
                     sliding_window: int | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """Attention among the tokens of a sequence: q [B, T, heads, D], keys/values [B, T, kv_heads, D],
    positions int32[B, T]; ``sinks`` as ``grouped_query_attention``. Returns [B, T, heads, D]."""
    mask = visibility(positions, positions, jnp.ones(positions.shape, jnp.bool_), sliding_window)
    return grouped_query_attention(q, keys, values, mask, sinks)
