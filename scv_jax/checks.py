"""Input checks. Trace-time checks look only at static facts (rank, dtype, shape); the host-side
``check_*`` helpers look at data, for callers who want them outside the hot path."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _shape_str(x: Any) -> str:
    return f"shape {tuple(np.shape(x))} dtype {jnp.result_type(x)}"


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


def require_positive_int(op: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{op}: {name} must be a positive Python int (static), got {value!r}")
    return int(value)


def is_concrete(x: Any) -> bool:
    """True when ``x`` holds data on the host or device (not a tracer)."""
    return not isinstance(x, jax.core.Tracer)


def check_draft_batch(cu_num_draft_tokens: Any, *, max_spec_len: int, num_slots: int | None = None,
                      draft_token_ids: Any = None, vocab_size: int | None = None) -> None:
    """Validates a ragged draft batch on the host; raises ``ValueError`` naming the first problem.

    Args:
      cu_num_draft_tokens: int[B + 1] offsets; cu[0] == 0, non-decreasing.
      max_spec_len: the most drafts any request may have.
      num_slots: T, the length of the flattened draft arrays (cu[-1] must not exceed it).
      draft_token_ids: int[T] draft ids, checked against ``vocab_size`` for the real slots.
      vocab_size: V; ids must be in [0, V).
    """
    cu = np.asarray(cu_num_draft_tokens)
    if cu.ndim != 1 or cu.shape[0] < 1:
        raise ValueError(f"cu_num_draft_tokens must be int[B + 1] with B >= 0, got shape {cu.shape}")
    if not np.issubdtype(cu.dtype, np.integer):
        raise ValueError(f"cu_num_draft_tokens must hold integers, got {cu.dtype}")
    if cu[0] != 0:
        raise ValueError(f"cu_num_draft_tokens[0] must be 0, got {cu[0]}")
    counts = np.diff(cu)
    if np.any(counts < 0):
        b = int(np.argmax(counts < 0))
        raise ValueError(f"cu_num_draft_tokens must be non-decreasing; request {b} has "
                         f"cu[{b}]={cu[b]} > cu[{b + 1}]={cu[b + 1]}")
    if np.any(counts > max_spec_len):
        b = int(np.argmax(counts > max_spec_len))
        raise ValueError(f"request {b} has {counts[b]} drafts, more than max_spec_len={max_spec_len}")
    if num_slots is not None and cu[-1] > num_slots:
        raise ValueError(f"cu_num_draft_tokens[-1]={cu[-1]} exceeds the number of draft slots {num_slots}")
    if draft_token_ids is not None and vocab_size is not None:
        ids = np.asarray(draft_token_ids)[: cu[-1]]
        bad = (ids < 0) | (ids >= vocab_size)
        if np.any(bad):
            i = int(np.argmax(bad))
            raise ValueError(f"draft_token_ids[{i}]={ids[i]} is outside [0, {vocab_size})")
