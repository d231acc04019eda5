"""``paged_attention`` on a decoder's mesh: under ``jax.shard_map`` each shard attends with its own
requests (whose blocks it holds) and its own heads, with the same kernel and no communication.

Outside a decoder's mesh trace (``scv_jax.sharding.mesh.tracing_on``) it is ``paged_attention``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from scv_jax.ops.attention.api import paged_attention
from scv_jax.ops.commit.kv_cache import PagedKVCache
from scv_jax.sharding.mesh import (DATA, REPLICATED, REQUESTS, active_mesh, cache_specs, heads_axis, per_shard,
                                   token_spec)


def sharded_paged_attention(q: jax.Array, cache: PagedKVCache, layer, block_tables: jax.Array,
                            context_lens: jax.Array, *, staged_keys=None, staged_values=None, staged_lens=None,
                            new_keys: jax.Array, new_values: jax.Array, sliding_window: int | None = None,
                            new_token_parents: jax.Array | None = None, sinks: jax.Array | None = None,
                            backend: str = "auto") -> jax.Array:
    """``paged_attention`` (same arguments), per (data, model) shard on the active mesh.

    Requests (rows of q, the block tables, lengths, staged and new K/V) split over "data", their block
    ids local to the shard's blocks; query and K/V heads split like the cache's (``heads_axis``), so a
    shard's query heads use exactly its own K/V heads (and their ``sinks``).
    """
    def attend(q, cache, layer, block_tables, context_lens, staged_keys, staged_values, staged_lens, new_keys,
               new_values, new_token_parents, sinks):
        return paged_attention(q, cache, layer, block_tables, context_lens, staged_keys=staged_keys,
                               staged_values=staged_values, staged_lens=staged_lens, new_keys=new_keys,
                               new_values=new_values, sliding_window=sliding_window,
                               new_token_parents=new_token_parents, sinks=sinks, backend=backend)

    args = (q, cache, layer, block_tables, context_lens, staged_keys, staged_values, staged_lens, new_keys, new_values,
            new_token_parents, sinks)
    if active_mesh() is None:
        return attend(*args)
    heads = heads_axis(cache)
    tokens = token_spec(heads)
    # staged K/V of this layer [B, S, kv_heads, D] or of all layers [layers, B, S, kv_heads, D]
    staged = None if staged_keys is None else (tokens if staged_keys.ndim == 4 else P(None, DATA, None, heads, None))
    specs = (tokens, cache_specs(cache), REPLICATED, REQUESTS, REQUESTS, staged, staged,
             None if staged_lens is None else REQUESTS, tokens, tokens,
             None if new_token_parents is None else REQUESTS, None if sinks is None else P(heads))
    return per_shard(attend, in_specs=specs, out_specs=tokens)(*args[:2], jnp.asarray(layer, jnp.int32), *args[3:])
