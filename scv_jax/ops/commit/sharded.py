"""``commit_draft_kv`` on a decoder's mesh: under ``jax.shard_map`` each shard commits its requests'
rows of its own K/V heads into its own blocks, with the same kernel and no communication.

Outside a decoder's mesh trace (``scv_jax.sharding.mesh.tracing_on``) it is ``commit_draft_kv``.
"""

from __future__ import annotations

import functools

import jax

from scv_jax.ops.commit.api import commit_draft_kv
from scv_jax.ops.commit.kv_cache import PagedKVCache
from scv_jax.sharding.mesh import REQUESTS, active_mesh, cache_specs, heads_axis, per_shard, rows_spec


def sharded_commit_draft_kv(cache: PagedKVCache, new_keys: jax.Array, new_values: jax.Array,
                            slot_mapping: jax.Array, accept_mask: jax.Array | None = None, *,
                            backend: str = "auto") -> PagedKVCache:
    """``commit_draft_kv`` (same arguments), per (data, model) shard on the active mesh.

    The T rows of ``new_keys``/``new_values`` [layers, T, kv_heads, head_dim], ``slot_mapping`` and
    ``accept_mask`` [T] are split evenly over "data" (a shard's rows are its requests'), and their slots
    are local to that shard's blocks; kv_heads are split like the cache's (``heads_axis``).
    """
    commit = functools.partial(commit_draft_kv, backend=backend)
    if active_mesh() is None:
        return commit(cache, new_keys, new_values, slot_mapping, accept_mask)
    specs = cache_specs(cache)
    rows = rows_spec(heads_axis(cache))
    return per_shard(commit, in_specs=(specs, rows, rows, REQUESTS, None if accept_mask is None else REQUESTS),
                     out_specs=specs)(cache, new_keys, new_values, slot_mapping, accept_mask)
