"""Per-slot random numbers for rejection sampling, derived from user keys.

Slot i of request b uses ``fold_in(key_b, i)``: with one key per request, a request's numbers do not
depend on the rest of the batch. A single key is first split per request with ``fold_in(key, b)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_batch import slot_owner
from pallas_kernels.sampling_math import bits_to_unit_interval


def normalize_keys(op: str, key, num_requests: int) -> jax.Array:
    """Typed keys [B] from one key or B keys, typed (``jax.random.key``) or legacy uint32."""
    if key is None:
        raise ValueError(f"{op}: key is required for sampling (one jax.random.key or B keys)")
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.dtype != jnp.uint32 or key.ndim not in (1, 2) or key.shape[-1] != 2:
            raise ValueError(f"{op}: key must be a typed PRNG key (jax.random.key) or legacy uint32[2] / "
                             f"uint32[B, 2] key data, got shape {key.shape} dtype {key.dtype}")
        key = jax.random.wrap_key_data(key)
    if key.ndim == 0:
        return jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(num_requests, dtype=jnp.uint32))
    if key.shape != (num_requests,):
        raise ValueError(f"{op}: key must be one key or {num_requests} keys (one per request), "
                         f"got {key.shape[0] if key.ndim else 1} keys of shape {key.shape}")
    return key


def slot_randomness(keys: jax.Array, cu: jax.Array, num_slots: int) -> tuple[jax.Array, jax.Array]:
    """float32[T] acceptance uniforms in (0, 1) and uint32[T] resampling seeds, one per slot."""
    if keys.shape[0] == 0:
        return jnp.full((num_slots,), 0.5, jnp.float32), jnp.zeros((num_slots,), jnp.uint32)
    owner, position = slot_owner(cu, num_slots)
    slot_keys = jax.vmap(jax.random.fold_in)(keys[owner], position.astype(jnp.uint32))
    bits = jax.vmap(lambda k: jax.random.bits(k, (2,), jnp.uint32))(slot_keys)
    return bits_to_unit_interval(bits[:, 0]), bits[:, 1]
