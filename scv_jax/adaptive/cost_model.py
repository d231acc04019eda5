"""Measured step cost per (batch bucket, k): a moving mean of each shape's step seconds (numpy only)."""

from __future__ import annotations

import math

import numpy as np

_OUTLIER = 3.0      # a step slower than this x its shape's mean counts as this x (a pause, not a cost)


def batch_bucket(batch_size: int) -> int:
    """The power of two nearest to ``batch_size`` in log scale: batch sizes that share a cost row."""
    return 1 << max(round(math.log2(batch_size)), 0)


class StepCostTable:
    """Moving means of the seconds of a step with each of ``k_values`` drafts per request, per batch bucket.

    Predictions are non-decreasing in k (a step with more drafts never costs less: a noisy k that
    measured cheaper than a smaller k is raised to it) and ``nan`` for a k never measured in a
    bucket (the controller measures it before choosing it).
    """

    def __init__(self, k_values: tuple[int, ...], rate: float):
        self.k_values = k_values
        self._column = {k: i for i, k in enumerate(k_values)}
        self._rate = rate
        self._means: dict[int, np.ndarray] = {}    # bucket -> float64[len(k_values)] seconds, nan: never timed
        self._tries: dict[int, np.ndarray] = {}    # bucket -> int64[len(k_values)] untimed-or-timed steps run
        self._timed: dict[int, np.ndarray] = {}    # bucket -> int64[len(k_values)] timed steps

    def _row(self, table: dict[int, np.ndarray], batch_size: int, fill: float, dtype) -> np.ndarray:
        bucket = batch_bucket(batch_size)
        if bucket not in table:
            table[bucket] = np.full(len(self.k_values), fill, dtype)
        return table[bucket]

    def observe(self, batch_size: int, k: int, seconds: float | None) -> None:
        """Records a step of ``k`` drafts at ``batch_size`` that took ``seconds`` (None: not timed)."""
        column = self._column.get(k)
        if column is None:
            return
        self._row(self._tries, batch_size, 0, np.int64)[column] += 1
        if seconds is None:
            return
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"StepCostTable.observe: seconds must be a positive finite number, got {seconds!r}")
        means, timed = self._row(self._means, batch_size, math.nan, np.float64), self._row(self._timed, batch_size, 0, np.int64)
        timed[column] += 1
        mean = means[column]
        if math.isnan(mean):
            means[column] = seconds
        else:   # a plain mean of a shape's first 1 / rate steps, then a moving one
            means[column] = mean + max(self._rate, 1.0 / timed[column]) * (min(seconds, _OUTLIER * mean) - mean)

    def seconds(self, batch_size: int) -> np.ndarray:
        """float64[len(k_values)] predicted seconds of a step with each k at ``batch_size`` (nan: never timed)."""
        means = self._row(self._means, batch_size, math.nan, np.float64)
        measured = ~np.isnan(means)
        out = np.full_like(means, math.nan)
        out[measured] = np.maximum.accumulate(means[measured])
        return out

    def tries(self, batch_size: int) -> np.ndarray:
        """int64[len(k_values)] steps run with each k at ``batch_size``'s bucket (timed or not)."""
        return self._row(self._tries, batch_size, 0, np.int64).copy()


__all__ = ["StepCostTable", "batch_bucket"]
