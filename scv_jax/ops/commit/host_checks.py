"""Host-side validation of a commit's slot mapping, for callers who want it outside the hot path."""

from __future__ import annotations

import numpy as np

from scv_jax.ops.commit.kv_cache import PagedKVCache


def check_slot_mapping(slot_mapping, accept_mask=None, *, num_slots: int | PagedKVCache | None = None) -> None:
    """Host-side check of a commit's slots; raises ``ValueError`` naming the first problem.

    Checks that ``slot_mapping`` is an integer vector, ``accept_mask`` (if given) a vector of the same
    length, no written slot is >= ``num_slots`` (an int or a cache), and no slot is written twice.
    """
    slots = np.asarray(slot_mapping)
    if slots.ndim != 1 or not np.issubdtype(slots.dtype, np.integer):
        raise ValueError(f"slot_mapping must be int32[T], got shape {slots.shape} dtype {slots.dtype}")
    keep = slots >= 0
    if accept_mask is not None:
        mask = np.asarray(accept_mask)
        if mask.shape != slots.shape:
            raise ValueError(f"accept_mask must be bool[T] with T={slots.shape[0]}, got shape {mask.shape}")
        keep &= mask.astype(bool)
    if isinstance(num_slots, PagedKVCache):
        num_slots = num_slots.num_slots
    if num_slots is not None and np.any(keep & (slots >= num_slots)):
        t = int(np.argmax(keep & (slots >= num_slots)))
        raise ValueError(f"slot_mapping[{t}]={slots[t]} is outside the cache's {num_slots} slots "
                         "(it would be skipped)")
    kept = np.flatnonzero(keep)
    values, counts = np.unique(slots[kept], return_counts=True)
    if np.any(counts > 1):
        slot = values[np.argmax(counts > 1)]
        tokens = kept[slots[kept] == slot]
        raise ValueError(f"slot_mapping writes slot {slot} more than once (tokens {tokens.tolist()}); "
                         "non-skipped slots must be distinct")
