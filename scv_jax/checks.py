"""Trace-time argument checks shared by the public ops: they look only at static facts (rank, dtype,
shape, Python values) and raise one-line errors naming the op and the argument."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _shape_str(x: Any) -> str:
    return f"shape {tuple(np.shape(x))} dtype {jnp.result_type(x)}"


def as_array(op: str, name: str, x: Any) -> Any:
    """``x`` itself when it is an array (or tracer), else ``np.asarray(x)`` of a list, tuple or scalar.

    Raises TypeError naming the argument when ``x`` is not array-like (e.g. ragged nested lists).
    """
    if isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)):
        return x
    try:
        array = np.asarray(x)
    except (TypeError, ValueError) as error:
        raise TypeError(f"{op}: {name} must be an array, got {type(x).__name__} ({error})") from None
    if array.dtype == object:
        raise TypeError(f"{op}: {name} must be a numeric array, got {type(x).__name__} that numpy "
                        "reads as dtype object")
    return array


def require_rank(op: str, name: str, x: Any, rank: int, shape_doc: str) -> None:
    if np.ndim(x) != rank:
        raise ValueError(f"{op}: {name} must be {shape_doc} (rank {rank}), got {_shape_str(x)}")


def require_integer(op: str, name: str, x: Any, shape_doc: str) -> None:
    if not jnp.issubdtype(jnp.result_type(x), jnp.integer):
        raise TypeError(f"{op}: {name} must be an integer array {shape_doc}, got {_shape_str(x)}")


def require_floating(op: str, name: str, x: Any, shape_doc: str) -> None:
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        raise TypeError(f"{op}: {name} must be a floating array {shape_doc}, got {_shape_str(x)}")


def require_int_vector(op: str, name: str, x: Any, length: int | None, shape_doc: str) -> None:
    """``x`` is an integer vector, of ``length`` when given."""
    require_rank(op, name, x, 1, shape_doc)
    require_integer(op, name, x, shape_doc)
    if length is not None and np.shape(x)[0] != length:
        raise ValueError(f"{op}: {name} must be {shape_doc} with {length} entries, got {_shape_str(x)}")
