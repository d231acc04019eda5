"""``paged_attention``: the attention of one layer's queries over the paged cache, the staging buffer
and the new tokens, as the target's verify forward and the draft's forwards need it.

Implementations (``scv_jax.ops.registry``): "pallas" = ``pallas_kernels.paged_attention`` (a Mosaic GPU
kernel; head_dim 64/128/192/256 and the block sizes in ``unsupported_reason`` there), "xla" =
``reference`` (online softmax over chunks of the block table, any platform and shape).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.tree_mask import ancestor_bits, ancestor_mask, depths
from scv_jax.arguments import require_int
from scv_jax.checks import (as_array, require_floating, require_int_vector, require_integer,
                            require_rank)
from scv_jax.ops import registry
from scv_jax.ops.attention import reference
from scv_jax.ops.commit.kv_cache import PagedKVCache

OP = "paged_attention"
INPUT_DTYPES: tuple[np.dtype, ...] = (np.dtype(jnp.float32), np.dtype(jnp.float16), np.dtype(jnp.bfloat16))


def _kernel_unsupported(**facts: Any) -> str:
    from pallas_kernels.paged_attention import unsupported_reason
    return unsupported_reason(**facts)


def _attention_kernel(q, cache: PagedKVCache, layer, block_tables, context_lens, staged_keys, staged_values,
                      staged_lens, new_keys, new_values, *, sliding_window: int | None,
                      new_token_parents: jax.Array | None = None, sinks: jax.Array | None = None,
                      interpret: bool) -> jax.Array:
    from pallas_kernels.paged_attention import paged_attention_kernel, precise_products
    extra = (staged_keys, staged_values, new_keys, new_values)
    precise = precise_products(q.dtype, cache.dtype, tuple(x.dtype for x in extra if x is not None))
    extra = reference.in_flight_kv(cache, *extra)
    if not precise:   # bf16 operands: the kernel rounds the (float32) dequantised values to bf16 anyway
        extra = tuple(None if x is None else x.astype(jnp.bfloat16) for x in extra)
    staged_keys, staged_values, new_keys, new_values = extra
    k_scale, v_scale = cache.k_scale, cache.v_scale
    if cache.scale_mode == "tensor":
        k_scale, v_scale = k_scale.reshape(1), v_scale.reshape(1)
    return paged_attention_kernel(q, cache.k_pages, cache.v_pages, k_scale, v_scale, layer, block_tables,
                                  context_lens, staged_keys, staged_values, staged_lens, new_keys, new_values,
                                  layout=cache.layout, scale_mode=cache.scale_mode, sliding_window=sliding_window,
                                  tree_bits=None if new_token_parents is None else ancestor_bits(
                                      ancestor_mask(new_token_parents)),
                                  sinks=sinks, interpret=interpret)


registry.register(OP, registry.Implementation("pallas", _attention_kernel, _kernel_unsupported),
                  registry.Implementation("xla", reference.paged_attention_reference))


def _check_floating(name: str, x: Any, shape: tuple[int | None, ...], doc: str) -> None:
    """``x`` is float32/float16/bfloat16 of rank len(shape) with the given sizes (None: any)."""
    require_rank(OP, name, x, len(shape), doc)
    require_floating(OP, name, x, doc)
    if np.dtype(jnp.result_type(x)) not in INPUT_DTYPES:
        raise TypeError(f"{OP}: {name} must be {doc} float32/float16/bfloat16, got dtype {jnp.result_type(x)}")
    if any(want is not None and got != want for got, want in zip(np.shape(x), shape)):
        raise ValueError(f"{OP}: {name} must be {doc} = {tuple('?' if s is None else s for s in shape)}, "
                         f"got shape {tuple(np.shape(x))}")


def _check_layer(layer: Any, num_layers: int) -> Any:
    if isinstance(layer, (int, np.integer)) and not isinstance(layer, bool):
        if not 0 <= layer < num_layers:
            raise ValueError(f"{OP}: layer must be in [0, {num_layers}), got {layer}")
        return int(layer)
    layer = as_array(OP, "layer", layer)
    if np.ndim(layer) != 0 or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
        raise TypeError(f"{OP}: layer must be an int or an integer scalar array (may be traced), got "
                        f"shape {tuple(np.shape(layer))} dtype {jnp.result_type(layer)}")
    return layer


def paged_attention(q, cache: PagedKVCache, layer, block_tables, context_lens, *, staged_keys=None,
                    staged_values=None, staged_lens=None, new_keys, new_values, sliding_window: int | None = None,
                    new_token_parents=None, sinks=None, backend: str = "auto") -> jax.Array:
    """Attention of one layer's queries over the paged cache, the staged entries and the new tokens.

    Query t of request b sits at position ``context_lens[b] + staged_lens[b] + t`` and attends to the
    cache positions < ``context_lens[b]`` (read through ``block_tables[b]``), the staged entries <
    ``staged_lens[b]`` (staged entry s is at position ``context_lens[b] + s``) and the new tokens <= t,
    and with ``sliding_window`` W only to keys at positions > its own position - W. With
    ``new_token_parents`` (a tree over the new tokens) query t instead attends to the new tokens that
    are its ancestors or itself only, and sits at position ``context_lens[b] + staged_lens[b] + depth``
    (depth = its number of ancestors; ``scv_jax.tree_depths``). Scores are scaled
    by ``head_dim ** -0.5``, softmax is float32, and query head h uses kv head ``h // (heads // kv_heads)``;
    with ``sinks``, head h's softmax has one more logit, ``sinks[h]``, whose value is zero (gpt-oss).
    Staged and new K/V are read as the cache will hold them once committed (quantised with the scale
    their commit uses, then dequantised: ``scv_jax.ops.commit.reference.as_stored``), so a token's key
    looks the same to every query before and after its commit (fp8 caches stay lossless).

    Args:
      q: [B, T, heads, head_dim] float32/float16/bfloat16; heads a multiple of the cache's kv_heads.
      cache: the ``PagedKVCache`` of all layers (read, never written).
      layer: the layer to read: a Python int or an integer scalar array (may be traced, e.g. under
        ``lax.scan`` over layers; clamped into range inside jit).
      block_tables: int32[B, max_blocks], the cache blocks of each request in order (-1 = unallocated).
      context_lens: int32[B], committed positions per request (clamped to [0, max_blocks * block_size]).
      staged_keys, staged_values: K/V of in-flight tokens, of all layers ``[layers, B, S, kv_heads,
        head_dim]`` (``StagedKV``; ``layer`` picks one inside the jitted op) or of this layer
        ``[B, S, kv_heads, head_dim]``; or None.
      staged_lens: int32[B] valid staged entries per request (clamped to [0, S]); required with staged K/V.
      new_keys, new_values: [B, T, kv_heads, head_dim], this layer's K/V of the query tokens.
      sliding_window: None, or W >= 1 (static): keys more than W - 1 positions back are not attended.
      new_token_parents: None (the chain: new token t's parent is t - 1), or int32[B, T]: new token t's
        parent new token (< t), -1 = none (a child of the prefix); entries outside [-1, t) read as -1.
        In the decoder's layout the pending token is new token 0 (parent -1) and tree node i is new
        token i + 1 with parent ``tree_parents[i] + 1``.
      sinks: None, or [heads] float32/float16/bfloat16: each query head's sink logit (attention sinks;
        every implementation).
      backend: "auto", "pallas", "xla" or "interpret" (``scv_jax.ops.registry``).
    Returns:
      [B, T, heads, head_dim] in q's dtype. Padded requests (context 0, no staged entries, any block
      table) attend to their own new tokens; block ids are clamped into the cache, so bad tables
      never read out of bounds.
    """
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"{OP}: cache must be a scv_jax.PagedKVCache, got {type(cache).__name__}")
    cache = cache.validated(OP)
    q, block_tables, context_lens, new_keys, new_values = (as_array(OP, name, x) for name, x in (
        ("q", q), ("block_tables", block_tables), ("context_lens", context_lens), ("new_keys", new_keys),
        ("new_values", new_values)))
    kv_heads, head_dim = cache.num_kv_heads, cache.head_dim
    _check_floating("q", q, (None, None, None, head_dim), "[B, T, heads, head_dim]")
    batch, tokens, heads, _ = np.shape(q)
    if heads % kv_heads:
        raise ValueError(f"{OP}: q's heads ({heads}) must be a multiple of the cache's kv_heads ({kv_heads})")
    layer = _check_layer(layer, cache.num_layers)
    require_rank(OP, "block_tables", block_tables, 2, "int32[B, max_blocks]")
    require_integer(OP, "block_tables", block_tables, "int32[B, max_blocks]")
    if np.shape(block_tables)[0] != batch:
        raise ValueError(f"{OP}: block_tables must be int32[B, max_blocks] with B={batch}, got shape "
                         f"{tuple(np.shape(block_tables))}")
    require_int_vector(OP, "context_lens", context_lens, batch, "int32[B]")
    for name, x in (("new_keys", new_keys), ("new_values", new_values)):
        _check_floating(name, x, (batch, tokens, kv_heads, head_dim), "[B, T, kv_heads, head_dim]")
    staged = (staged_keys, staged_values, staged_lens)
    if any(x is None for x in staged) and not all(x is None for x in staged):
        raise ValueError(f"{OP}: staged_keys, staged_values and staged_lens must be given together")
    if staged_keys is not None:
        staged_keys, staged_values, staged_lens = (as_array(OP, name, x) for name, x in zip(
            ("staged_keys", "staged_values", "staged_lens"), staged))
        per_layer = np.ndim(staged_keys) == 4
        shape = (batch, None, kv_heads, head_dim) if per_layer else (cache.num_layers, batch, None, kv_heads, head_dim)
        doc = "[B, S, kv_heads, head_dim] or [layers, B, S, kv_heads, head_dim]"
        _check_floating("staged_keys", staged_keys, shape, doc)
        _check_floating("staged_values", staged_values, np.shape(staged_keys), f"{doc} like staged_keys")
        require_int_vector(OP, "staged_lens", staged_lens, batch, "int32[B]")
    if sliding_window is not None:
        sliding_window = require_int(OP, "sliding_window", sliding_window, minimum=1, static=True)
    if new_token_parents is not None:
        new_token_parents = as_array(OP, "new_token_parents", new_token_parents)
        require_rank(OP, "new_token_parents", new_token_parents, 2, "int32[B, T]")
        require_integer(OP, "new_token_parents", new_token_parents, "int32[B, T]")
        if np.shape(new_token_parents) != (batch, tokens):
            raise ValueError(f"{OP}: new_token_parents must be int32[B, T] = ({batch}, {tokens}), got shape "
                             f"{tuple(np.shape(new_token_parents))}")
    if sinks is not None:
        sinks = as_array(OP, "sinks", sinks)
        _check_floating("sinks", sinks, (heads,), "[heads]")
    extra_dtypes = tuple(np.dtype(jnp.result_type(x)) for x in (staged_keys, staged_values, new_keys, new_values)
                         if x is not None)
    impl = registry.select(OP, backend, head_dim=head_dim, block_size=cache.block_size, layout=cache.layout,
                           scale_mode=cache.scale_mode, cache_dtype=cache.dtype, q_dtype=np.dtype(jnp.result_type(q)),
                           extra_dtypes=extra_dtypes, kv_heads=kv_heads, tree=new_token_parents is not None,
                           sliding_window=sliding_window)
    if batch == 0 or tokens == 0:
        return jnp.zeros(np.shape(q), jnp.result_type(q))
    as_jax = lambda x: None if x is None else jnp.asarray(x)  # noqa: E731
    return _paged_attention(jnp.asarray(q), cache, layer, jnp.asarray(block_tables, jnp.int32),
                            jnp.asarray(context_lens, jnp.int32), as_jax(staged_keys), as_jax(staged_values),
                            None if staged_lens is None else jnp.asarray(staged_lens, jnp.int32),
                            jnp.asarray(new_keys), jnp.asarray(new_values),
                            None if new_token_parents is None else jnp.asarray(new_token_parents, jnp.int32),
                            as_jax(sinks), sliding_window=sliding_window, impl=impl)


@functools.partial(jax.jit, static_argnames=("sliding_window", "impl"))
def _paged_attention(q, cache, layer, block_tables, context_lens, staged_keys, staged_values, staged_lens,
                     new_keys, new_values, new_token_parents, sinks, *, sliding_window: int | None,
                     impl: registry.Selected) -> jax.Array:
    layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, cache.num_layers - 1)
    if staged_keys is not None and staged_keys.ndim == 5:   # this layer's entries (fused into their consumer)
        staged_keys, staged_values = (lax.dynamic_index_in_dim(x, layer, axis=0, keepdims=False)
                                      for x in (staged_keys, staged_values))
    return impl(q, cache, layer, block_tables, context_lens, staged_keys, staged_values, staged_lens, new_keys,
                new_values, sliding_window=sliding_window, new_token_parents=new_token_parents,
                **({} if sinks is None else {"sinks": sinks}))


def tree_depths(new_token_parents) -> jax.Array:
    """int32[B, T]: the depth (number of ancestors) of each new token of ``new_token_parents`` int32[B, T]
    (as ``paged_attention`` reads it): new token t's position is context + staged + depth, e.g. for RoPE."""
    op = "tree_depths"
    new_token_parents = as_array(op, "new_token_parents", new_token_parents)
    require_rank(op, "new_token_parents", new_token_parents, 2, "int32[B, T]")
    require_integer(op, "new_token_parents", new_token_parents, "int32[B, T]")
    return _tree_depths(jnp.asarray(new_token_parents, jnp.int32))


@jax.jit
def _tree_depths(new_token_parents: jax.Array) -> jax.Array:
    return depths(ancestor_mask(new_token_parents))
