"""Bucket policies and argument padding for graph mode (host side only: no device transfers).

A *dimension* (e.g. ``"batch"`` or ``"tokens"``) is padded up to the smallest of its configured
bucket sizes; a bucketed *static* argument (e.g. ``max_spec_len``) is rounded up to the smallest
configured value. ``Pad`` says which argument carries a dimension on which axis, and with what value
the padded entries are filled.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class Buckets:
    """The sizes one dimension (or one static argument) is padded up to, ascending and distinct."""

    sizes: tuple[int, ...]

    def __post_init__(self):
        sizes = tuple(int(s) for s in self.sizes)
        if not sizes or any(s < 0 for s in sizes) or list(sizes) != sorted(set(sizes)):
            raise ValueError(f"Buckets: sizes must be distinct non-negative ints in ascending order, "
                             f"got {self.sizes!r}")
        object.__setattr__(self, "sizes", sizes)

    @classmethod
    def pow2_then_linear(cls, max_size: int, *, linear_step: int = 64, min_size: int = 1) -> Buckets:
        """Powers of two from ``min_size`` up to ``linear_step``, then multiples of ``linear_step``
        up to ``max_size`` (which is always included), e.g. 1, 2, 4, ..., 64, 128, 192, 256."""
        if min_size < 1 or linear_step < 1 or max_size < min_size:
            raise ValueError(f"Buckets.pow2_then_linear: need 1 <= min_size <= max_size and "
                             f"linear_step >= 1, got min_size={min_size}, max_size={max_size}, "
                             f"linear_step={linear_step}")
        sizes, size = [], min_size
        while size < linear_step and size < max_size:
            sizes.append(size)
            size *= 2
        size = max(linear_step, sizes[-1] + 1 if sizes else min_size)
        size = -(-size // linear_step) * linear_step
        while size < max_size:
            sizes.append(size)
            size += linear_step
        sizes.append(max_size)
        return cls(tuple(sorted(set(sizes))))

    @classmethod
    def halving(cls, max_size: int, *, min_size: int = 1) -> Buckets:
        """``max_size`` and its successive halves (rounded up) down to ``min_size``: a geometric series
        whose largest bucket is exactly ``max_size`` and where padding at most doubles a size (above
        ``min_size``), e.g. ``halving(68, min_size=16)`` is 17, 34, 68: a size growing from 1 to
        ``max_size`` crosses only about log2(max_size / min_size) buckets."""
        if min_size < 1 or max_size < min_size:
            raise ValueError(f"Buckets.halving: need 1 <= min_size <= max_size, got min_size={min_size}, "
                             f"max_size={max_size}")
        sizes = [max_size]
        while -(-sizes[-1] // 2) >= min_size and sizes[-1] > 1:
            sizes.append(-(-sizes[-1] // 2))
        return cls(tuple(reversed(sizes)))

    @property
    def largest(self) -> int:
        return self.sizes[-1]

    def bucket(self, size: int) -> int | None:
        """The smallest bucket >= ``size``, or None when ``size`` exceeds the largest bucket."""
        i = bisect.bisect_left(self.sizes, size)
        return self.sizes[i] if i < len(self.sizes) else None


def as_buckets(value: Buckets | Sequence[int]) -> Buckets:
    return value if isinstance(value, Buckets) else Buckets(tuple(value))


@dataclass(frozen=True)
class Pad:
    """How one argument is padded to a bucket (applied to every array leaf of the argument).

    Attributes:
      dim: the dimension's name (a key of ``ExecutableCache(dims=...)``).
      axis: the array axis that holds the dimension.
      fill: the value of padded entries, or ``"edge"`` to repeat the last entry (e.g. ``cu``
        offsets, so that padded requests own no slots).
      extra: the axis is ``dim + extra`` long (e.g. ``extra=1`` for int32[B + 1] offsets).
    """

    dim: str
    axis: int = 0
    fill: Any = 0
    extra: int = 0


def is_array_leaf(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _is_host_vector(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and all(isinstance(v, (int, float, np.generic)) for v in x)


def map_arrays(fn: Callable[[Any], Any], value: Any) -> Any:
    """``fn`` applied to every array of ``value``: an array, a list of numbers, or a pytree."""
    if is_array_leaf(value) or _is_host_vector(value):
        return fn(value)
    return jax.tree.map(fn, value)


def array_leaves(value: Any) -> list[Any]:
    """The arrays of ``value`` (see ``map_arrays``)."""
    if is_array_leaf(value) or _is_host_vector(value):
        return [value]
    return jax.tree.leaves(value)


def host_array(x: Any) -> np.ndarray:
    """A host (numpy) array of JAX's canonical dtype for ``x`` (a list, scalar or numpy array)."""
    x = np.asarray(x)
    return x.astype(jax.dtypes.canonicalize_dtype(x.dtype), copy=False)


def real_size(leaf: Any, pad: Pad, name: str) -> int:
    """The unpadded size of ``pad.dim`` carried by ``leaf`` (read from its static shape)."""
    shape = np.shape(leaf)
    if len(shape) <= pad.axis:
        raise ValueError(f"graph mode: argument {name!r} should have a {pad.dim!r} axis at "
                         f"position {pad.axis}, got shape {shape}")
    return shape[pad.axis] - pad.extra


def pad_leaf(leaf: Any, pad: Pad, size: int) -> tuple[Any, bool]:
    """``leaf`` padded along ``pad.axis`` to ``size + pad.extra``; and whether the device padded it.

    Host inputs (numpy arrays, lists) are padded with numpy; device arrays with jax.numpy (an
    asynchronous device op; no transfer, but one small compile per new shape).
    """
    on_device = isinstance(leaf, jax.Array)
    x = leaf if on_device else host_array(leaf)
    current, target = x.shape[pad.axis], size + pad.extra
    if current == target:
        return x, False
    if on_device:
        widths = [(0, 0)] * x.ndim
        widths[pad.axis] = (0, target - current)
        if pad.fill == "edge" and current:
            return jnp.pad(x, widths, mode="edge"), True
        fill = 0 if pad.fill == "edge" else pad.fill
        return jnp.pad(x, widths, constant_values=np.asarray(fill).astype(x.dtype)), True
    out = np.empty(x.shape[:pad.axis] + (target,) + x.shape[pad.axis + 1:], x.dtype)
    head = (slice(None),) * pad.axis
    out[head + (slice(0, current),)] = x
    tail = head + (slice(current, None),)
    if pad.fill == "edge" and current:
        out[tail] = x[head + (slice(current - 1, current),)]
    else:
        out[tail] = 0 if pad.fill == "edge" else pad.fill
    return out, False
