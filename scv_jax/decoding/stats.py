"""What a ``generate`` call reports: ``GenerateStats`` and the host-side acceptance tallies behind it."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class GenerateStats:
    """What one ``generate`` call did.

    Attributes:
      steps: decode steps; generated_tokens: tokens returned (all requests); prompt_tokens.
      mean_accepted_length: tokens emitted per request per step (accepted drafts + 1).
      acceptance_rate: accepted / proposed drafts (nan without drafts).
      acceptance_per_position: float[k_max]; position j: accepted / proposed drafts at position j + 1.
      k_histogram: {k: steps}; tokens_per_second: generated tokens / wall seconds.
      wall_seconds, prefill_seconds: time of the call and of its prefill.
      compile_count: XLA compilations during the call (``jax.monitoring``); 0 after warm-up.
    """

    steps: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    mean_accepted_length: float = float("nan")
    acceptance_rate: float = float("nan")
    acceptance_per_position: list[float] = dataclasses.field(default_factory=list)
    k_histogram: dict[int, int] = dataclasses.field(default_factory=dict)
    tokens_per_second: float = 0.0
    wall_seconds: float = 0.0
    prefill_seconds: float = 0.0
    compile_count: int = 0


class AcceptanceTally:
    """Host-side tallies for ``GenerateStats`` (per draft position and per request-step)."""

    def __init__(self, k_max: int):
        self.proposed = np.zeros(k_max, np.int64)
        self.accepted = np.zeros(k_max, np.int64)
        self.request_steps = 0
        self.emitted = 0

    def add(self, k: int, num_accepted: np.ndarray, num_emitted: np.ndarray) -> None:
        self.proposed[:k] += len(num_accepted)
        self.accepted[:k] += np.bincount(np.minimum(num_accepted, k), minlength=k + 1)[::-1].cumsum()[::-1][1:]
        self.request_steps += len(num_accepted)
        self.emitted += int(num_emitted.sum())

    def fill(self, stats: GenerateStats) -> None:
        with np.errstate(invalid="ignore", divide="ignore"):
            per_position = self.accepted / self.proposed
        stats.acceptance_per_position = [round(float(x), 4) for x in per_position]
        stats.acceptance_rate = float(self.accepted.sum() / self.proposed.sum()) if self.proposed.sum() \
            else float("nan")
        stats.mean_accepted_length = self.emitted / self.request_steps if self.request_steps else float("nan")
