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
      k_histogram: {k: steps} by the k each step computed (its static k).
      tokens_per_second: generated tokens / (wall_seconds - compile_seconds): decoding speed with
        compilation excluded.
      wall_seconds: the whole call; prefill_seconds: its prefill part (compilation included; with
        ``max_num_seqs``, the prefills of the requests admitted later too: of those dispatched behind a
        step in flight, only the host's part, their device time falling in the next step's).
      step_seconds: {(padded batch, k): [steps, seconds, host seconds]} the decode steps by shape,
        steps that compiled or ran their executable for the first time excluded (one-off costs):
        their wall time (host work, device work and the one fetch of each step; with the device
        time of each shape, the host's share per step follows) and the part of it the host spent on
        its own work (before the step's dispatch and after its fetch).
      scored_tokens: tokens the target's verify forwards scored, padding included: B * (k + 1) a
        dense step of B rows, B * (packed_k + 1) a packed one (``DecoderConfig.packed_verify``).
      catch_up_calls: draft-only prefill calls that brought a lagging draft up to date after k = 0
        steps (``positions``).
      num_preemptions: running requests preempted (by recompute) because the KV blocks ran out
        (``Engine``; they resumed later with the same output).
      prefix_cache_queries, prefix_cache_hits: tokens of the admitted requests looked up in the prefix
        cache, and those found there (not computed).
      compile_seconds: wall time of the calls that compiled an executable (first use of a shape
        bucket; 0 after ``warmup``); compile_count: XLA compilations during the call; compiled: what
        they compiled, one entry each: a step executable's bucket (``"decode_step(batch=4, blocks=16,
        k=2, greedy=True, logprobs=False, backend=auto, packed_k=0, draft_only=False)"``), anything else by its jit name (after
        ``warmup`` of the call's sizes: empty; a compilation there is also logged, once per shape).
      fallbacks: {step bucket: why} the buckets this call ran on the XLA fallback because their
        kernels failed to compile or run (``backend="auto"`` only; "pallas" and "interpret" raise
        instead): their figures are XLA's, not the kernels'. ``check_no_fallbacks`` raises on any.
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
    step_seconds: dict[tuple[int, int], list] = dataclasses.field(default_factory=dict)
    scored_tokens: int = 0
    catch_up_calls: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    compiled: list[str] = dataclasses.field(default_factory=list)
    fallbacks: dict[str, str] = dataclasses.field(default_factory=dict)

    def check_no_fallbacks(self, what: str) -> None:
        """Raises RuntimeError naming ``what`` (e.g. a benchmark row) when a step ran on the XLA fallback."""
        if self.fallbacks:
            shape, why = next(iter(self.fallbacks.items()))
            raise RuntimeError(f"{what}: {len(self.fallbacks)} step bucket(s) fell back to XLA, so its figures "
                               f"are not the kernels'; first: {shape}: {why}")

    def add_step(self, batch: int, k: int, seconds: float | None, host_seconds: float = 0.0,
                 scored_tokens: int | None = None) -> None:
        """Counts one decode step of static ``k`` on ``batch`` (padded) rows that took ``seconds`` (None:
        it compiled or was its executable's first run), ``host_seconds`` of them the host's own work;
        the target scored ``scored_tokens`` (default: dense, ``batch * (k + 1)``)."""
        self.steps += 1
        self.scored_tokens += batch * (k + 1) if scored_tokens is None else scored_tokens
        self.k_histogram[k] = self.k_histogram.get(k, 0) + 1
        if seconds is not None:
            entry = self.step_seconds.setdefault((batch, k), [0, 0.0, 0.0])
            entry[0] += 1
            entry[1] += seconds
            entry[2] += host_seconds


class AcceptanceTally:
    """Host-side tallies of proposed and accepted drafts per draft position, for ``GenerateStats``
    (each step's counts are kept as they come and summed once, in ``fill``)."""

    def __init__(self, k_max: int):
        self._k_max = k_max
        self._steps: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def add(self, num_drafts: np.ndarray, num_accepted: np.ndarray, num_emitted: np.ndarray) -> None:
        """One step: int[B] drafts proposed, drafts accepted and tokens emitted per request."""
        self._steps.append((num_drafts, num_accepted, num_emitted))

    def fill(self, stats: GenerateStats) -> None:
        if self._steps:
            drafts, accepted, emitted = (np.concatenate(column) for column in zip(*self._steps))
        else:
            drafts = accepted = emitted = np.zeros(0, np.int64)
        positions = np.arange(self._k_max)
        proposed = np.sum(drafts[:, None] > positions, axis=0)
        accepted_at = np.sum(accepted[:, None] > positions, axis=0)
        with np.errstate(invalid="ignore", divide="ignore"):
            per_position = accepted_at / proposed
        stats.acceptance_per_position = [round(float(x), 4) for x in per_position]
        stats.acceptance_rate = float(accepted_at.sum() / proposed.sum()) if proposed.sum() else float("nan")
        stats.mean_accepted_length = float(emitted.sum() / drafts.shape[0]) if drafts.shape[0] else float("nan")
