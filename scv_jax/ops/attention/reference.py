"""Pure-JAX reference of paged attention: online softmax over chunks of the block table.

The cache is read in chunks of block-table columns inside a ``lax.fori_loop`` whose trip count covers
the longest context of the batch, so the work grows with the real context, not with the table width,
and no float32 copy of the whole table is ever built: each chunk is gathered in the cache dtype and
upcast (and dequantised) only for its own matmul. The staged entries and the new tokens are one
last online-softmax step. Masked positions get probability 0 and their V rows are zeroed, so stale
non-finite bytes in partly used pages and empty or padded requests never produce NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.fp8 import dequantize, is_fp8
from pallas_kernels.tree_mask import ancestor_mask, depths
from scv_jax.ops.commit.kv_cache import PagedKVCache
from scv_jax.ops.commit.reference import as_stored

NEG = -1e30                 # finite floor of the running max: a fully masked chunk leaves (0, 0)
CHUNK_BYTES = 256 << 20     # float32 K + V bytes of one chunk (bounds the loop's temporaries)
MAX_CHUNK_TOKENS = 1024     # positions per chunk: short contexts in wide tables read little past their end


def default_chunk_tokens(batch: int, kv_heads: int, head_dim: int, block_size: int, max_blocks: int) -> int:
    """Context positions per loop step: a whole number of blocks, at most ``MAX_CHUNK_TOKENS``, holding at
    most ``CHUNK_BYTES`` of float32 K and V for the batch (at least one block), at most the whole table."""
    per_position = 2 * 4 * max(batch, 1) * kv_heads * head_dim
    positions = min(MAX_CHUNK_TOKENS, CHUNK_BYTES // per_position)
    return min(max(1, positions // block_size), max(max_blocks, 1)) * block_size


def _read_chunk(pages: jax.Array, scale: jax.Array | None, cache: PagedKVCache, layer: jax.Array,
                blocks: jax.Array) -> jax.Array:
    """[B, C * block_size, kv_heads, head_dim] entries of ``blocks`` int32[B, C] of ``layer``: the cache
    dtype when unscaled, else dequantised float32.

    fp8 pages are gathered as uint8: XLA:CPU would otherwise convert all layers' pages to float16 first.
    """
    if is_fp8(pages.dtype):
        values = lax.bitcast_convert_type(lax.bitcast_convert_type(pages, jnp.uint8)[layer, blocks], pages.dtype)
    else:
        values = pages[layer, blocks]                               # NHD [B, C, BS, H, D]; HND [B, C, H, BS, D]
    if cache.layout == "HND":
        values = jnp.swapaxes(values, 2, 3)
    batch, columns, block_size, heads, head_dim = values.shape
    values = values.reshape(batch, columns * block_size, heads, head_dim)
    if cache.scale_mode is None:
        return values
    if cache.scale_mode == "head":
        scale = scale[:, None]
    elif cache.scale_mode == "token_head":
        scale = scale[layer, blocks].reshape(batch, columns * block_size, heads, 1)
    return dequantize(values, scale)


def in_flight_kv(cache: PagedKVCache, staged_keys: jax.Array | None, staged_values: jax.Array | None,
                 new_keys: jax.Array, new_values: jax.Array) -> tuple:
    """(staged_keys, staged_values, new_keys, new_values) as the cache will hold them once committed
    (``as_stored`` with the cache's K and V scales; staged None stays None): every attention path reads
    in-flight tokens this way, so a query sees a key the same before and after its commit."""
    def stored(x, scale):
        return None if x is None else as_stored(x, cache, scale)

    return (stored(staged_keys, cache.k_scale), stored(staged_values, cache.v_scale),
            stored(new_keys, cache.k_scale), stored(new_values, cache.v_scale))


def _visible(query_positions: jax.Array, key_positions: jax.Array, key_valid: jax.Array,
             sliding_window: int | None) -> jax.Array:
    """bool[B, T, N]: valid keys at or before each query position int32[B, T] (and inside the window).

    key_positions, key_valid: int32/bool broadcastable to [B, N]."""
    q, k = query_positions[:, :, None], key_positions[:, None, :]
    visible = key_valid[:, None, :] & (k <= q)
    if sliding_window is not None:
        visible &= k > q - sliding_window
    return visible


def _softmax_step(carry, q: jax.Array, keys: jax.Array, values: jax.Array, visible: jax.Array):
    """One online-softmax update.

    carry: (acc float32[B, kv, G, T, D], m, l float32[B, kv, G, T]); q: [B, T, kv, G, D];
    keys, values: [B, N, kv, D]; visible: bool[B, T, N].
    """
    acc, m, l = carry
    visible = visible[:, None, None]                                                    # [B, 1, 1, T, N]
    scores = jnp.einsum("btkgd,bnkd->bkgtn", q, keys, preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
    scores = jnp.where(visible, scores, NEG)
    m_new = jnp.maximum(m, scores.max(axis=-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(visible, jnp.exp(scores - m_new[..., None]), 0.0)
    values = jnp.where(jnp.any(visible, axis=(1, 2, 3))[:, :, None, None], values, jnp.zeros((), values.dtype))
    pv = jnp.einsum("bkgtn,bnkd->bkgtd", p, values, preferred_element_type=jnp.float32)
    return acc * alpha[..., None] + pv, m_new, l * alpha + p.sum(axis=-1)


def paged_attention_reference(q: jax.Array, cache: PagedKVCache, layer: jax.Array, block_tables: jax.Array,
                              context_lens: jax.Array, staged_keys: jax.Array | None,
                              staged_values: jax.Array | None, staged_lens: jax.Array | None,
                              new_keys: jax.Array, new_values: jax.Array, *, sliding_window: int | None = None,
                              new_token_parents: jax.Array | None = None, sinks: jax.Array | None = None,
                              chunk_tokens: int | None = None) -> jax.Array:
    """Attention of ``q`` [B, T, heads, D] over the cache, the staged entries and the new tokens.

    Query t of request b attends to cache positions < ``context_lens[b]``, staged entries <
    ``staged_lens[b]`` (``staged_keys``: this layer's [B, S, kv_heads, D]) and new tokens <= t, within
    ``sliding_window`` (see ``scv_jax.ops.attention.api.paged_attention``); with ``new_token_parents``
    int32[B, T] (a tree over the new tokens, ``pallas_kernels.tree_mask``) new token t attends to its
    ancestors and itself only, at position context + staged + its depth. Lengths are clamped into
    range, block ids into [0, num_blocks), ``layer`` into [0, layers). Chunks wholly outside every
    query's window are skipped. ``chunk_tokens`` (a multiple of block_size) overrides the positions
    read per loop step. Staged and new K/V are read as the cache will hold them (``as_stored``).
    ``sinks`` [heads]: one more logit per head in every query's softmax, with a zero value.
    Returns [B, T, heads, D] in q's dtype.
    """
    staged_keys, staged_values, new_keys, new_values = in_flight_kv(cache, staged_keys, staged_values,
                                                                    new_keys, new_values)
    batch, tokens, heads, head_dim = q.shape
    kv_heads, block_size = cache.num_kv_heads, cache.block_size
    group = heads // kv_heads
    max_blocks = block_tables.shape[1]
    chunk_tokens = chunk_tokens or default_chunk_tokens(batch, kv_heads, head_dim, block_size, max_blocks)
    columns = chunk_tokens // block_size
    layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, cache.num_layers - 1)
    context_lens = jnp.clip(context_lens.astype(jnp.int32), 0, max_blocks * block_size)
    capacity = 0 if staged_keys is None else staged_keys.shape[1]
    staged_lens = (jnp.zeros_like(context_lens) if staged_keys is None
                   else jnp.clip(staged_lens.astype(jnp.int32), 0, capacity))
    ancestors = None if new_token_parents is None else ancestor_mask(new_token_parents)      # [B, T, T]
    base = (context_lens + staged_lens)[:, None]
    query_positions = base + (jnp.arange(tokens, dtype=jnp.int32) if ancestors is None else depths(ancestors))  # [B, T]
    queries = q.reshape(batch, tokens, kv_heads, group, head_dim)
    carry = (jnp.zeros((batch, kv_heads, group, tokens, head_dim), jnp.float32),
             jnp.full((batch, kv_heads, group, tokens), NEG, jnp.float32),
             jnp.zeros((batch, kv_heads, group, tokens), jnp.float32))

    if max_blocks:
        num_chunks = -(-max_blocks // columns)
        tables = jnp.pad(jnp.clip(block_tables.astype(jnp.int32), 0, cache.num_blocks - 1),
                         ((0, 0), (0, num_chunks * columns - max_blocks)))
        first_chunk = 0
        if sliding_window is not None:   # the earliest position any query's window reaches
            first_chunk = jnp.maximum(jnp.min(query_positions[:, 0]) - sliding_window + 1, 0) // chunk_tokens

        def chunk_step(j, carry):
            blocks = lax.dynamic_slice_in_dim(tables, j * columns, columns, axis=1)
            keys = _read_chunk(cache.k_pages, cache.k_scale, cache, layer, blocks)
            values = _read_chunk(cache.v_pages, cache.v_scale, cache, layer, blocks)
            positions = j * chunk_tokens + jnp.arange(chunk_tokens, dtype=jnp.int32)
            visible = _visible(query_positions, positions[None], positions[None] < context_lens[:, None],
                               sliding_window)
            return _softmax_step(carry, queries, keys, values, visible)

        carry = lax.fori_loop(first_chunk, -(-jnp.max(context_lens) // chunk_tokens), chunk_step, carry)

    # (keys, values, positions, valid) of the staged entries and the new tokens, attended in one step
    sources = [(new_keys, new_values, query_positions, jnp.ones(query_positions.shape, jnp.bool_))]
    if staged_keys is not None:
        slots = jnp.arange(capacity, dtype=jnp.int32)
        sources.insert(0, (staged_keys, staged_values, context_lens[:, None] + slots,
                           slots[None, :] < staged_lens[:, None]))
    keys, values, positions, valid = ([source[i] for source in sources] for i in range(4))
    promote = lambda parts: jnp.concatenate([x.astype(jnp.result_type(*parts)) for x in parts], axis=1)  # noqa: E731
    visible = _visible(query_positions, promote(positions), promote(valid), sliding_window)
    if ancestors is not None:   # the new tokens (the last T keys): ancestors and self only
        visible = visible.at[:, :, -tokens:].set(visible[:, :, -tokens:] & ancestors)
    acc, m, l = _softmax_step(carry, queries, promote(keys), promote(values), visible)
    if sinks is not None:     # the sink: exp(sink - m) more in the denominator (m rescaled if the sink is larger)
        sink = sinks.astype(jnp.float32).reshape(1, kv_heads, group, 1)
        m_new = jnp.maximum(m, sink)
        alpha = jnp.exp(m - m_new)
        acc, l = acc * alpha[..., None], l * alpha + jnp.exp(sink - m_new)
    out = acc / l[..., None]                          # l > 0: every query sees its own token
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, tokens, heads, head_dim).astype(q.dtype)
