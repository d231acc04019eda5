"""``PagedKVCache``: the K and V pages of all layers in one pytree, with static layout and scale metadata.

Layouts (per K and per V):
  * ``"NHD"``: ``[layers, num_blocks, block_size, kv_heads, head_dim]`` (one token's heads contiguous);
  * ``"HND"``: ``[layers, num_blocks, kv_heads, block_size, head_dim]``.
A token's slot is ``block * block_size + offset``.

Scale modes (fp8 caches only; stored value = round(x / scale) with a true division, read value =
q * scale; NaN / inf policy in ``pallas_kernels.fp8``):
  * ``None``         no scale (an fp8 cache then saturates and casts with scale 1);
  * ``"tensor"``     one float32 scalar per K and per V;
  * ``"head"``       float32 ``[kv_heads]`` per K and per V;
  * ``"token_head"`` dynamic: float32 scale pages ``[layers, num_blocks, block_size, kv_heads]`` written
                     by each commit with ``max(absmax / fp8_max, tiny)`` of the token's head, absmax
                     over its finite elements.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.fp8 import is_fp8
from scv_jax.arguments import require_int

LAYOUTS: tuple[str, ...] = ("NHD", "HND")
SCALE_MODES: tuple[str | None, ...] = (None, "tensor", "head", "token_head")
CACHE_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(jnp.float32),
    "float16": np.dtype(jnp.float16),
    "bfloat16": np.dtype(jnp.bfloat16),
    "float8_e4m3fn": np.dtype(jnp.float8_e4m3fn),
    "float8_e5m2": np.dtype(jnp.float8_e5m2),
}
# vLLM's ``kv_cache_dtype`` strings. "auto" means "the model's dtype", which is bfloat16 here.
VLLM_DTYPE_ALIASES: dict[str, str] = {
    "auto": "bfloat16", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
}


def parse_cache_dtype(dtype: Any) -> np.dtype:
    """A cache dtype from a name (incl. vLLM's "auto"/"fp8"/"fp8_e4m3"/"fp8_e5m2") or a dtype object."""
    if isinstance(dtype, str):
        name = VLLM_DTYPE_ALIASES.get(dtype, dtype)
        if name not in CACHE_DTYPES:
            raise ValueError(f"unsupported KV cache dtype {dtype!r}; expected one of "
                             f"{sorted(CACHE_DTYPES) + sorted(VLLM_DTYPE_ALIASES)}")
        return CACHE_DTYPES[name]
    try:
        parsed = np.dtype(dtype)
    except TypeError:
        parsed = None
    if parsed not in CACHE_DTYPES.values():
        raise ValueError(f"unsupported KV cache dtype {dtype!r}; expected one of {sorted(CACHE_DTYPES)}")
    return parsed


def parse_layout(layout: Any) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"unsupported KV cache layout {layout!r}; expected one of {LAYOUTS} "
                         "(NHD = [layers, blocks, block_size, kv_heads, head_dim], "
                         "HND = [layers, blocks, kv_heads, block_size, head_dim])")
    return layout


def pages_shape(layout: str, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                head_dim: int) -> tuple[int, ...]:
    if layout == "NHD":
        return (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
    return (num_layers, num_blocks, num_kv_heads, block_size, head_dim)


def _scale_shapes(num_layers, num_blocks, block_size, num_kv_heads) -> dict[str, tuple[int, ...]]:
    return {"tensor": (), "head": (num_kv_heads,),
            "token_head": (num_layers, num_blocks, block_size, num_kv_heads)}


def _infer_scale_mode(shapes: dict[str, tuple[int, ...]], name: str, scale: Any) -> str:
    for mode, shape in shapes.items():
        if tuple(np.shape(scale)) == shape:
            return mode
    raise ValueError(f"{name} has shape {tuple(np.shape(scale))}, which fits no scale mode: expected "
                     f"() for 'tensor', {shapes['head']} = [kv_heads] for 'head', or "
                     f"{shapes['token_head']} = [layers, blocks, block_size, kv_heads] for 'token_head'")


def _check_scale(name: str, scale: Any, mode: str, shape: tuple[int, ...], check_values: bool) -> jax.Array:
    if tuple(np.shape(scale)) != shape:
        raise ValueError(f"{name} must have shape {shape} for scale_mode={mode!r}, "
                         f"got {tuple(np.shape(scale))}")
    if not jnp.issubdtype(jnp.result_type(scale), jnp.floating) and not jnp.issubdtype(
            jnp.result_type(scale), jnp.integer):
        raise TypeError(f"{name} must be a float32 array of shape {shape}, got {jnp.result_type(scale)}")
    if check_values and not isinstance(scale, jax.core.Tracer):
        bad = ~(np.asarray(scale, np.float32) > 0) | ~np.isfinite(np.asarray(scale, np.float32))
        if np.any(bad):
            raise ValueError(f"{name} must hold positive finite scales, got {np.asarray(scale)[bad][:4]}")
    return jnp.asarray(scale, jnp.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """K and V pages of all layers (see the module docstring for layouts and scale modes).

    Attributes:
      k_pages, v_pages: the pages, in ``layout``; dtype is the cache dtype.
      k_scale, v_scale: None, float32 scalars, float32 ``[kv_heads]``, or float32 scale pages
        ``[layers, num_blocks, block_size, kv_heads]``, per ``scale_mode``.
      layout: "NHD" or "HND" (static).
      scale_mode: None, "tensor", "head" or "token_head" (static).
    """

    k_pages: jax.Array
    v_pages: jax.Array
    k_scale: jax.Array | None
    v_scale: jax.Array | None
    layout: str = dataclasses.field(default="NHD", metadata=dict(static=True))
    scale_mode: str | None = dataclasses.field(default=None, metadata=dict(static=True))

    @classmethod
    def create(cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
               *, dtype: Any = "bfloat16", layout: str = "NHD", scale_mode: str | None = None,
               k_scale: Any = None, v_scale: Any = None) -> "PagedKVCache":
        """A zero-filled cache. Scales default to 1; with ``scale_mode=None`` a given scale's shape picks
        the mode (() tensor, [kv_heads] head, [layers, blocks, block_size, kv_heads] token_head)."""
        dims = [require_int("PagedKVCache.create", name, value, minimum=1, static=True) for name, value in (
            ("num_layers", num_layers), ("num_blocks", num_blocks), ("block_size", block_size),
            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim))]
        num_layers, num_blocks, block_size, num_kv_heads, head_dim = dims
        cache_dtype = parse_cache_dtype(dtype)
        layout = parse_layout(layout)
        shapes = _scale_shapes(num_layers, num_blocks, block_size, num_kv_heads)
        if scale_mode is None and (k_scale is not None or v_scale is not None):
            given = [(n, s) for n, s in (("k_scale", k_scale), ("v_scale", v_scale)) if s is not None]
            modes = {_infer_scale_mode(shapes, n, s) for n, s in given}
            if len(modes) > 1:
                raise ValueError(f"k_scale and v_scale imply different scale modes {sorted(modes)}")
            scale_mode = modes.pop()
        if scale_mode not in SCALE_MODES:
            raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
        # K and V get separate buffers, so that the whole cache can be donated.
        if scale_mode is not None:
            k_scale = jnp.ones(shapes[scale_mode], jnp.float32) if k_scale is None else k_scale
            v_scale = jnp.ones(shapes[scale_mode], jnp.float32) if v_scale is None else v_scale
        shape = pages_shape(layout, num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        return cls(jnp.zeros(shape, cache_dtype), jnp.zeros(shape, cache_dtype), k_scale, v_scale, layout,
                   scale_mode).validated("PagedKVCache.create",
                                                                               check_values=True)

    def replace(self, **fields: Any) -> "PagedKVCache":
        """A new cache with ``fields`` replaced (checked against layout, dtype and scale mode; new concrete
        scales, as in ``create``, must be positive and finite)."""
        return dataclasses.replace(self, **fields).validated(
            "PagedKVCache.replace", check_values="k_scale" in fields or "v_scale" in fields)

    def validated(self, op: str, *, check_values: bool = False) -> "PagedKVCache":
        """Checks static facts (ranks, shapes, dtypes, scale shapes), and with ``check_values`` that
        concrete scales are positive and finite (a host sync); returns the cache with float32 scales.
        Raises ValueError/TypeError naming the field and the expected shape."""
        layout = parse_layout(self.layout)
        for name in ("k_pages", "v_pages"):
            pages = getattr(self, name)
            if np.ndim(pages) != 5:
                raise ValueError(f"{op}: {name} must be rank 5 {self._layout_doc()}, "
                                 f"got shape {tuple(np.shape(pages))}")
            parse_cache_dtype(jnp.result_type(pages))
        if np.shape(self.k_pages) != np.shape(self.v_pages) or (
                jnp.result_type(self.k_pages) != jnp.result_type(self.v_pages)):
            raise ValueError(f"{op}: k_pages and v_pages must match, got {np.shape(self.k_pages)} "
                             f"{jnp.result_type(self.k_pages)} and {np.shape(self.v_pages)} "
                             f"{jnp.result_type(self.v_pages)}")
        if self.scale_mode not in SCALE_MODES:
            raise ValueError(f"{op}: scale_mode must be one of {SCALE_MODES}, got {self.scale_mode!r}")
        if self.scale_mode is None:
            if self.k_scale is not None or self.v_scale is not None:
                raise ValueError(f"{op}: k_scale/v_scale must be None when scale_mode is None")
            return self
        if not is_fp8(self.dtype):
            raise ValueError(f"{op}: scale_mode={self.scale_mode!r} needs an fp8 cache dtype "
                             f"(float8_e4m3fn or float8_e5m2), got {self.dtype}")
        shape = _scale_shapes(self.num_layers, self.num_blocks, self.block_size,
                              self.num_kv_heads)[self.scale_mode]
        k_scale = _check_scale("k_scale", self.k_scale, self.scale_mode, shape, check_values)
        v_scale = _check_scale("v_scale", self.v_scale, self.scale_mode, shape, check_values)
        return dataclasses.replace(self, layout=layout, k_scale=k_scale, v_scale=v_scale)

    def _layout_doc(self) -> str:
        return ("[layers, num_blocks, block_size, kv_heads, head_dim]" if self.layout == "NHD"
                else "[layers, num_blocks, kv_heads, block_size, head_dim]")

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(jnp.result_type(self.k_pages))

    @property
    def num_layers(self) -> int:
        return np.shape(self.k_pages)[0]

    @property
    def num_blocks(self) -> int:
        return np.shape(self.k_pages)[1]

    @property
    def block_size(self) -> int:
        return np.shape(self.k_pages)[2 if self.layout == "NHD" else 3]

    @property
    def num_kv_heads(self) -> int:
        return np.shape(self.k_pages)[3 if self.layout == "NHD" else 2]

    @property
    def head_dim(self) -> int:
        return np.shape(self.k_pages)[4]

    @property
    def num_slots(self) -> int:
        """num_blocks * block_size: valid slots are [0, num_slots)."""
        return self.num_blocks * self.block_size
