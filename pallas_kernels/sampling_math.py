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


def argmax_ignoring_nan(x: jax.Array) -> jax.Array:
    """int32 first index of the maximum along the last axis, NaN never winning.

    Equals ``jnp.argmax(jnp.where(jnp.isnan(x), -inf, x), axis=-1)``: a row of only NaN and -inf
    gives 0. Computed as the row maximum, then the first index equal to it (two vectorisable
    reductions; XLA:CPU runs a fused variadic argmax several times slower).
    """
    clean = jnp.where(jnp.isnan(x), -jnp.inf, x)
    best = jnp.max(clean, axis=-1, keepdims=True)
    index = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(clean == best, index, x.shape[-1]), axis=-1)
