"""Random numbers and the acceptance rule of rejection sampling, shared by reference and kernels.

Resampling from norm(max(p - q, 0)) uses the exponential race: token v wins with probability
proportional to w_v when the winner is argmax_v w_v / E_v with E_v ~ Exp(1) independent. E_v comes
from a counter-based hash of (per-slot seed, v), so a kernel tiled over the vocabulary needs no
random state and every backend draws the same numbers.

Winners (of a race, or of a greedy argmax over logits) follow one rule everywhere: the first index
of the maximum, where NaN never wins (``argmax_ignoring_nan``). The kernels implement it with a
strict ``>`` running best in vocabulary order, so the result does not depend on how the vocabulary
is split into tiles and CTAs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# Weight of p in the race weights: a rejected draft whose residual max(p - q, 0) is all zero
# (degenerate input, e.g. p == q with q(x) = 0) resamples from p instead of returning token 0.
FALLBACK_P_WEIGHT = 1e-30


def _fmix32(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser: a bijective avalanche mix of uint32 values."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def bits_to_unit_interval(bits: jax.Array) -> jax.Array:
    """uint32 -> float32 uniform in the open interval (0, 1) (24 random bits, centred)."""
    return ((bits >> 8).astype(jnp.float32) + 0.5) * (1.0 / 16777216.0)


def hash_uniform(seed: jax.Array, index: jax.Array) -> jax.Array:
    """Uniform (0, 1) float32 numbers indexed by (uint32 seed, int32 index); broadcasts."""
    mixed = _fmix32(index.astype(jnp.uint32) * jnp.uint32(0x9E3779B9) + jnp.uint32(0x7F4A7C15))
    return bits_to_unit_interval(_fmix32(seed ^ mixed))


def race_weights(target_probs: jax.Array, draft_probs: jax.Array) -> jax.Array:
    """float32 weights of the residual distribution max(p - q, 0), with a tiny p fallback."""
    p = target_probs.astype(jnp.float32)
    return jnp.maximum(p - draft_probs.astype(jnp.float32), 0.0) + FALLBACK_P_WEIGHT * p


def race_scores(weights: jax.Array, seed: jax.Array, token_ids: jax.Array) -> jax.Array:
    """Exponential-race scores w_v / E_v; the argmax is a sample from norm(w)."""
    return weights / -jnp.log(hash_uniform(seed, token_ids))


def accepts_draft(uniform: jax.Array, p_draft: jax.Array, q_draft: jax.Array,
                  draft_in_vocab: jax.Array) -> jax.Array:
    """Accept iff u < p(x) / q(x); q(x) = 0 or an out-of-vocabulary draft is a rejection."""
    p_draft = p_draft.astype(jnp.float32)
    q_draft = q_draft.astype(jnp.float32)
    return draft_in_vocab & (q_draft > 0) & (uniform * q_draft < p_draft)


ARGMAX_BLOCK = 128


def _first_true(mask: jax.Array) -> jax.Array:
    """int32 index of the first True along the last axis (0 when there is none)."""
    return jnp.argmax(mask, axis=-1).astype(jnp.int32)


def _first_index_of_max(values: jax.Array, block_max: jax.Array) -> jax.Array:
    """The first index of the row maximum of NaN-free ``values`` [rows, n], given its block maxima."""
    n = values.shape[1]
    best = jnp.max(block_max, axis=-1, keepdims=True)
    # The window of the first block holding the maximum, shifted back to end at n for the last one:
    # the elements it borrows from the previous block are all below the maximum.
    start = jnp.minimum(_first_true(block_max == best) * ARGMAX_BLOCK, n - ARGMAX_BLOCK)
    window = jnp.take_along_axis(values, start[:, None] + jnp.arange(ARGMAX_BLOCK, dtype=jnp.int32)[None], axis=-1)
    return start + _first_true(window == best)


def _block_max(values: jax.Array) -> jax.Array:
    """Maxima of the ``ARGMAX_BLOCK``-element blocks of each row (the last block may be shorter)."""
    rows, n = values.shape
    whole = n // ARGMAX_BLOCK * ARGMAX_BLOCK
    block_max = jnp.max(values[:, :whole].reshape(rows, -1, ARGMAX_BLOCK), axis=-1)
    if whole == n:
        return block_max
    return jnp.concatenate([block_max, jnp.max(values[:, whole:], axis=-1, keepdims=True)], axis=-1)


def argmax_ignoring_nan(x: jax.Array) -> jax.Array:
    """int32 first index of the maximum along the last axis of a [rows, n] array, NaN never winning.

    Equals ``jnp.argmax(jnp.where(jnp.isnan(x), -inf, x), axis=-1)``: a row of only NaN and -inf gives
    0. Computed in blocks of ``ARGMAX_BLOCK``: the maximum of every block (one streaming pass), the
    first block holding the row maximum, and the first index equal to it inside that block. (XLA:CPU
    runs a variadic argmax over [rows, n] ~10x slower.) On CPU, where a reduction over NaN-cleaned
    values materialises them first (~10x slower than the reductions below), a sum of ``x`` tells
    whether it holds a NaN (or +inf and -inf); only then are the NaN-cleaned values used, otherwise
    the block maxima are taken over ``x`` itself. (XLA:CPU's vectorised max does not reliably
    propagate NaN, so the block maxima cannot tell.)
    """
    clean = lambda: jnp.where(jnp.isnan(x), -jnp.inf, x)  # noqa: E731
    if x.shape[1] < ARGMAX_BLOCK:
        values = clean()
        return _first_true(values == jnp.max(values, axis=-1, keepdims=True))

    def cleaned():
        values = clean()
        return _first_index_of_max(values, _block_max(values))

    def checked():
        return lax.cond(jnp.isnan(jnp.sum(x, dtype=jnp.float32)), cleaned,
                        lambda: _first_index_of_max(x, _block_max(x)))

    return lax.platform_dependent(cpu=checked, default=cleaned)
