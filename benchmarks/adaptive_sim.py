"""Synthetic speculative decoding to evaluate speculation-length policies (``AdaptiveController``, oracle).

A scenario fixes, per tick of simulated time, the conditional acceptance a_j of every request slot and
the batch size, plus a true step-cost function. Every policy runs for the same simulated duration on the
same random draws (common random numbers), so throughputs (emitted tokens / simulated second) differ
only by the choices of k.
Shared by tests/adaptive/test_controller.py and benchmarks/sim_adaptive.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from scv_jax.adaptive.controller import expected_tokens

K_MAX = 8
# vLLM-style per-position acceptance rates, read as marginal: P(draft i accepted) = prod_{j<=i} a_j.
DECAYING_MARGINALS = (0.58, 0.34, 0.22, 0.15, 0.11)


class Policy(Protocol):
    def next_k(self, batch_size: int) -> int: ...

    def update(self, num_draft_tokens: Any, num_accepted: Any, step_seconds: float | None = None,
               batch_size: int | None = None) -> None: ...


def _load(tokens: np.ndarray | float, saturation: float | None) -> np.ndarray | float:
    """Relative cost of a forward over ``tokens``: ~1 while memory-bound, ~tokens / saturation after."""
    tokens = np.asarray(tokens, np.float64)
    return np.ones_like(tokens) if saturation is None else np.sqrt(1.0 + (tokens / saturation) ** 2)


@dataclass(frozen=True)
class StepCost:
    """The true cost of a step: a target forward over B + D tokens and k sequential draft forwards.

    Attributes:
      target_seconds: one memory-bound target forward.
      draft_ratio: one memory-bound draft forward / one target forward (c).
      target_saturation_tokens, draft_saturation_tokens: where a forward turns compute-bound
        (None: cost independent of tokens, the textbook model T = 1 + k c).
    """

    target_seconds: float = 0.02
    draft_ratio: float = 0.1
    target_saturation_tokens: float | None = None
    draft_saturation_tokens: float | None = None

    def seconds(self, batch_size: int, num_draft_tokens: np.ndarray, catch_up_tokens: int = 0) -> float:
        """Noise-free seconds of a step with int[B] drafts, plus a catch-up draft forward when > 0."""
        drafts = np.asarray(num_draft_tokens)
        target = _load(batch_size + drafts.sum(), self.target_saturation_tokens)
        active = (drafts[:, None] >= np.arange(1, drafts.max(initial=0) + 1)).sum(axis=0)
        draft = np.sum(_load(active, self.draft_saturation_tokens)) if active.size else 0.0
        if catch_up_tokens:
            draft += _load(catch_up_tokens, self.draft_saturation_tokens)
        return float(self.target_seconds * (target + self.draft_ratio * draft))

    def uniform_seconds(self, batch_size: int, k: np.ndarray) -> np.ndarray:
        """Noise-free seconds of steps where every request drafts k (float64 like ``k``)."""
        k = np.asarray(k, np.float64)
        draft = k * _load(float(batch_size), self.draft_saturation_tokens)
        return self.target_seconds * (_load(batch_size * (k + 1), self.target_saturation_tokens)
                                      + self.draft_ratio * draft)


@dataclass(frozen=True)
class Scenario:
    """A workload indexed by simulated time in ticks of ``tick_seconds`` (so every policy faces the same
    conditions for the same wall time, however long its steps are).

    Attributes:
      acceptance: float64[ticks, 1 or max_batch, K_MAX] conditional a_j per request slot.
      batch_size: int[ticks] requests per step.
      cost: the true step cost.
      noise: log-normal sigma of measured step times.
      tick_seconds: length of one tick (default: one batch-1 target forward).
    """

    name: str
    acceptance: np.ndarray
    batch_size: np.ndarray
    cost: StepCost
    noise: float = 0.03
    tick_seconds: float | None = None

    @property
    def ticks(self) -> int:
        return self.batch_size.shape[0]

    @property
    def tick_length(self) -> float:
        return self.cost.target_seconds if self.tick_seconds is None else self.tick_seconds

    @property
    def duration(self) -> float:
        return self.ticks * self.tick_length

    def tick_at(self, clock: float) -> int:
        return min(int(clock / self.tick_length), self.ticks - 1)

    def step_acceptance(self, tick: int) -> np.ndarray:
        """float64[B, K_MAX] conditional acceptance of the requests at ``tick``."""
        a = self.acceptance[tick]
        batch = int(self.batch_size[tick])
        return np.broadcast_to(a, (batch, K_MAX)) if a.shape[0] == 1 else a[:batch]


@dataclass(frozen=True)
class Trace:
    """Per step: start time (simulated seconds), k chosen, tokens emitted, seconds taken."""

    start: np.ndarray
    k: np.ndarray
    emitted: np.ndarray
    seconds: np.ndarray

    @property
    def throughput(self) -> float:
        """Emitted tokens per simulated second over the whole run."""
        return float(self.emitted.sum() / self.seconds.sum())

    def binned_throughput(self, bin_seconds: float) -> tuple[np.ndarray, np.ndarray]:
        """(bin centres, tokens per second) over consecutive windows of ``bin_seconds``."""
        bins = (self.start // bin_seconds).astype(np.int64)
        tokens = np.bincount(bins, weights=self.emitted)
        seconds = np.bincount(bins, weights=self.seconds)
        keep = seconds > 0
        return ((np.arange(tokens.size) + 0.5) * bin_seconds)[keep], tokens[keep] / seconds[keep]


_CHUNK = 256  # steps of random draws made at a time (same sequence for every policy)


def simulate(policy: Policy, scenario: Scenario, seed: int = 0, max_steps: int | None = None) -> Trace:
    """Runs ``policy`` for ``scenario.duration`` simulated seconds (or ``max_steps`` steps if fewer).

    Step n of every policy uses the same draws (common random numbers): a uniform per request slot and
    draft position (draft j accepted iff u < a_j and drafts 1..j-1 were) and a timing-noise factor.
    k = 0 steps skip the draft model ("catch_up"): the next k > 0 step pays one draft forward over the
    missed tokens.
    """
    rng = np.random.default_rng(seed)
    max_batch = int(scenario.batch_size.max())
    columns: list[tuple[float, int, int, float]] = []
    clock, missed = 0.0, 0
    while clock < scenario.duration and (max_steps is None or len(columns) < max_steps):
        n = len(columns) % _CHUNK
        if n == 0:
            uniforms = rng.random((_CHUNK, max_batch, K_MAX + 1))
            uniforms[..., K_MAX] = 2.0  # a sentinel rejection after the last position
            noise = np.exp(scenario.noise * rng.standard_normal(_CHUNK))
        tick = scenario.tick_at(clock)
        batch = int(scenario.batch_size[tick])
        k = policy.next_k(batch)
        drafts = np.full(batch, k)
        accepts = uniforms[n, :batch, :K_MAX] < scenario.step_acceptance(tick)
        leading = np.argmin(np.concatenate([accepts, np.zeros((batch, 1), bool)], axis=1), axis=1)
        accepted = np.minimum(leading, drafts)
        seconds = scenario.cost.seconds(batch, drafts, batch * missed if k > 0 else 0) * noise[n]
        missed = missed + 1 if k == 0 else 0
        columns.append((clock, k, int(accepted.sum()) + batch, seconds))
        clock += seconds
        policy.update(num_draft_tokens=drafts, num_accepted=accepted, step_seconds=seconds, batch_size=batch)
    start, ks, emitted, seconds = (np.array(c) for c in zip(*columns))
    return Trace(start, ks, emitted, seconds)


class FixedPolicy:
    """Always k (the estimation-free equivalent of ``AdaptiveController(mode="fixed")``)."""

    def __init__(self, k: int):
        self.k = k

    def next_k(self, batch_size: int) -> int:
        return self.k

    def update(self, *args: Any, **kwargs: Any) -> None:
        pass


class SharedMachineTimer:
    """Wraps a policy so that it sees step times as on a shared machine: a load factor drifting in
    [1, 2.5] (log-normal steps of ``drift``), 15% jitter and pauses (rate ``pause_rate``, 2-6x).
    The simulated clock keeps the true times: only what the policy measures is disturbed."""

    def __init__(self, policy: Policy, seed: int = 0, drift: float = 0.02, pause_rate: float = 0.08):
        self.policy, self._rng, self._drift, self._pause_rate, self._load = (
            policy, np.random.default_rng(seed), drift, pause_rate, 1.0)

    def next_k(self, batch_size: int) -> int:
        return self.policy.next_k(batch_size)

    def update(self, num_draft_tokens: Any, num_accepted: Any, step_seconds: float | None = None,
               batch_size: int | None = None, **kwargs: Any) -> None:
        rng = self._rng
        self._load = float(np.clip(self._load * np.exp(self._drift * rng.standard_normal()), 1.0, 2.5))
        factor = self._load * np.exp(0.15 * rng.standard_normal())
        if rng.random() < self._pause_rate:
            factor *= rng.uniform(2.0, 6.0)
        self.policy.update(num_draft_tokens, num_accepted, None if step_seconds is None else step_seconds * factor,
                           batch_size, **kwargs)


class OraclePolicy:
    """Knows each step's true acceptance and noise-free cost; picks the k maximising expected goodput."""

    def __init__(self, scenario: Scenario, allowed_k: tuple[int, ...] = tuple(range(K_MAX + 1))):
        self._scenario = scenario
        self._allowed = np.array(allowed_k)
        self._clock = 0.0  # the simulator's clock, rebuilt from the step times

    def next_k(self, batch_size: int) -> int:
        acceptance = self._scenario.step_acceptance(self._scenario.tick_at(self._clock))
        emitted = expected_tokens(acceptance).sum(axis=0)[self._allowed]
        cost = self._scenario.cost.uniform_seconds(batch_size, self._allowed)
        return int(self._allowed[np.argmax(emitted / cost)])

    def update(self, *args: Any, step_seconds: float | None = None, **kwargs: Any) -> None:
        self._clock += step_seconds


# ----------------------------------------------------------------- acceptance processes
def conditional_from_marginal(marginals: tuple[float, ...]) -> np.ndarray:
    """float64[K_MAX] conditional a_j from marginal rates, the last ratio repeated past the list."""
    m = np.asarray(marginals, np.float64)
    ratios = m / np.concatenate([[1.0], m[:-1]])
    return np.concatenate([ratios, np.full(K_MAX - len(ratios), ratios[-1])])[:K_MAX]


def constant_acceptance(ticks: int, a: float | np.ndarray) -> np.ndarray:
    """float64[ticks, 1, K_MAX]: a fixed conditional acceptance (scalar: the same at every position)."""
    return np.broadcast_to(np.broadcast_to(np.asarray(a, np.float64), (K_MAX,)), (ticks, 1, K_MAX))


def drifting_acceptance(ticks: int, low: float, high: float, cycles: float = 1.0) -> np.ndarray:
    """float64[ticks, 1, K_MAX]: a cosine from ``high`` down to ``low`` and back, ``cycles`` times."""
    phase = np.cos(2.0 * np.pi * cycles * np.arange(ticks) / ticks)
    a = low + (high - low) * 0.5 * (1.0 + phase)
    return np.broadcast_to(a[:, None, None], (ticks, 1, K_MAX))


def bursty_acceptance(ticks: int, low: float, high: float, mean_dwell: float, seed: int) -> np.ndarray:
    """float64[ticks, 1, K_MAX]: a two-state Markov switch (e.g. prose vs code), mean dwell in ticks."""
    switches = np.random.default_rng(seed).random(ticks) < 1.0 / mean_dwell
    state = np.cumsum(switches) % 2
    return np.broadcast_to(np.where(state == 0, high, low)[:, None, None], (ticks, 1, K_MAX))


def mixed_acceptance(ticks: int, batch: int, values: tuple[float, ...]) -> np.ndarray:
    """float64[ticks, batch, K_MAX]: request slot b has acceptance values[b % len(values)]."""
    per_slot = np.asarray(values)[np.arange(batch) % len(values)]
    return np.broadcast_to(per_slot[None, :, None], (ticks, batch, K_MAX))


def ramp_batch(ticks: int, low: int, high: int) -> np.ndarray:
    """int[ticks]: batch size rising linearly low -> high over the middle, then back (a load spike)."""
    t = np.arange(ticks) / ticks
    shape = np.clip(np.minimum(t - 0.15, 0.85 - t) / 0.2, 0.0, 1.0)
    return np.round(low + (high - low) * shape).astype(np.int64)


def standard_scenarios(ticks: int = 2000, seed: int = 0) -> list[Scenario]:
    """The benchmark suite: stationary, position-decaying, drifting, bursty, load spike, mixed requests."""
    ones = np.ones(ticks, np.int64)
    flat_cheap, flat = StepCost(draft_ratio=0.02), StepCost(draft_ratio=0.1)
    loaded = StepCost(draft_ratio=0.1, target_saturation_tokens=32.0, draft_saturation_tokens=256.0)
    return [
        Scenario("constant a=0.8, c=0.02, B=1", constant_acceptance(ticks, 0.8), ones, flat_cheap),
        Scenario("constant a=0.6, c=0.3, B=1", constant_acceptance(ticks, 0.6), ones, StepCost(draft_ratio=0.3)),
        Scenario("per-position 0.58/0.34/0.22/0.15/0.11 (marginal), c=0.05, B=1",
                 constant_acceptance(ticks, conditional_from_marginal(DECAYING_MARGINALS)), ones,
                 StepCost(draft_ratio=0.05)),
        Scenario("drifting a 0.9->0.3->0.9, c=0.1, B=1", drifting_acceptance(ticks, 0.3, 0.9), ones, flat),
        Scenario("bursty a 0.9/0.35 (dwell 150 ticks), c=0.05, B=1", bursty_acceptance(ticks, 0.35, 0.9, 150, seed),
                 ones, StepCost(draft_ratio=0.05)),
        Scenario("load spike B 1->64->1, a=0.7, c=0.1, batch-dependent", constant_acceptance(ticks, 0.7),
                 ramp_batch(ticks, 1, 64), loaded),
        Scenario("mixed requests a 0.9/0.3, B=16, batch-dependent", mixed_acceptance(ticks, 16, (0.9, 0.3)),
                 16 * ones, loaded),
    ]
