"""Facts about arrays as a compiled SPMD program sees them: HLO element types, one device's shard shape
and bytes, and the arrays an optimized HLO module copies (``copy`` instructions)."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from scv_jax.graph.buckets import is_array_leaf

_HLO_COPY = re.compile(r"= ([a-z0-9]+)\[([0-9,]*)\](?:\{[^}]*\})? copy\(")


def copied_arrays(hlo_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(HLO element type, shape) of the arrays that ``copy`` instructions of an optimized HLO module produce."""
    return [(kind, tuple(int(d) for d in dims.split(",") if d)) for kind, dims in _HLO_COPY.findall(hlo_text)]


def hlo_type(dtype: Any) -> str:
    """The HLO element type of a numpy / JAX dtype: f32, s32, u32, bf16, f8e4m3fn, pred, ..."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return "pred"
    if dtype.name.startswith("float8_"):
        return "f8" + dtype.name[len("float8_"):]
    if dtype.name == "bfloat16":
        return "bf16"
    return {"f": "f", "i": "s", "u": "u", "c": "c"}.get(dtype.kind, dtype.name) + str(8 * dtype.itemsize)


def local_shape(leaf: Any) -> tuple[int, ...]:
    """The shape of one device's shard of an array (all of it unless sharded): what a compiled SPMD
    program, its memory analysis and its HLO see."""
    sharding = getattr(leaf, "sharding", None)
    return tuple(sharding.shard_shape(tuple(leaf.shape)) if sharding is not None else leaf.shape)


def nbytes(leaf: Any) -> int:
    """Bytes of one device's shard of an array leaf (0 for non-arrays)."""
    return int(np.prod(local_shape(leaf))) * np.dtype(leaf.dtype).itemsize if is_array_leaf(leaf) else 0
