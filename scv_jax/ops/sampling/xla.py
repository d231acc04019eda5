"""The XLA implementation of ``filtered_probs``: the reference's result from one cut-off per row.

Each filter keeps a row's largest values (top-k: >= the k-th; top-p: >= the last token of the
prefix; min-p: exp(z) >= min_p at the maximum's z = 0), so the three make one mask. The top-k and
top-p cut-offs need the row in descending order, but only its first ``candidates`` values when the
cut-offs fall inside them: ``lax.top_k`` of that many (~15x cheaper than a full sort on CPU at
V = 152k). Where some row's cut-off lies beyond (a large k, a flat distribution with a top_p near 1),
every row's cut-offs come from a bisection over float32's order instead (``lax.cond``): 32 masked
sums for each filter, exact, and no sort. Neither runs when no sampled row uses top-k or top-p.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from scv_jax.ops.sampling.reference import effective_top_k, finish, scaled_logits

CANDIDATES = 256   # how many of a row's largest values the top-k / top-p cut-offs look at first


def _cutoffs(descending: jax.Array, z: jax.Array, top_k: jax.Array, top_p: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(float32[R, 1] the top-k and top-p cut-off of z, bool[R] whether it was found), given
    ``descending`` float32[R, K]: each row's K largest values of z in descending order."""
    vocab_size, width = z.shape[-1], descending.shape[-1]
    k = effective_top_k(top_k, vocab_size)
    top_k_on, top_p_on = k < vocab_size, top_p < 1
    kth = jnp.take_along_axis(descending, jnp.minimum(k, width)[:, None] - 1, axis=-1)
    kth = jnp.where(top_k_on[:, None], kth, -jnp.inf)
    total = jnp.sum(jnp.where(z >= kth, jnp.exp(z), 0.0), axis=-1, keepdims=True)
    in_top_k = descending >= kth
    probs = jnp.where(in_top_k, jnp.exp(descending), 0.0) / jnp.where(total > 0, total, 1.0)
    kept = ((jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]) & in_top_k
    last = jnp.maximum(jnp.sum(kept, axis=-1) - 1, 0)
    top_p_cut = jnp.take_along_axis(descending, last[:, None], axis=-1)
    cutoff = jnp.where(top_p_on[:, None], jnp.maximum(top_p_cut, kth), kth)
    found = (~top_k_on | (k <= width)) & (~top_p_on | ~kept[:, -1] | (width == vocab_size))
    return cutoff, found


def _order_keys(x: jax.Array) -> jax.Array:
    """uint32 keys in float32's order (-inf lowest; +0.0 is 2**31): x <= y iff key(x) <= key(y), no NaN."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _from_order_key(key: jax.Array) -> jax.Array:
    bits = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _smallest_key_below(keys: jax.Array, weights: jax.Array, threshold: jax.Array) -> jax.Array:
    """uint32[R, 1]: the smallest key t <= key(0.0) with sum(weights where keys > t) < threshold (float32[R]),
    by bisection; key(0.0) where there is none. With keys of values <= 0 it is a key of the row."""
    def step(_, bounds):
        low, high = bounds
        middle = low + (high - low) // 2
        below = jnp.sum(jnp.where(keys > middle, weights, 0.0), axis=-1, keepdims=True) < threshold[:, None]
        return jnp.where(below, low, middle), jnp.where(below, middle, high)
    low = jnp.zeros((keys.shape[0], 1), jnp.uint32)
    _, high = lax.fori_loop(0, 32, step, (low, jnp.full_like(low, 1 << 31)))
    return high


def _bisected_cutoffs(z: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """float32[R, 1]: ``_cutoffs``' cut-offs found without sorting: the k-th largest value is the
    smallest with fewer than k values above it, top-p's the smallest with less than top_p of the
    top-k mass above it."""
    vocab_size = z.shape[-1]
    keys = _order_keys(z)
    k = effective_top_k(top_k, vocab_size)
    keep_all = _order_keys(jnp.float32(-jnp.inf))
    kth = jnp.where((k < vocab_size)[:, None],
                    _smallest_key_below(keys, jnp.ones_like(z), k.astype(jnp.float32)), keep_all)
    weights = jnp.where(keys >= kth, jnp.exp(z), 0.0)
    total = jnp.sum(weights, axis=-1)
    top_p_cut = jnp.where((top_p < 1)[:, None], _smallest_key_below(keys, weights, top_p * total), keep_all)
    return _from_order_key(jnp.maximum(kth, top_p_cut))


def filtered_probs_xla(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                       min_p: jax.Array, *, candidates: int = CANDIDATES) -> jax.Array:
    """float32[R, V]: ``reference.filtered_probs_reference`` of float[R, V] ``logits`` and [R] parameters."""
    vocab_size = logits.shape[-1]
    z = scaled_logits(logits, temperature)
    sampled = temperature > 0
    needs_sort = jnp.any(sampled & ((effective_top_k(top_k, vocab_size) < vocab_size) | (top_p < 1)))
    width = min(candidates, vocab_size)

    def sorted_cutoff() -> jax.Array:
        cutoff, found = _cutoffs(lax.top_k(z, width)[0], z, top_k, top_p)
        return lax.cond(jnp.all(found | ~sampled), lambda: cutoff, lambda: _bisected_cutoffs(z, top_k, top_p))

    cutoff = lax.cond(needs_sort, sorted_cutoff, lambda: jnp.full((z.shape[0], 1), -jnp.inf, jnp.float32))
    weights = jnp.exp(z)
    floor = jnp.where(min_p > 0, jnp.minimum(min_p, 1.0), 0.0)[:, None]
    keep = (z >= cutoff) & (weights >= floor)
    return finish(jnp.where(keep, weights, 0.0), logits, temperature)
