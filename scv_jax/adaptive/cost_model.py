"""Measured step cost per (batch bucket, k): each shape's seconds relative to the machine's current load
(numpy only)."""

from __future__ import annotations

import functools
import math

import numpy as np

_CLIP = math.log(2.0)   # a step more than 2x off its prediction counts as 2x (a pause, not a cost)
_LOAD_RATE = 0.6


@functools.lru_cache(maxsize=1024)
def batch_bucket(batch_size: int) -> int:
    """The power of two nearest to ``batch_size`` in log scale: batch sizes that share a cost row."""
    return 1 << max(round(math.log2(batch_size)), 0)


class StepCostTable:
    """Predicted seconds of a step with each of ``k_values`` drafts per request, per batch bucket: load x
    cost(bucket, k), both moving means of log seconds (a shape's cost of weight ``rate``, after a plain
    mean of its first 1 / rate steps; docs/adaptive.md, "Step cost"); non-decreasing in k, ``nan`` for a
    k never measured in a bucket.

    The rows are Python lists (a step updates one entry: list arithmetic is the same IEEE double
    arithmetic as numpy's, at a fraction of the per-call cost); ``seconds`` keeps each bucket's
    predictions until the next timed step changes them.
    """

    def __init__(self, k_values: tuple[int, ...], rate: float):
        self.k_values = k_values
        self._column = {k: i for i, k in enumerate(k_values)}
        self._rate = rate
        self._log_load = 0.0
        self._log_costs: dict[int, list[float]] = {}   # bucket -> [len(k_values)] log seconds at load 1 (nan: never)
        self._tries: dict[int, list[int]] = {}         # bucket -> [len(k_values)] untimed-or-timed steps run
        self._timed: dict[int, list[int]] = {}         # bucket -> [len(k_values)] timed steps
        self._seconds: dict[int, np.ndarray] = {}      # bucket -> predictions since the last timed step

    def _row(self, table: dict[int, list], batch_size: int, fill: float | int) -> list:
        bucket = batch_bucket(batch_size)
        row = table.get(bucket)
        if row is None:
            row = table[bucket] = [fill] * len(self.k_values)
        return row

    def observe(self, batch_size: int, k: int, seconds: float | None) -> None:
        """Records a step of ``k`` drafts at ``batch_size`` that took ``seconds`` (None: not timed)."""
        column = self._column.get(k)
        if column is None:
            return
        self._row(self._tries, batch_size, 0)[column] += 1
        if seconds is not None:
            self.time(batch_size, k, seconds)

    def time(self, batch_size: int, k: int, seconds: float) -> None:
        """Records that a step of ``k`` drafts at ``batch_size``, counted by ``observe`` (untimed then),
        took ``seconds``."""
        column = self._column.get(k)
        if column is None:
            return
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"StepCostTable.observe: seconds must be a positive finite number, got {seconds!r}")
        self._seconds.clear()      # the load moves every bucket's predictions
        costs, timed = self._row(self._log_costs, batch_size, math.nan), self._row(self._timed, batch_size, 0)
        timed[column] += 1
        if math.isnan(costs[column]):
            costs[column] = math.log(seconds) - self._log_load
            return
        surprise = min(max(math.log(seconds) - self._log_load - costs[column], -_CLIP), _CLIP)
        self._log_load += _LOAD_RATE * surprise
        costs[column] += max(self._rate, 1.0 / timed[column]) * (1.0 - _LOAD_RATE) * surprise

    def predicted(self, batch_size: int) -> np.ndarray:
        """``seconds(batch_size)`` without the copy: the table's own array, not to be modified."""
        bucket = batch_bucket(batch_size)
        out = self._seconds.get(bucket)
        if out is None:
            costs = self._row(self._log_costs, batch_size, math.nan)
            measured = [i for i, cost in enumerate(costs) if not math.isnan(cost)]
            lowest, lowered = math.inf, []      # each measured k's cost lowered to any larger k's, at the load
            for i in reversed(measured):
                lowest = costs[i] if costs[i] < lowest else lowest
                lowered.append(self._log_load + lowest)
            out = np.full(len(costs), math.nan)
            out[measured] = np.exp(np.array(lowered[::-1], np.float64))
            self._seconds[bucket] = out
        return out

    def seconds(self, batch_size: int) -> np.ndarray:
        """float64[len(k_values)] predicted seconds of a step with each k at ``batch_size`` (nan: never timed)."""
        return self.predicted(batch_size).copy()

    def untimed(self, batch_size: int, max_tries: int) -> list[bool]:
        """Per k: never timed at ``batch_size``'s bucket and run fewer than ``max_tries`` steps there
        (the k whose ``seconds`` are nan and that may still be tried)."""
        timed, tries = self._row(self._timed, batch_size, 0), self._row(self._tries, batch_size, 0)
        return [not t and n < max_tries for t, n in zip(timed, tries)]


__all__ = ["StepCostTable", "batch_bucket"]
