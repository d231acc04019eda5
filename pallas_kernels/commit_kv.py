"""Mosaic GPU kernel: write accepted draft K/V into a paged KV cache in place, all layers in one launch.

Grid ``(T, layers)``: one CTA (a warpgroup of 128 threads) per (token, layer) pair. A CTA whose token
is skipped (slot -1) exits at once. Otherwise it loads the token's ``[kv_heads, head_dim]`` keys and
values from global memory straight into registers with a strided warpgroup layout (each thread reads
``vector`` consecutive elements, up to 16 bytes of the narrower of the input and cache dtypes),
quantises them with ``pallas_kernels.fp8`` and stores them at the slot: one contiguous row in NHD, ``kv_heads``
rows ``block_size * head_dim`` apart in HND. No SMEM, no TMA: every byte is touched exactly once.

The pages are mutable refs (``jax.new_ref``) that the kernel writes through; under
``jax.jit(..., donate_argnums=...)`` XLA aliases them to the outputs, so the cache is never copied.

Scales: "tensor" and "head" scales are read as scalars; "token_head" computes each head's absmax with
one masked warpgroup max-reduction per head, writes the scale pages and divides by the scale. The
per-element head scale is a select chain over the heads (``kv_heads`` selects per element).

Supported shapes: ``kv_heads * head_dim`` a multiple of 128 (one element per thread at least).
Other shapes go to XLA (see ``unsupported_reason``); e.g. head_dim 80 with 8 heads (640 = 5 * 128)
is supported with 1-element accesses, head_dim 64 with 1 head is not.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.platform import interpret_params
from pallas_kernels.fp8 import dynamic_scale, quantize

WARPGROUP_SIZE = 128
MAX_VECTOR_BYTES = 16


def vector_size(num_kv_heads: int, head_dim: int, itemsizes: tuple[int, ...]) -> int:
    """Elements per thread access: the most (a power of two, at most 16 bytes of the narrowest dtype)
    that divides ``head_dim`` and tiles ``kv_heads * head_dim`` over 128 threads; 0 when none does."""
    vector = MAX_VECTOR_BYTES // min(itemsizes)
    while vector >= 1:
        if head_dim % vector == 0 and (num_kv_heads * head_dim) % (WARPGROUP_SIZE * vector) == 0:
            return vector
        vector //= 2
    return 0


def unsupported_reason(num_kv_heads: int, head_dim: int, itemsizes: tuple[int, ...]) -> str:
    """Why the kernel cannot take these shapes, or "" when it can."""
    if vector_size(num_kv_heads, head_dim, itemsizes):
        return ""
    return (f"kv_heads * head_dim = {num_kv_heads} * {head_dim} must be a multiple of {WARPGROUP_SIZE} "
            "(one warpgroup per token and layer)")


def _per_head(head_ids: jax.Array, values: list[jax.Array]) -> jax.Array:
    """Broadcasts one scalar per head to a [kv_heads, head_dim] array (a select chain)."""
    out = jnp.full(head_ids.shape, values[-1], jnp.float32)
    for h, value in enumerate(values[:-1]):
        out = jnp.where(head_ids == h, value, out)
    return out


def _commit_body(slot_ref, k_ref, v_ref, *refs, layout: str, scale_mode: str | None, cache_dtype,
                 num_slots: int, block_size: int, num_kv_heads: int, head_dim: int, vector: int):
    if scale_mode in ("tensor", "head"):
        k_scale_ref, v_scale_ref, k_pages, v_pages = refs
    elif scale_mode == "token_head":
        k_pages, v_pages, k_scale_ref, v_scale_ref = refs
    else:
        k_pages, v_pages = refs
        k_scale_ref = v_scale_ref = None
    t = lax.axis_index("t")
    layer = lax.axis_index("l")
    slot = slot_ref[t]

    @pl.when((slot >= 0) & (slot < num_slots))
    def _():
        block = lax.div(slot, block_size)
        offset = lax.rem(slot, block_size)
        strided = plgpu.Layout.WG_STRIDED((num_kv_heads, head_dim), vec_size=vector)
        head_ids = None
        if scale_mode in ("head", "token_head") and num_kv_heads > 1:
            head_ids = plgpu.broadcasted_iota(jnp.int32, (num_kv_heads, head_dim), 0, layout=strided)
        for src_ref, pages, scale_ref in ((k_ref, k_pages, k_scale_ref), (v_ref, v_pages, v_scale_ref)):
            x = plgpu.load(src_ref.at[layer, t], layout=strided).astype(jnp.float32)
            if scale_mode == "tensor":
                scale = scale_ref[0]
            elif scale_mode == "head":
                heads = [scale_ref[h] for h in range(num_kv_heads)]
                scale = _per_head(head_ids, heads) if head_ids is not None else heads[0]
            elif scale_mode == "token_head":
                magnitude = jnp.abs(x)
                heads = []
                for h in range(num_kv_heads):
                    masked = magnitude if head_ids is None else jnp.where(head_ids == h, magnitude, 0.0)
                    heads.append(dynamic_scale(jnp.max(masked), cache_dtype))
                    scale_ref[layer, block, offset, h] = heads[-1]
                scale = _per_head(head_ids, heads) if head_ids is not None else heads[0]
            else:
                scale = None
            q = quantize(x, cache_dtype, scale)
            if layout == "NHD":
                pages.at[layer, block, offset][...] = q
            else:
                pages.at[layer, block, :, offset][...] = q


def commit_kv_kernel(k_pages: jax.Array, v_pages: jax.Array, k_scale: jax.Array | None,
                     v_scale: jax.Array | None, new_keys: jax.Array, new_values: jax.Array,
                     slots: jax.Array, *, layout: str, scale_mode: str | None, interpret: bool = False):
    """Writes token t of every layer at ``slots[t]`` (int32[T], -1 = skip), in place.

    Args:
      k_pages, v_pages: the cache pages in ``layout`` (see ``scv_jax.ops.commit.kv_cache``).
      k_scale, v_scale: None; float32[1] ("tensor"); float32[kv_heads] ("head"); or float32 scale pages
        [layers, num_blocks, block_size, kv_heads] ("token_head", updated in place).
      new_keys, new_values: [layers, T, kv_heads, head_dim] float32/float16/bfloat16.
    Returns:
      (k_pages, v_pages, k_scale, v_scale) after the commit.
    """
    num_layers, num_tokens, num_kv_heads, head_dim = new_keys.shape
    block_size = k_pages.shape[2 if layout == "NHD" else 3]
    itemsizes = (new_keys.dtype.itemsize, new_values.dtype.itemsize, k_pages.dtype.itemsize)
    vector = vector_size(num_kv_heads, head_dim, itemsizes)
    if not vector:
        raise ValueError(unsupported_reason(num_kv_heads, head_dim, itemsizes))
    body = functools.partial(
        _commit_body, layout=layout, scale_mode=scale_mode, cache_dtype=np.dtype(k_pages.dtype),
        num_slots=k_pages.shape[1] * block_size, block_size=block_size, num_kv_heads=num_kv_heads,
        head_dim=head_dim, vector=vector)
    page_refs = [jax.new_ref(k_pages), jax.new_ref(v_pages)]
    if scale_mode == "token_head":
        page_refs += [jax.new_ref(k_scale), jax.new_ref(v_scale)]
    scale_inputs = [k_scale, v_scale] if scale_mode in ("tensor", "head") else []
    plgpu.kernel(body, out_type=(), grid=(num_tokens, num_layers), grid_names=("t", "l"),
                 interpret=interpret_params(interpret))(slots, new_keys, new_values, *scale_inputs,
                                                        *page_refs)
    k_pages, v_pages, *scale_pages = [jax.freeze(ref) for ref in page_refs]
    if scale_pages:
        k_scale, v_scale = scale_pages
    return k_pages, v_pages, k_scale, v_scale
