"""Index arithmetic of a ragged draft batch, shared by the references and the kernels.

A batch of B requests stores its drafts flattened in T slots; request b owns the slots
``cu[b]:cu[b + 1]``. The functions here clamp every offset into range, so malformed offsets never
index out of bounds: they work on scalars (inside kernels) and on arrays (in references) alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def request_span(cu_begin: jax.Array, cu_end: jax.Array, num_slots: int,
                 max_spec_len: int) -> tuple[jax.Array, jax.Array]:
    """The clamped (start, count) of requests whose offsets are ``cu_begin``, ``cu_end``.

    ``start`` is in [0, num_slots]; ``count`` in [0, min(max_spec_len, num_slots - start)].
    """
    start = jnp.clip(cu_begin, 0, num_slots)
    count = jnp.clip(cu_end - start, 0, max_spec_len)
    return start, jnp.minimum(count, num_slots - start)


def request_spans(cu: jax.Array, num_slots: int, max_spec_len: int) -> tuple[jax.Array, jax.Array]:
    """``request_span`` for every request: int32[B] starts and counts from int32[B + 1] offsets."""
    return request_span(cu[:-1], cu[1:], num_slots, max_spec_len)


def slot_owner(cu: jax.Array, num_slots: int) -> tuple[jax.Array, jax.Array]:
    """For each slot t in [0, T): the request that owns it and its position within that request.

    Returns int32[T] request indices (clamped to [0, B - 1]) and int32[T] positions; slots past
    ``cu[B]`` (padding) get the last request and a position >= its count.
    """
    num_requests = cu.shape[0] - 1
    slots = jnp.arange(num_slots, dtype=jnp.int32)
    owner = jnp.searchsorted(cu[1:], slots, side="right").astype(jnp.int32)
    owner = jnp.clip(owner, 0, max(num_requests - 1, 0))
    return owner, slots - jnp.clip(cu[owner], 0, num_slots)
