"""Token trees over a forward's new tokens: ancestor masks, depths and the ancestor bitmasks the attention
kernel reads.

``parents int32[B, T]``: new token i's parent is new token ``parents[b, i]`` (< i), or -1 for a root (a
child of the cache and staged prefix); parents outside [-1, i) read as -1. The chain is ``parents[i] =
i - 1``. New token i attends to the prefix and to its ancestors and itself (``ancestor_mask``), at
position prefix + ``depths``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

WORD_BITS = 32


def sanitized_parents(parents: jax.Array) -> jax.Array:
    """int32[B, T]: ``parents`` with entries outside [-1, i) replaced by -1."""
    index = jnp.arange(parents.shape[1], dtype=jnp.int32)[None, :]
    return jnp.where((parents >= -1) & (parents < index), parents, -1).astype(jnp.int32)


def ancestor_mask(parents: jax.Array) -> jax.Array:
    """bool[B, T, T]: ``[b, i, j]`` is True when new token j is i or an ancestor of i.

    Pointer doubling: from paths of length <= 1 (self and parent), ceil(log2(T - 1)) boolean squarings
    reach every ancestor (a path has at most T - 1 edges).
    """
    batch, tokens = parents.shape
    index = jnp.arange(tokens, dtype=jnp.int32)
    parents = sanitized_parents(parents)
    mask = (index[:, None] == index[None, :])[None] | (parents[:, :, None] == index[None, None, :])
    for _ in range(max(tokens - 2, 0).bit_length()):
        reach = jnp.einsum("bij,bjk->bik", mask.astype(jnp.float32), mask.astype(jnp.float32))
        mask = mask | (reach > 0)
    return mask


def depths(mask: jax.Array) -> jax.Array:
    """int32[B, T]: each new token's number of ancestors, from ``ancestor_mask``'s result."""
    return jnp.sum(mask, axis=2, dtype=jnp.int32) - 1


def ancestor_bits(mask: jax.Array) -> jax.Array:
    """int32[B, T, ceil(T / 32)]: ``ancestor_mask`` packed, bit j % 32 of word j // 32 = token j."""
    batch, tokens, _ = mask.shape
    words = -(-tokens // WORD_BITS)
    padded = jnp.pad(mask, ((0, 0), (0, 0), (0, words * WORD_BITS - tokens))).reshape(batch, tokens, words, WORD_BITS)
    weights = jnp.left_shift(jnp.uint32(1), jnp.arange(WORD_BITS, dtype=jnp.uint32))
    packed = jnp.sum(jnp.where(padded, weights, jnp.uint32(0)), axis=3, dtype=jnp.uint32)
    return lax.bitcast_convert_type(packed, jnp.int32)
