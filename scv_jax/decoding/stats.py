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
      k_histogram: {k: steps}.
      tokens_per_second: generated tokens / (wall_seconds - compile_seconds): decoding speed with
        compilation excluded.
      wall_seconds: the whole call; prefill_seconds: its prefill part (compilation included).
      compile_seconds: wall time of the calls that compiled an executable (first use of a shape
        bucket; 0 after ``warmup``); compile_count: XLA compilations during the call.
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
    compile_seconds: float = 0.0
    compile_count: int = 0


class AcceptanceTally:
    """Host-side tallies of proposed and accepted drafts per draft position, for ``GenerateStats``."""

    def __init__(self, k_max: int):
        self.proposed = np.zeros(k_max, np.int64)
        self.accepted = np.zeros(k_max, np.int64)
        self.request_steps = 0
        self.emitted = 0

    def add(self, num_drafts: np.ndarray, num_accepted: np.ndarray, num_emitted: np.ndarray) -> None:
        """One step: int[B] drafts proposed, drafts accepted and tokens emitted per request."""
        positions = np.arange(self.proposed.shape[0])
        self.proposed += np.sum(num_drafts[:, None] > positions, axis=0)
        self.accepted += np.sum(num_accepted[:, None] > positions, axis=0)
        self.request_steps += num_drafts.shape[0]
        self.emitted += int(num_emitted.sum())

    def fill(self, stats: GenerateStats) -> None:
        with np.errstate(invalid="ignore", divide="ignore"):
            per_position = self.accepted / self.proposed
        stats.acceptance_per_position = [round(float(x), 4) for x in per_position]
        stats.acceptance_rate = (float(self.accepted.sum() / self.proposed.sum()) if self.proposed.sum()
                                 else float("nan"))
        stats.mean_accepted_length = self.emitted / self.request_steps if self.request_steps else float("nan")
