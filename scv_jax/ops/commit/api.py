"""No write on reject: commit the accepted draft tokens' K/V into a ``PagedKVCache`` in place.

The target computes K/V for the pending token and all drafts during verification; verification
attention reads them from a staging buffer (``new_keys``/``new_values``), never from the cache.
After acceptance, ``commit_draft_kv`` writes only the accepted tokens, all layers in one kernel
launch. Every byte of the cache outside the written slots stays bit-identical.

For an in-place update, donate the cache::

    commit = jax.jit(scv_jax.commit_draft_kv, donate_argnums=0)
    cache = commit(cache, new_keys, new_values, slot_mapping, accept_mask)

Implementations (``scv_jax.ops.registry``): "pallas" = ``pallas_kernels.commit_kv`` (needs
``kv_heads * head_dim`` to fit its thread layout, see ``unsupported_reason`` there), "xla" =
``reference`` (a donated scatter).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from scv_jax.arguments import require_int
from scv_jax.checks import (as_array, require_floating, require_int_vector, require_integer,
                            require_rank)
from scv_jax.ops import registry
from scv_jax.ops.commit import reference
from scv_jax.ops.commit.kv_cache import PagedKVCache

INPUT_DTYPES: tuple[np.dtype, ...] = (np.dtype(jnp.float32), np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
_TOKENS_DOC = "[layers, T, kv_heads, head_dim] float32/float16/bfloat16"


def _kernel_unsupported(*, num_kv_heads: int, head_dim: int, itemsizes: tuple[int, ...]) -> str:
    from pallas_kernels.commit_kv import unsupported_reason
    return unsupported_reason(num_kv_heads, head_dim, itemsizes)


def _commit_kernel(cache: PagedKVCache, new_keys: jax.Array, new_values: jax.Array, slots: jax.Array, *,
                   interpret: bool) -> PagedKVCache:
    from pallas_kernels.commit_kv import commit_kv_kernel
    k_scale, v_scale = cache.k_scale, cache.v_scale
    if cache.scale_mode == "tensor":
        k_scale, v_scale = k_scale.reshape(1), v_scale.reshape(1)
    k_pages, v_pages, k_out, v_out = commit_kv_kernel(
        cache.k_pages, cache.v_pages, k_scale, v_scale, new_keys, new_values, slots,
        layout=cache.layout, scale_mode=cache.scale_mode, interpret=interpret)
    fields = dict(k_pages=k_pages, v_pages=v_pages)
    if cache.scale_mode == "token_head":
        fields.update(k_scale=k_out, v_scale=v_out)
    return dataclasses.replace(cache, **fields)


registry.register("commit_draft_kv", registry.Implementation("pallas", _commit_kernel, _kernel_unsupported),
                  registry.Implementation("xla", reference.commit_reference))


def _require_cache(op: str, cache: Any) -> PagedKVCache:
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"{op}: cache must be a scv_jax.PagedKVCache, got {type(cache).__name__}")
    return cache.validated(op)


def _check_tokens(op: str, name: str, x: Any, cache: PagedKVCache) -> None:
    require_rank(op, name, x, 4, _TOKENS_DOC)
    require_floating(op, name, x, _TOKENS_DOC)
    if np.dtype(jnp.result_type(x)) not in INPUT_DTYPES:
        raise TypeError(f"{op}: {name} must be {_TOKENS_DOC}, got dtype {jnp.result_type(x)}")
    layers, _, heads, head_dim = np.shape(x)
    expected = {"layers": (layers, cache.num_layers), "kv_heads": (heads, cache.num_kv_heads),
                "head_dim": (head_dim, cache.head_dim)}
    for dim, (got, want) in expected.items():
        if got != want:
            raise ValueError(f"{op}: {name} must be {_TOKENS_DOC} with {dim}={want} to match the cache, "
                             f"got shape {tuple(np.shape(x))}")


def commit_draft_kv(cache: PagedKVCache, new_keys, new_values, slot_mapping, accept_mask=None, *,
                    backend: str = "auto") -> PagedKVCache:
    """Writes the accepted tokens' K/V of all layers into the cache.

    Args:
      cache: the paged cache (donate it under ``jax.jit`` for an in-place update).
      new_keys, new_values: [layers, T, kv_heads, head_dim] float32/float16/bfloat16 staged K/V.
      slot_mapping: int32[T]; slot = block * block_size + offset. Negative slots (and slots >=
        num_blocks * block_size) are skipped. Non-skipped slots must be distinct (a caller error
        otherwise; ``check_slot_mapping`` checks it on the host).
      accept_mask: bool[T] or None (all accepted); False is skipped.
      backend: "auto", "pallas", "xla" or "interpret" (see ``scv_jax.ops.registry``).
    Returns:
      The cache with the accepted tokens written (quantised per the cache's dtype and scale mode;
      "token_head" also writes their scales). Nothing else changes.
    """
    op = "commit_draft_kv"
    cache = _require_cache(op, cache)
    new_keys, new_values, slot_mapping = (as_array(op, name, x) for name, x in (
        ("new_keys", new_keys), ("new_values", new_values), ("slot_mapping", slot_mapping)))
    if accept_mask is not None:
        accept_mask = as_array(op, "accept_mask", accept_mask)
    _check_tokens(op, "new_keys", new_keys, cache)
    _check_tokens(op, "new_values", new_values, cache)
    if np.shape(new_keys) != np.shape(new_values):
        raise ValueError(f"{op}: new_values must have new_keys' shape {tuple(np.shape(new_keys))}, "
                         f"got {tuple(np.shape(new_values))}")
    num_tokens = np.shape(new_keys)[1]
    require_int_vector(op, "slot_mapping", slot_mapping, num_tokens, "int32[T] (T = new_keys.shape[1])")
    if accept_mask is not None:
        require_rank(op, "accept_mask", accept_mask, 1, "bool[T]")
        if np.shape(accept_mask)[0] != num_tokens or not (
                jnp.issubdtype(jnp.result_type(accept_mask), jnp.bool_)
                or jnp.issubdtype(jnp.result_type(accept_mask), jnp.integer)):
            raise ValueError(f"{op}: accept_mask must be bool[T] with T={num_tokens}, got shape "
                             f"{tuple(np.shape(accept_mask))} dtype {jnp.result_type(accept_mask)}")
    impl = registry.select(op, backend, num_kv_heads=cache.num_kv_heads, head_dim=cache.head_dim,
                           itemsizes=(jnp.result_type(new_keys).itemsize, jnp.result_type(new_values).itemsize,
                                      cache.dtype.itemsize))
    if num_tokens == 0:
        return cache
    return _commit(cache, jnp.asarray(new_keys), jnp.asarray(new_values), jnp.asarray(slot_mapping),
                   None if accept_mask is None else jnp.asarray(accept_mask), impl=impl)


@functools.partial(jax.jit, static_argnames=("impl",))
def _commit(cache: PagedKVCache, new_keys, new_values, slot_mapping, accept_mask, *,
            impl: registry.Selected) -> PagedKVCache:
    return impl(cache, new_keys, new_values, reference.effective_slots(slot_mapping, accept_mask, cache.num_slots))


def gather_kv(cache: PagedKVCache, slots) -> tuple[jax.Array, jax.Array]:
    """Reads tokens back, dequantised: float32 [layers, len(slots), kv_heads, head_dim] keys and values.

    Slots outside [0, num_blocks * block_size) read as zeros.
    """
    op = "gather_kv"
    cache = _require_cache(op, cache)
    require_int_vector(op, "slots", slots, None, "int32[S]")
    return reference.gather_reference(cache, jnp.asarray(slots))


def slots_from_block_table(block_table, positions, block_size: int) -> jax.Array:
    """Slots of token positions: ``block_table[..., pos // block_size] * block_size + pos % block_size``.

    Args:
      block_table: int32[B, max_blocks] (or [max_blocks]) physical block of each logical block;
        negative = unallocated.
      positions: int32[B, S] (or [S]) token positions; negative = padding.
      block_size: tokens per block (static).
    Returns:
      int32[B, S] (or [S]) slots; -1 where the position is negative, past the table, or in an
      unallocated block (skipped by ``commit_draft_kv``).
    """
    op = "slots_from_block_table"
    if isinstance(block_size, PagedKVCache):
        block_size = block_size.block_size
    block_size = require_int(op, "block_size", block_size, minimum=1, static=True)
    require_integer(op, "block_table", block_table, "int32[B, max_blocks]")
    require_integer(op, "positions", positions, "int32[B, S]")
    if np.ndim(block_table) not in (1, 2) or np.ndim(positions) != np.ndim(block_table) or (
            np.ndim(block_table) == 2 and np.shape(block_table)[0] != np.shape(positions)[0]):
        raise ValueError(f"{op}: block_table must be int32[B, max_blocks] with positions int32[B, S] "
                         f"(or [max_blocks] with [S]), got shapes {tuple(np.shape(block_table))} and "
                         f"{tuple(np.shape(positions))}")
    table = jnp.asarray(block_table, jnp.int32)
    pos = jnp.asarray(positions, jnp.int32)
    max_blocks = table.shape[-1]
    logical = jnp.where(pos >= 0, pos // block_size, max_blocks)
    in_table = logical < max_blocks
    if max_blocks == 0:
        return jnp.full(pos.shape, -1, jnp.int32)
    block = jnp.take_along_axis(table, jnp.minimum(logical, max_blocks - 1), axis=-1)
    valid = in_table & (block >= 0)
    return jnp.where(valid, block * block_size + pos % block_size, -1)
