"""Host-side speculation-length controller: picks k, the drafts per step, from measured acceptance and cost.

With conditional acceptance a_j (the chance draft j is accepted given drafts 1..j-1 were), a step with k
drafts emits on average E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j tokens per request and costs T(k, B)
seconds (``cost_model.StepCostModel``). Modes:

* ``"goodput"`` (default): the k in the allowed set maximising E(k) / T(k, B) at the step's batch size B,
  switching only for a ``switch_margin`` gain after ``min_dwell_steps``, and exploring k + 1 or k - 1 with
  probability ``explore_prob`` so estimates for other k stay fresh.
* ``"target"``: the seed rule; raise k while the acceptance ratio (accepted / drafted) is above
  ``target_acceptance + target_band``, lower it while below ``target_acceptance - target_band``.
* ``"fixed"``: always ``k_init``.

k = 0 (no speculation) keeps the draft model's KV cache current in one of two ways (``draft_sync``):
``"catch_up"`` (default): the draft model skips k = 0 steps, and the next k > 0 step first runs one draft
forward over the tokens it missed (all of them in parallel, like a short prefill), so k = 0 costs no draft
time; ``"forward"``: every k = 0 step still runs one draft forward over the emitted token to append its KV.
The cost model charges k = 0 steps accordingly (0 or 1 draft forwards).

Call ``next_k(batch_size)`` before each step and ``update(...)`` with the step's per-request counts after.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

import numpy as np

from scv_jax.adaptive.cost_model import CostPrior, StepCostModel, step_features

Mode = Literal["goodput", "target", "fixed"]
_MAX_ACCEPTANCE = 0.999


def expected_tokens(conditional_acceptance: np.ndarray) -> np.ndarray:
    """E(k) for k = 0..K: float64[..., K + 1] expected emitted tokens per request from float[..., K] a_j."""
    a = np.asarray(conditional_acceptance, np.float64)
    reach = np.cumprod(a, axis=-1)
    return np.concatenate([np.ones(a.shape[:-1] + (1,)), 1.0 + np.cumsum(reach, axis=-1)], axis=-1)


@dataclass(frozen=True)
class ControllerConfig:
    """Settings of ``AdaptiveController``; all checked on construction.

    Attributes:
      mode: "goodput", "target" or "fixed".
      k_min, k_max: bounds of k (0 <= k_min <= k_max).
      allowed_k: the k values that may be chosen (within [k_min, k_max]); None: all of them.
      k_init: k of "fixed" mode and of warm-up; None: the largest allowed k.
      target_acceptance: "target" mode's acceptance ratio, in (0, 1).
      target_band: "target" mode's hysteresis half-width.
      switch_margin: "goodput" switches only for a relative gain above this.
      min_dwell_steps: steps to hold a k before switching again.
      explore_prob: chance per step that "goodput" tries a neighbouring k.
      warmup_steps: steps before the first decision (alternating k_init and the smallest positive k).
      acceptance_decay: forgetting factor per step of the acceptance counts, in (0, 1].
      prior_acceptance, prior_strength: prior of a_1 (later positions default to the estimate of the
        previous one) and how many observations it is worth.
      cost_prior: the default cost model (``cost_model.CostPrior``), used until measured step times
        arrive and as their regulariser.
      cost_decay: forgetting factor per timed step of the cost model.
      draft_sync: how k = 0 keeps the draft cache current: "catch_up" or "forward" (module doc).
      per_request: track acceptance per request id; ``request_k`` then trims poor requests' drafts.
      max_tracked_requests: per-request estimates kept (least recently updated dropped first).
      seed: seed of the exploration draws.
    """

    mode: Mode = "goodput"
    k_min: int = 0
    k_max: int = 8
    allowed_k: tuple[int, ...] | None = None
    k_init: int | None = None
    target_acceptance: float = 0.6
    target_band: float = 0.05
    switch_margin: float = 0.02
    min_dwell_steps: int = 4
    explore_prob: float = 0.05
    warmup_steps: int = 8
    acceptance_decay: float = 0.97
    prior_acceptance: float = 0.7
    prior_strength: float = 2.0
    cost_prior: CostPrior = CostPrior()
    cost_decay: float = 0.98
    draft_sync: Literal["catch_up", "forward"] = "catch_up"
    per_request: bool = False
    max_tracked_requests: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        def fail(name: str, expected: str) -> None:
            raise ValueError(f"ControllerConfig: {name} must be {expected}, got {getattr(self, name)!r}")

        if self.mode not in ("goodput", "target", "fixed"):
            fail("mode", 'one of "goodput", "target", "fixed"')
        for name in ("k_min", "k_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                fail(name, "a non-negative int")
        if self.k_min > self.k_max:
            raise ValueError(f"ControllerConfig: k_min ({self.k_min}) must be <= k_max ({self.k_max})")
        if self.allowed_k is not None:
            object.__setattr__(self, "allowed_k", tuple(sorted({int(k) for k in self.allowed_k})))
        if not self.allowed:
            fail("allowed_k", f"a non-empty set with values in [k_min, k_max] = [{self.k_min}, {self.k_max}]")
        if self.k_init is not None and self.k_init not in self.allowed:
            fail("k_init", f"one of the allowed k {self.allowed}")
        if not 0.0 < self.target_acceptance < 1.0:
            fail("target_acceptance", "in (0, 1)")
        if not 0.0 < self.prior_acceptance < 1.0:
            fail("prior_acceptance", "in (0, 1)")
        for name in ("acceptance_decay", "cost_decay"):
            if not 0.0 < getattr(self, name) <= 1.0:
                fail(name, "in (0, 1]")
        if not 0.0 <= self.explore_prob < 1.0:
            fail("explore_prob", "in [0, 1)")
        for name in ("target_band", "switch_margin", "min_dwell_steps", "warmup_steps", "prior_strength"):
            if getattr(self, name) < 0:
                fail(name, ">= 0")
        if not isinstance(self.cost_prior, CostPrior):
            fail("cost_prior", "a CostPrior")
        if not self.max_tracked_requests > 0:
            fail("max_tracked_requests", "> 0")
        if self.draft_sync not in ("catch_up", "forward"):
            fail("draft_sync", 'one of "catch_up", "forward"')

    @property
    def allowed(self) -> tuple[int, ...]:
        """The choosable k values, ascending."""
        candidates = range(self.k_min, self.k_max + 1) if self.allowed_k is None else self.allowed_k
        return tuple(k for k in candidates if self.k_min <= k <= self.k_max)


class AdaptiveController:
    """Chooses the number of draft tokens per step (see the module doc). Host-side, numpy only.

    Build with a ``ControllerConfig`` and/or its fields as keywords:
    ``AdaptiveController(mode="target", target_acceptance=0.5, k_max=6)``.
    """

    def __init__(self, config: ControllerConfig | None = None, **overrides: Any):
        config = config or ControllerConfig()
        self.config = replace(config, **overrides) if overrides else config
        cfg = self.config
        self._allowed = np.array(cfg.allowed)
        self._k_init = cfg.k_init if cfg.k_init is not None else int(self._allowed[-1])
        positive = self._allowed[self._allowed > 0]
        self._k_probe = int(positive[0]) if positive.size else self._k_init
        self._success = np.zeros(cfg.k_max)  # decayed accepted counts per draft position
        self._trials = np.zeros(cfg.k_max)  # decayed counts of drafts reached per position
        self._acceptance: np.ndarray | None = None  # cache of ``acceptance()``
        self._cost = StepCostModel(cfg.cost_prior, decay=cfg.cost_decay)
        self._rng = np.random.default_rng(cfg.seed)
        self._requests: OrderedDict[Any, np.ndarray] = OrderedDict()  # id -> [accepted, expected]
        self._k = self._k_init  # the held choice; exploration and warm-up steps do not change it
        self._last_k = self._k_init
        self._last_explored = False
        self._last_batch = 1
        self._steps = 0
        self._since_switch = 0
        self._num_explored = 0
        self._k_counts = np.zeros(cfg.k_max + 1, np.int64)
        self._totals = np.zeros(4)  # drafted, accepted, emitted, timed seconds

    # ----------------------------------------------------------------- estimates
    def acceptance(self) -> np.ndarray:
        """float64[k_max] estimated conditional acceptance a_j per draft position j = 1..k_max.

        Each position's decayed counts are shrunk toward the previous position's estimate (position 1
        toward ``prior_acceptance``) with weight ``prior_strength``, so unobserved positions extrapolate.
        """
        if self._acceptance is None:
            cfg = self.config
            out = np.empty(cfg.k_max)
            prior = cfg.prior_acceptance
            for j, (success, trials) in enumerate(zip(self._success.tolist(), self._trials.tolist())):
                prior = (success + cfg.prior_strength * prior) / (trials + cfg.prior_strength)
                out[j] = prior
            self._acceptance = np.clip(out, 0.0, _MAX_ACCEPTANCE)
        return self._acceptance.copy()

    def _draft_forwards(self, k: np.ndarray) -> np.ndarray:
        return np.maximum(k, 1) if self.config.draft_sync == "forward" else k

    def predicted_step_cost(self, batch_size: int, k: np.ndarray | None = None) -> np.ndarray:
        """Predicted seconds (target-forward units before any timing) of a step with each k at batch B."""
        k = self._allowed if k is None else np.asarray(k)
        return self._cost.predict(step_features(batch_size, batch_size * k, self._draft_forwards(k)))

    def predicted_goodput(self, batch_size: int) -> np.ndarray:
        """float64[len(allowed)] expected emitted tokens per second for each allowed k at batch B."""
        emitted = expected_tokens(self.acceptance())[self._allowed]
        return batch_size * emitted / self.predicted_step_cost(batch_size)

    # ----------------------------------------------------------------- decisions
    def next_k(self, batch_size: int) -> int:
        """The number of drafts for the coming step of ``batch_size`` requests (the batch the step
        computes, padding included: the cost model's batch size; the choice does not depend on how
        many of them are real)."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"AdaptiveController.next_k: batch_size must be a positive int, got {batch_size!r}")
        cfg = self.config
        self._last_explored = False
        if cfg.mode == "fixed":
            k = self._k_init
        elif self._steps < cfg.warmup_steps:
            k = self._k_init if self._steps % 2 == 0 else self._k_probe
        else:
            if self._since_switch >= cfg.min_dwell_steps:
                choice = self._choose_goodput(batch_size) if cfg.mode == "goodput" else self._choose_target()
                if choice != self._k:
                    self._k, self._since_switch = choice, 0
            k = self._k
            if cfg.mode == "goodput" and self._rng.random() < cfg.explore_prob:
                k, self._last_explored = self._neighbour(k), True
        self._last_k = int(k)
        return self._last_k

    def _choose_goodput(self, batch_size: int) -> int:
        goodput = self.predicted_goodput(batch_size)
        best = int(np.argmax(goodput))
        current = goodput[np.searchsorted(self._allowed, self._k)]
        if goodput[best] > current * (1.0 + self.config.switch_margin):
            return int(self._allowed[best])
        return self._k

    def _choose_target(self) -> int:
        """One step of the seed rule, using the estimated ratio at the current k and the one above."""
        cfg = self.config
        index = int(np.searchsorted(self._allowed, self._k))
        emitted = expected_tokens(self.acceptance())
        ratio = lambda k: (emitted[k] - 1.0) / k if k > 0 else 1.0  # noqa: E731
        if ratio(self._k) < cfg.target_acceptance - cfg.target_band and index > 0:
            return int(self._allowed[index - 1])
        if index + 1 < len(self._allowed):
            up = int(self._allowed[index + 1])
            if (ratio(self._k) > cfg.target_acceptance + cfg.target_band
                    and ratio(up) >= cfg.target_acceptance - cfg.target_band):
                return up
        return self._k

    def _neighbour(self, k: int) -> int:
        """k + 1 or k - 1 (within the allowed set), at random."""
        index = int(np.searchsorted(self._allowed, k))
        up = index + 1 < len(self._allowed)
        if up and (index == 0 or self._rng.random() < 0.5):
            return int(self._allowed[index + 1])
        return int(self._allowed[max(index - 1, 0)])

    def request_k(self, request_ids: Any) -> np.ndarray:
        """int32[B] drafts per request within the last ``next_k``; needs ``per_request=True``.

        A request drafts position i only while its chance of reaching and accepting it exceeds the step's
        tokens-per-second times the marginal cost of one more draft token (target + draft per-token cost).
        Requests without history use the shared estimate.
        """
        if not self.config.per_request:
            raise ValueError("AdaptiveController.request_k needs ControllerConfig(per_request=True)")
        ids = list(request_ids)
        k = self._last_k
        if k == 0 or not ids:
            return np.full(len(ids), k, np.int32)
        a = self.acceptance()[:k]
        scale = np.array([self._request_scale(i) for i in ids])
        reach = np.cumprod(np.clip(scale[:, None] * a, 0.0, _MAX_ACCEPTANCE), axis=1)
        batch = len(ids)
        rate = batch * expected_tokens(a)[k] / float(self.predicted_step_cost(batch, np.array([k]))[0])
        theta = self._cost.coefficients(batch)
        threshold = rate * max(theta[1] + theta[3], 0.0)
        return np.sum(reach >= threshold, axis=1).astype(np.int32)

    def _request_scale(self, request_id: Any) -> float:
        accepted, expected = self._requests.get(request_id, (0.0, 0.0))
        return (accepted + self.config.prior_strength) / (expected + self.config.prior_strength)

    # ----------------------------------------------------------------- observations
    def update(self, num_draft_tokens: Any, num_accepted: Any, step_seconds: float | None = None,
               batch_size: int | None = None, request_ids: Any = None) -> None:
        """Records one step.

        Args:
          num_draft_tokens: int[B] drafts each request had this step (<= k_max).
          num_accepted: int[B] drafts accepted per request (<= num_draft_tokens).
          step_seconds: measured wall time of the step (draft + verify), or None if not timed.
          batch_size: requests the step computed, for the cost model (B plus padding rows, which
            draft max(num_draft_tokens) each); default B.
          request_ids: [B] hashable ids, for ``per_request`` estimates.
        """
        drafts = np.asarray(num_draft_tokens)
        accepted = np.asarray(num_accepted)
        self._check_counts(drafts, accepted)
        drafts = drafts.astype(np.int64)
        accepted = accepted.astype(np.int64)
        batch = drafts.shape[0] if batch_size is None else max(int(batch_size), drafts.shape[0])
        self._last_batch = max(batch, 1)
        cfg = self.config
        # Request b reached positions 1..min(d_b, n_b + 1) and accepted 1..n_b.
        reached_upto = np.minimum(drafts, accepted + 1)
        at_least = lambda x: np.cumsum(np.bincount(x, minlength=cfg.k_max + 1)[::-1])[::-1][1:]  # noqa: E731
        self._trials = cfg.acceptance_decay * self._trials + at_least(reached_upto)
        self._success = cfg.acceptance_decay * self._success + at_least(accepted)
        self._acceptance = None
        if step_seconds is not None:
            most = int(drafts.max(initial=0))
            padded_drafts = drafts.sum() + (batch - drafts.shape[0]) * most
            self._cost.observe(step_features(batch, padded_drafts, int(self._draft_forwards(np.array(most)))),
                               float(step_seconds))
            self._totals[3] += float(step_seconds)
        if cfg.per_request and request_ids is not None:
            self._update_requests(list(request_ids), reached_upto, accepted)
        self._totals[:3] += (drafts.sum(), accepted.sum(), accepted.sum() + drafts.shape[0])
        self._k_counts[self._last_k] += 1
        self._num_explored += self._last_explored
        self._steps += 1
        self._since_switch += 1

    def _update_requests(self, ids: list, reached_upto: np.ndarray, accepted: np.ndarray) -> None:
        """Per request: decayed accepted drafts and their expectation under the shared estimate."""
        if len(ids) != reached_upto.shape[0]:
            raise ValueError(f"AdaptiveController.update: request_ids must have {reached_upto.shape[0]} "
                             f"entries (one per request), got {len(ids)}")
        expected = np.concatenate([[0.0], np.cumsum(self.acceptance())])[reached_upto]
        for request_id, n, e in zip(ids, accepted, expected):
            counts = self._requests.pop(request_id, np.zeros(2))
            self._requests[request_id] = self.config.acceptance_decay * counts + (n, e)
        while len(self._requests) > self.config.max_tracked_requests:
            self._requests.popitem(last=False)

    def _check_counts(self, drafts: np.ndarray, accepted: np.ndarray) -> None:
        where = "AdaptiveController.update"
        for name, x in (("num_draft_tokens", drafts), ("num_accepted", accepted)):
            if x.ndim != 1 or not np.issubdtype(x.dtype, np.integer):
                raise ValueError(f"{where}: {name} must be an int[B] vector, got shape {x.shape} dtype {x.dtype}")
        if drafts.shape != accepted.shape:
            raise ValueError(f"{where}: num_draft_tokens {drafts.shape} and num_accepted {accepted.shape} "
                             "must have the same shape [B]")
        if drafts.size and (drafts.min() < 0 or drafts.max() > self.config.k_max):
            raise ValueError(f"{where}: num_draft_tokens must be in [0, k_max={self.config.k_max}]")
        if drafts.size and (accepted.min() < 0 or (accepted > drafts).any()):
            raise ValueError(f"{where}: num_accepted must be in [0, num_draft_tokens] per request")

    # ----------------------------------------------------------------- reporting
    def state(self) -> dict[str, Any]:
        """A snapshot for per-step logging: last k, held k, estimates and cost model."""
        return {
            "step": self._steps,
            "mode": self.config.mode,
            "k": self._last_k,
            "held_k": self._k,
            "explored": self._last_explored,
            "warming_up": self._steps < self.config.warmup_steps,
            "acceptance": self.acceptance(),
            "expected_tokens": expected_tokens(self.acceptance()),
            "cost_coefficients": self._cost.coefficients(self._last_batch),
            "cost_timed": self._cost.timed,
        }

    def summary(self) -> dict[str, Any]:
        """Totals since construction: steps, k histogram, acceptance ratio, tokens per step and second."""
        drafted, accepted, emitted, seconds = self._totals
        steps = max(self._steps, 1)
        return {
            "steps": self._steps,
            "mode": self.config.mode,
            "k_histogram": {int(k): int(n) for k, n in enumerate(self._k_counts) if n},
            "mean_k": float(self._k_counts @ np.arange(self.config.k_max + 1) / steps),
            "acceptance_ratio": float(accepted / drafted) if drafted else float("nan"),
            "emitted_tokens": int(emitted),
            "tokens_per_step": float(emitted / steps),
            "tokens_per_second": float(emitted / seconds) if seconds else float("nan"),
            "explored_steps": self._num_explored,
            "skipped_timings": self._cost.num_skipped,
            "config": asdict(self.config),
        }


__all__ = ["AdaptiveController", "ControllerConfig", "expected_tokens"]
