"""Host-side speculation-length controller: picks k, the drafts per step, from measured acceptance and cost.

With conditional acceptance a_j (the chance draft j is accepted given drafts 1..j-1 were), a step with k
drafts emits on average E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j tokens per request and costs T(k, B)
seconds (``cost_model``: the measured time of each (B, k) shape, blended with a linear model for shapes
measured rarely or never). With ``per_request``, each request's acceptance is tracked as a scale of the
shared a_j, and E(k) is the mean over the requests of the coming step: when requests with very
different acceptance share a batch, the choice follows the batch that is actually running (e.g. it
drops k as soon as the repetitive requests finish). Modes:

* ``"goodput"`` (default): the k in the allowed set maximising E(k) / T(k, B) at the step's batch size B,
  switching only for a ``switch_margin`` gain after ``min_dwell_steps``, and exploring with probability
  ``explore_prob`` another k whose predicted goodput is within 15% of the best (a neighbour when none is),
  so estimates for the plausible k stay fresh.
* ``"target"``: the seed rule; raise k while the acceptance ratio (accepted / drafted) is above
  ``target_acceptance + target_band``, lower it while below ``target_acceptance - target_band``.
* ``"fixed"``: always ``k_init``.

k = 0 (no speculation) keeps the draft model's KV cache current in one of two ways (``draft_sync``):
``"catch_up"`` (default): the draft model skips k = 0 steps, and the next k > 0 step first runs one draft
forward over the tokens it missed (all of them in parallel, like a short prefill), so k = 0 costs no draft
time; ``"forward"``: every k = 0 step still runs one draft forward over the emitted token to append its KV.
The cost model charges k = 0 steps accordingly (0 or 1 draft forwards). Drafters without a model
(``draft_model=False``, e.g. n-gram prompt lookup) cost no draft forwards at all.

Call ``next_k(batch_size)`` before each step and ``update(...)`` with the step's per-request counts after.
Both are cheap enough for every step (a few vectorised numpy operations, no Python loop over requests;
``benchmarks/bench_controller.py``).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

import numpy as np

from scv_jax.adaptive.cost_model import CostPrior, StepCostModel, StepCostTable

Mode = Literal["goodput", "target", "fixed"]
_MAX_ACCEPTANCE = 0.999
_PLAUSIBLE = 0.15          # exploration tries the k whose predicted goodput is within 15% of the best


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
      explore_prob: chance per step that "goodput" tries another plausible k.
      warmup_steps: steps before the first decision (alternating k_init and the smallest positive k).
      acceptance_decay: forgetting factor per step of the acceptance counts, in (0, 1].
      prior_acceptance, prior_strength: prior of a_1 (later positions default to the estimate of the
        previous one) and how many observations it is worth.
      cost_prior: the default cost model (``cost_model.CostPrior``), used until measured step times
        arrive and as their regulariser.
      cost_decay: forgetting factor per timed step of the cost model.
      draft_sync: how k = 0 keeps the draft cache current: "catch_up" or "forward" (module doc).
      draft_model: False for drafters that cost no device forwards (n-gram prompt lookup).
      per_request: track acceptance per request id (non-negative ints): ``next_k`` then weighs the
        coming step's requests, and ``request_k`` trims poor requests' drafts.
      max_tracked_requests: per-request estimates kept; ids share a slot modulo this (a request
        whose slot another id held starts from the shared estimate).
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
    draft_model: bool = True
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
        if isinstance(self.max_tracked_requests, bool) or not isinstance(self.max_tracked_requests, (int, np.integer)) \
                or not self.max_tracked_requests > 0:
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
        self._allowed_list = list(cfg.allowed)
        self._allowed = np.array(self._allowed_list)
        self._k_init = cfg.k_init if cfg.k_init is not None else self._allowed_list[-1]
        positive = [k for k in self._allowed_list if k > 0]
        self._k_probe = positive[0] if positive else self._k_init
        self._success = [0.0] * cfg.k_max   # decayed accepted counts per draft position
        self._trials = [0.0] * cfg.k_max    # decayed counts of drafts reached per position
        self._acceptance: list[float] | None = None  # cache of ``acceptance()``
        self._acceptance_sums = np.zeros(cfg.k_max + 1)
        self._model = StepCostModel(cfg.cost_prior, decay=cfg.cost_decay)
        self._table = StepCostTable(self._model, tuple(self._allowed_list),
                                    tuple(self._forwards(k) for k in self._allowed_list),
                                    draft_model=cfg.draft_model, decay=cfg.cost_decay)
        self._rng = random.Random(cfg.seed)
        # per request (slot = id % max_tracked_requests): its id, decayed accepted drafts and their
        # expectation under the shared estimate
        self._request_owner = np.full(cfg.max_tracked_requests, -1, np.int64)
        self._request_counts = np.zeros((cfg.max_tracked_requests, 2))
        # the requests of the last update, their counts (stored back when the batch changes) and mean reach
        self._batch_ids: np.ndarray | None = None
        self._batch_counts = np.zeros((0, 2))
        self._batch_reach: list[float] = []
        self._same_ids: np.ndarray | None = None
        self._acceptance_array: np.ndarray | None = None
        self._k = self._k_init  # the held choice; exploration and warm-up steps do not change it
        self._last_k = self._k_init
        self._last_explored = False
        self._last_batch = 1
        self._steps = 0
        self._since_switch = 0
        self._num_explored = 0
        self._k_counts = [0] * (cfg.k_max + 1)
        self._totals = [0.0, 0.0, 0.0, 0.0]  # drafted, accepted, emitted, timed seconds

    # ----------------------------------------------------------------- estimates
    def _shared(self) -> list[float]:
        """The shared a_j as a list (see ``acceptance``), and its running sums (for ``_expected``)."""
        if self._acceptance is None:
            cfg = self.config
            out, prior, strength = [], cfg.prior_acceptance, cfg.prior_strength
            running, sums = 0.0, [0.0]
            for success, trials in zip(self._success, self._trials):
                prior = (success + strength * prior) / (trials + strength)
                a = prior if prior < _MAX_ACCEPTANCE else _MAX_ACCEPTANCE
                out.append(a)
                running += a
                sums.append(running)
            self._acceptance, self._acceptance_sums = out, np.array(sums)
        return self._acceptance

    def acceptance(self) -> np.ndarray:
        """float64[k_max] estimated conditional acceptance a_j per draft position j = 1..k_max.

        Each position's decayed counts are shrunk toward the previous position's estimate (position 1
        toward ``prior_acceptance``) with weight ``prior_strength``, so unobserved positions extrapolate.
        """
        return np.array(self._shared())

    def _forwards(self, k: int) -> int:
        """Sequential draft forwards of a step with k drafts."""
        if not self.config.draft_model:
            return 0
        return max(k, 1) if self.config.draft_sync == "forward" else k

    def _step_seconds(self, batch_size: int, k: int) -> float:
        """Predicted seconds of a step with k drafts per request at batch B (a dense step)."""
        column = self._table.columns.get(k)
        if column is None:
            drafts = batch_size * k
            return self._table.load * self._model.predict_one(batch_size, drafts, self._forwards(k),
                                                               drafts * self.config.draft_model)
        return self._table.row(batch_size)[column]

    def predicted_step_cost(self, batch_size: int, k: np.ndarray | None = None) -> np.ndarray:
        """Predicted seconds (target-forward units before any timing) of a step with each k at batch B."""
        ks = self._allowed_list if k is None else np.asarray(k).reshape(-1).tolist()
        return np.array([self._step_seconds(int(batch_size), int(v)) for v in ks])

    def _reach(self, request_ids: Any = None) -> list[float]:
        """Mean over the requests of P(draft j accepted), j = 1..k_max: the shared estimate, or with
        ``per_request`` and ids the mean over those requests of their scaled estimates."""
        if self.config.per_request and request_ids is not None:
            ids = np.asarray(request_ids)
            if self._is_current_batch(ids):
                return self._batch_reach
            if ids.size:
                return self._mixture(self._stored_counts(ids))
        reach, running = [], 1.0
        for a in self._shared():
            running *= a
            reach.append(running)
        return reach

    def _is_current_batch(self, ids: np.ndarray) -> bool:
        """Whether ``ids`` are the requests of the last update, in order (remembered by identity)."""
        if ids is self._same_ids:
            return True
        current = self._batch_ids
        same = current is not None and current.shape == ids.shape and bool((current == ids).all())
        self._same_ids = ids if same else None
        return same

    def _stored_counts(self, ids: np.ndarray) -> np.ndarray:
        """float64[B, 2] the (accepted, expected) counts of requests (0 for unknown ones)."""
        if self._batch_ids is not None:     # the last update's requests: their counts go to the store
            slots = self._batch_ids % self.config.max_tracked_requests
            self._request_counts[slots] = self._batch_counts
            self._request_owner[slots] = self._batch_ids
        slots = ids % self.config.max_tracked_requests
        return np.where((self._request_owner[slots] == ids)[:, None], self._request_counts[slots], 0.0)

    def _mixture(self, counts: np.ndarray) -> list[float]:
        """The mean reach of requests with (accepted, expected) ``counts``: each scales the shared a_j by
        (accepted + s) / (expected + s), s = ``prior_strength``."""
        scaled = counts + self.config.prior_strength
        reach = np.minimum(np.multiply.outer(scaled[:, 0] / scaled[:, 1], self._shared_array()), _MAX_ACCEPTANCE)
        return (reach.cumprod(axis=1).sum(axis=0) * (1.0 / counts.shape[0])).tolist()

    def _shared_array(self) -> np.ndarray:
        if self._acceptance_array is None:
            self._acceptance_array = np.array(self._shared())
        return self._acceptance_array

    def predicted_goodput(self, batch_size: int, request_ids: Any = None) -> np.ndarray:
        """float64[len(allowed)] expected emitted tokens per second for each allowed k at batch B."""
        emitted = np.cumsum([1.0] + self._reach(request_ids))[self._allowed]
        return batch_size * emitted / self.predicted_step_cost(batch_size)

    # ----------------------------------------------------------------- decisions
    def next_k(self, batch_size: int, request_ids: Any = None) -> int:
        """The number of drafts for the coming step of ``batch_size`` requests (the batch the step
        computes, padding included: the cost model's batch size; the choice does not depend on how
        many of them are real). ``request_ids``: the step's requests (with ``per_request``, the
        expected tokens are theirs)."""
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
                choice = (self._choose_goodput(int(batch_size), request_ids) if cfg.mode == "goodput"
                          else self._choose_target())
                if choice != self._k:
                    self._k, self._since_switch = choice, 0
            k = self._k
            if cfg.mode == "goodput" and self._rng.random() < cfg.explore_prob:
                k, self._last_explored = self._explored(k, int(batch_size), request_ids), True
                self._num_explored += 1
        self._last_k = int(k)
        return self._last_k

    def _rates(self, batch_size: int, request_ids: Any) -> list[float]:
        """Expected emitted tokens per unit of cost (the load cancels) of each allowed k."""
        emitted, total = [1.0], 1.0
        for r in self._reach(request_ids):
            total += r
            emitted.append(total)
        return [emitted[k] / cost for k, cost in zip(self._allowed_list, self._table.relative(batch_size))]

    def _choose_goodput(self, batch_size: int, request_ids: Any) -> int:
        rates = self._rates(batch_size, request_ids)
        best = max(range(len(rates)), key=rates.__getitem__)
        current = rates[self._allowed_list.index(self._k)]
        if rates[best] > current * (1.0 + self.config.switch_margin):
            return self._allowed_list[best]
        return self._k

    def _choose_target(self) -> int:
        """One step of the seed rule, using the estimated ratio at the current k and the one above."""
        cfg = self.config
        index = self._allowed_list.index(self._k)
        emitted = expected_tokens(self.acceptance())
        ratio = lambda k: (emitted[k] - 1.0) / k if k > 0 else 1.0  # noqa: E731
        if ratio(self._k) < cfg.target_acceptance - cfg.target_band and index > 0:
            return self._allowed_list[index - 1]
        if index + 1 < len(self._allowed_list):
            up = self._allowed_list[index + 1]
            if (ratio(self._k) > cfg.target_acceptance + cfg.target_band
                    and ratio(up) >= cfg.target_acceptance - cfg.target_band):
                return up
        return self._k

    def _explored(self, k: int, batch_size: int, request_ids: Any) -> int:
        """Another k to try: one of those whose predicted goodput is within ``_PLAUSIBLE`` of the best (its
        cost or acceptance may be mispredicted, e.g. a shape rarely measured), at random; a neighbour of
        k when none is."""
        allowed = self._allowed_list
        rates = self._rates(batch_size, request_ids)
        floor = (1.0 - _PLAUSIBLE) * max(rates)
        plausible = [other for other, rate in zip(allowed, rates) if other != k and rate >= floor]
        if plausible:
            return plausible[int(self._rng.random() * len(plausible))]
        index = allowed.index(k)
        up = index + 1 < len(allowed)
        if up and (index == 0 or self._rng.random() < 0.5):
            return allowed[index + 1]
        return allowed[max(index - 1, 0)]

    def request_k(self, request_ids: Any) -> np.ndarray:
        """int32[B] drafts per request within the last ``next_k``; needs ``per_request=True``.

        For engines whose step cost grows with each request's own drafts (a packed verify forward):
        a request drafts position i only while its chance of reaching and accepting it exceeds the
        step's tokens-per-second times the marginal cost of one more draft token (target + draft
        per-token cost). Requests without history use the shared estimate. (In a dense [B, k + 1]
        step, as ``SpeculativeDecoder`` runs, a trimmed draft saves nothing, so it verifies them all.)
        """
        if not self.config.per_request:
            raise ValueError("AdaptiveController.request_k needs ControllerConfig(per_request=True)")
        ids = np.asarray(list(request_ids) if not isinstance(request_ids, np.ndarray) else request_ids,
                         np.int64).reshape(-1)
        k = self._last_k
        if k == 0 or not ids.size:
            return np.full(ids.size, k, np.int32)
        a = np.array(self._shared()[:k])
        counts = (self._batch_counts if self._is_current_batch(ids) else self._stored_counts(ids)) \
            + self.config.prior_strength
        reach = np.cumprod(np.clip((counts[:, 0] / counts[:, 1])[:, None] * a, 0.0, _MAX_ACCEPTANCE), axis=1)
        batch = ids.size
        rate = batch * expected_tokens(a)[k] / self._step_seconds(batch, k)
        theta = self._model.coefficients(batch)
        threshold = rate * max(theta[1] + theta[3], 0.0)
        return np.sum(reach >= threshold, axis=1).astype(np.int32)

    # ----------------------------------------------------------------- observations
    def update(self, num_draft_tokens: Any, num_accepted: Any, step_seconds: float | None = None,
               batch_size: int | None = None, request_ids: Any = None, *, step_k: int | None = None) -> None:
        """Records one step.

        Args:
          num_draft_tokens: int[B] drafts each request verified this step (<= k_max).
          num_accepted: int[B] drafts accepted per request (<= num_draft_tokens).
          step_seconds: measured wall time of the step (draft + verify), or None if not timed.
          batch_size: requests the step computed, for the cost model (B plus padding rows); default B.
          request_ids: int[B] non-negative request ids, for ``per_request`` estimates.
          step_k: the drafts per request the step computed, for a dense [batch_size, k + 1] step (the
            cost model is charged ``batch_size * step_k`` draft tokens). None: each request computed
            its own drafts and padding rows ``max(num_draft_tokens)`` (a packed step).
        """
        drafts, accepted = self._checked_counts(num_draft_tokens, num_accepted)
        cfg = self.config
        batch = drafts.shape[0] if batch_size is None else max(int(batch_size), drafts.shape[0])
        self._last_batch = max(batch, 1)
        # Request b reached positions 1..min(d_b, n_b + 1) and accepted 1..n_b.
        reached = np.minimum(drafts, accepted + 1)
        try:
            reached_at = np.bincount(reached, minlength=cfg.k_max + 1).tolist()
            accepted_at = np.bincount(accepted, minlength=cfg.k_max + 1).tolist()
        except ValueError:       # a negative count
            self._count_error(drafts)
        decay, trials, success = cfg.acceptance_decay, self._trials, self._success
        reached_total = accepted_total = 0
        for j in range(cfg.k_max, 0, -1):     # every position forgets: unreached ones drift to the one before
            reached_total += reached_at[j]
            accepted_total += accepted_at[j]
            trials[j - 1] = decay * trials[j - 1] + reached_total
            success[j - 1] = decay * success[j - 1] + accepted_total
        self._acceptance = self._acceptance_array = None
        if cfg.per_request and request_ids is not None:
            self._update_requests(np.asarray(request_ids), reached, accepted)
        if step_seconds is not None:
            self._observe_cost(batch, drafts, step_k, float(step_seconds))
        drafted, accepted_sum = int(drafts.sum()), int(accepted.sum())
        totals = self._totals
        totals[0] += drafted
        totals[1] += accepted_sum
        totals[2] += accepted_sum + drafts.shape[0]
        self._k_counts[self._last_k if step_k is None else step_k] += 1
        self._steps += 1
        self._since_switch += 1

    def _observe_cost(self, batch: int, drafts: np.ndarray, step_k: int | None, seconds: float) -> None:
        if step_k is None:
            k = int(drafts.max(initial=0))
            draft_tokens = int(drafts.sum()) + (batch - drafts.shape[0]) * k
        else:
            k, draft_tokens = int(step_k), batch * int(step_k)
        features = (1.0, float(batch + draft_tokens), float(self._forwards(k)),
                    float(draft_tokens * self.config.draft_model))
        shape = k if draft_tokens == batch * k else None       # a dense step of one of the table's shapes
        if self._table.observe(batch, shape, features, seconds):
            self._totals[3] += seconds

    def _update_requests(self, ids: np.ndarray, reached: np.ndarray, accepted: np.ndarray) -> None:
        """Per request: decayed accepted drafts and their expectation under the shared estimate; then
        the mean reach of these requests (the next step's, unless some finish)."""
        if ids.shape != reached.shape or ids.dtype.kind not in "iu":
            raise ValueError(f"AdaptiveController.update: request_ids must be {reached.shape[0]} non-negative "
                             f"ints (one per request), got {ids.shape} of dtype {ids.dtype}")
        cfg = self.config
        if not self._is_current_batch(ids):
            self._batch_counts = self._stored_counts(ids)
            self._batch_ids = self._same_ids = ids.copy()
        counts = self._batch_counts
        counts *= cfg.acceptance_decay
        counts[:, 0] += accepted
        self._shared()
        counts[:, 1] += self._acceptance_sums[reached]     # sum of a_j over the positions each reached
        self._batch_reach = self._mixture(counts)

    def _checked_counts(self, num_draft_tokens: Any, num_accepted: Any) -> tuple[np.ndarray, np.ndarray]:
        where = "AdaptiveController.update"
        drafts, accepted = np.asarray(num_draft_tokens), np.asarray(num_accepted)
        for name, x in (("num_draft_tokens", drafts), ("num_accepted", accepted)):
            if x.ndim != 1 or x.dtype.kind not in "iu":
                raise ValueError(f"{where}: {name} must be an int[B] vector, got shape {x.shape} dtype {x.dtype}")
        if drafts.shape != accepted.shape:
            raise ValueError(f"{where}: num_draft_tokens {drafts.shape} and num_accepted {accepted.shape} "
                             "must have the same shape [B]")
        if drafts.size and ((accepted > drafts).any() or drafts.max() > self.config.k_max):
            self._count_error(drafts)
        return drafts, accepted

    def _count_error(self, drafts: np.ndarray) -> None:
        where = "AdaptiveController.update"
        if drafts.min() < 0 or drafts.max() > self.config.k_max:
            raise ValueError(f"{where}: num_draft_tokens must be in [0, k_max={self.config.k_max}]")
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
            "cost_coefficients": self._model.coefficients(self._last_batch),
            "cost_timed": self._model.timed,
        }

    def summary(self) -> dict[str, Any]:
        """Totals since construction: steps, k histogram, acceptance ratio, tokens per step and second."""
        drafted, accepted, emitted, seconds = self._totals
        steps = max(self._steps, 1)
        return {
            "steps": self._steps,
            "mode": self.config.mode,
            "k_histogram": {k: n for k, n in enumerate(self._k_counts) if n},
            "mean_k": float(sum(k * n for k, n in enumerate(self._k_counts)) / steps),
            "acceptance_ratio": float(accepted / drafted) if drafted else float("nan"),
            "emitted_tokens": int(emitted),
            "tokens_per_step": float(emitted / steps),
            "tokens_per_second": float(emitted / seconds) if seconds else float("nan"),
            "explored_steps": self._num_explored,
            "skipped_timings": self._model.num_skipped,
            "config": asdict(self.config),
        }


__all__ = ["AdaptiveController", "ControllerConfig", "expected_tokens"]
