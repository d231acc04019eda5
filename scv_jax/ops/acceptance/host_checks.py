"""Host-side validation of a ragged draft batch's data, for callers who want it outside the hot path
(the ops themselves never read data on the host)."""

from __future__ import annotations

from typing import Any

import numpy as np


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
