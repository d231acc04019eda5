"""Mosaic GPU kernel: write accepted draft K/V into a paged KV cache in place, all layers in one launch.

Grid ``(T, layers)``: one CTA (a warpgroup of 128 threads) per (token, layer) pair. A CTA whose token
is skipped (slot -1) exits at once. Otherwise it loads the token's ``[kv_heads, head_dim]`` keys and
values (both loads issued before either store) from global memory straight into registers, quantises
them with ``pallas_kernels.fp8`` and stores them at the slot: one contiguous row in NHD, ``kv_heads``
rows ``block_size * head_dim`` apart in HND. No SMEM, no TMA: every byte is touched exactly once.

Register layouts (``plan_layout``), one per token shape:
  * "strided": ``kv_heads * head_dim`` a multiple of 128 accesses: each of the 128 threads holds
    ``vector`` consecutive elements (up to 16 bytes of the narrowest dtype) per access;
  * "tiled": every other shape (e.g. 1 x 64, 2 x 80, 3 x 112, 5 x 96): a 2-D tiled layout over
    ``(kv_heads, head_dim)`` with heads over warps and ``head_dim`` over lanes and ``vector``-element
    accesses (at least 4 bytes, at most 16), threads beyond the data replicated (they compute and
    store the same values as their twin; a duplicate store of equal bytes is harmless).
Both give the same bits: the arithmetic is elementwise plus per-head maxima.

The pages are mutable refs (``jax.new_ref``) that the kernel writes through; under
``jax.jit(..., donate_argnums=...)`` XLA aliases them to the outputs, so the cache is never copied.

Scales: "tensor" and "head" scales are read as scalars (a select chain over heads per element);
"token_head" computes each head's finite absmax (``fp8.finite_magnitudes``) with one masked
warpgroup max-reduction per head ("strided") or one reduction along ``head_dim`` ("tiled"), writes
the scale pages and divides by the scale.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.fp8 import dynamic_scale, finite_magnitudes, quantize
from pallas_kernels.platform import WARPGROUP_SIZE, interpret_params, store_unoptimized

MAX_VECTOR_BYTES = 16
MIN_TILED_ACCESS_BYTES = 4      # Mosaic's tiled GMEM accesses move at least 4 bytes per thread
_WARPS, _LANES = 4, 32


def vector_size(num_kv_heads: int, head_dim: int, itemsizes: tuple[int, ...]) -> int:
    """Elements per thread access of the "strided" layout: the most (a power of two, at most 16 bytes
    of the narrowest dtype) that divides ``head_dim`` and tiles ``kv_heads * head_dim`` over 128
    threads; 0 when none does."""
    vector = MAX_VECTOR_BYTES // min(itemsizes)
    while vector >= 1:
        if head_dim % vector == 0 and (num_kv_heads * head_dim) % (WARPGROUP_SIZE * vector) == 0:
            return vector
        vector //= 2
    return 0


def tiled_vector_size(head_dim: int, itemsizes: tuple[int, ...]) -> int:
    """Elements per thread access of the "tiled" layout: the most (a power of two) that divides
    ``head_dim``, with at most 16 bytes of the widest dtype and at least 4 of the narrowest; 0 when
    none does."""
    vector = MAX_VECTOR_BYTES // max(itemsizes)
    while vector * min(itemsizes) >= MIN_TILED_ACCESS_BYTES:
        if head_dim % vector == 0:
            return vector
        vector //= 2
    return 0


def unsupported_reason(num_kv_heads: int, head_dim: int, itemsizes: tuple[int, ...]) -> str:
    """Why the kernel cannot take these shapes, or "" when it can."""
    if vector_size(num_kv_heads, head_dim, itemsizes) or tiled_vector_size(head_dim, itemsizes):
        return ""
    need = -(-MIN_TILED_ACCESS_BYTES // min(itemsizes))
    return (f"head_dim = {head_dim} must be a multiple of {need} (4-byte accesses of the "
            f"{min(itemsizes)}-byte dtype) when kv_heads * head_dim = {num_kv_heads * head_dim} is not "
            f"a multiple of {WARPGROUP_SIZE}")


@dataclasses.dataclass(frozen=True)
class LayoutPlan:
    """The register layout of one token's ``[kv_heads, head_dim]`` block (see the module docstring)."""

    kind: str          # "strided" or "tiled"
    layout: object     # a plgpu layout
    vector: int


def _pow2_divisor(n: int, cap: int) -> int:
    p = 1
    while p * 2 <= cap and n % (p * 2) == 0:
        p *= 2
    return p


def plan_layout(num_kv_heads: int, head_dim: int, itemsizes: tuple[int, ...]) -> LayoutPlan:
    """The layout for these shapes and dtypes; ValueError (``unsupported_reason``) when none fits."""
    vector = vector_size(num_kv_heads, head_dim, itemsizes)
    if vector:
        return LayoutPlan("strided", plgpu.Layout.WG_STRIDED((num_kv_heads, head_dim), vec_size=vector), vector)
    vector = tiled_vector_size(head_dim, itemsizes)
    if not vector:
        raise ValueError(unsupported_reason(num_kv_heads, head_dim, itemsizes))
    warps = _pow2_divisor(num_kv_heads, _WARPS)
    lanes = _pow2_divisor(head_dim // vector, _LANES)
    # (H, D) -> tiles (warps, lanes * vector) -> (1, vector): dims (H/w, D/(l v), w, l, 1, v).
    replicated = lambda n, total: (mgpu_fa.Replicated(total // n),) if n < total else ()  # noqa: E731
    tiled = mgpu_fa.TiledLayout(
        mgpu_fa.Tiling(((warps, lanes * vector), (1, vector))),
        warp_dims=replicated(warps, _WARPS) + ((-4,) if warps > 1 else ()),
        lane_dims=replicated(lanes, _LANES) + ((-3,) if lanes > 1 else ()),
        vector_dim=-1, _check_canonical=False).canonicalize()
    layout = plgpu.Layout.TILED(tiled.tiling, warp_dims=tiled.warp_dims, lane_dims=tiled.lane_dims,
                                vector_dim=tiled.vector_dim)
    return LayoutPlan("tiled", layout, vector)


def _per_head(head_ids: jax.Array | None, values: list[jax.Array]) -> jax.Array:
    """One scalar per head as a [kv_heads, head_dim] operand (a select chain; a scalar for one head)."""
    if head_ids is None:
        return values[0]
    out = jnp.full(head_ids.shape, values[-1], jnp.float32)
    for h, value in enumerate(values[:-1]):
        out = jnp.where(head_ids == h, value, out)
    return out


def _commit_body(slot_ref, k_ref, v_ref, *refs, layout: str, scale_mode: str | None, cache_dtype,
                 num_slots: int, block_size: int, num_kv_heads: int, plan: LayoutPlan):
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
    tiled = plan.kind == "tiled"

    @pl.when((slot >= 0) & (slot < num_slots))
    def _():
        block = lax.div(slot, block_size)
        offset = lax.rem(slot, block_size)
        sources = [plgpu.load(ref.at[layer, t], layout=plan.layout, optimized=not tiled).astype(jnp.float32)
                   for ref in (k_ref, v_ref)]
        head_ids = None
        if num_kv_heads > 1 and (scale_mode == "head" or (scale_mode == "token_head" and not tiled)):
            head_ids = plgpu.broadcasted_iota(jnp.int32, sources[0].shape, 0, layout=plan.layout)
        for x, pages, scale_ref in zip(sources, (k_pages, v_pages), (k_scale_ref, v_scale_ref)):
            if scale_mode == "tensor":
                scale = scale_ref[0]
            elif scale_mode == "head":
                scale = _per_head(head_ids, [scale_ref[h] for h in range(num_kv_heads)])
            elif scale_mode == "token_head" and tiled:
                head_scales = dynamic_scale(jnp.max(finite_magnitudes(x), axis=1), cache_dtype)
                store_unoptimized(scale_ref.at[layer, block, offset], head_scales)
                scale = head_scales[:, None]
            elif scale_mode == "token_head":
                magnitude = finite_magnitudes(x)
                heads = []
                for h in range(num_kv_heads):
                    masked = magnitude if head_ids is None else jnp.where(head_ids == h, magnitude, 0.0)
                    heads.append(dynamic_scale(jnp.max(masked), cache_dtype))
                    scale_ref[layer, block, offset, h] = heads[-1]
                scale = _per_head(head_ids, heads)
            else:
                scale = None
            q = quantize(x, cache_dtype, scale)
            target = pages.at[layer, block, offset] if layout == "NHD" else pages.at[layer, block, :, offset]
            if tiled:
                store_unoptimized(target, q)
            else:
                target[...] = q


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
    body = functools.partial(
        _commit_body, layout=layout, scale_mode=scale_mode, cache_dtype=np.dtype(k_pages.dtype),
        num_slots=k_pages.shape[1] * block_size, block_size=block_size, num_kv_heads=num_kv_heads,
        plan=plan_layout(num_kv_heads, head_dim, itemsizes))
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
