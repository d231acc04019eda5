"""Graph mode's records: an ``ExecutableCache``'s counters (``GraphModeStats``) and what a warm-up did
(``WarmupReport``)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple


@dataclasses.dataclass
class GraphModeStats:
    """Counters of an ``ExecutableCache`` (host-side, cheap to read).

    ``padding_ratio(dim)`` is padded / real size summed over all bucketed calls (1.0 = no waste).
    ``unaliased_donations``: executables whose outputs do not alias the donated arguments;
    ``copied_donations``: executables that alias them but copy arrays of their shapes inside (found
    in the optimized HLO; the in-place update is then lost).
    ``borrowed``: calls that ran padded to a larger compiled bucket while their own compiled in the
    background (``ready_plan``); ``waits``: calls that waited for their own bucket's background compile.
    """

    hits: int = 0
    misses: int = 0
    compiles: int = 0
    compile_seconds: float = 0.0
    fallbacks: int = 0
    failed_buckets: int = 0
    oversize: int = 0
    device_pads: int = 0
    unaliased_donations: int = 0
    copied_donations: int = 0
    borrowed: int = 0
    waits: int = 0
    real_totals: dict[str, int] = dataclasses.field(default_factory=dict)
    padded_totals: dict[str, int] = dataclasses.field(default_factory=dict)

    def padding_ratio(self, dim: str) -> float:
        real = self.real_totals.get(dim, 0)
        return self.padded_totals.get(dim, 0) / real if real else float("nan")


class WarmupReport(NamedTuple):
    """What one ``ExecutableCache.warmup`` did."""

    buckets: int            # buckets considered
    compiled: int           # executables compiled now (bucket executables and fallbacks)
    failed: int             # buckets whose executable failed to compile (served by the fallback)
    wall_seconds: float
    compile_seconds: float  # summed over buckets (exceeds wall time with parallel threads)
