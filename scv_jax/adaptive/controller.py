"""Host-side speculation-length controller: picks k, the drafts per step, from measured acceptance and cost.

With conditional acceptance a_j (the chance draft j is accepted given drafts 1..j-1 were), a step with k
drafts emits on average E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j tokens per request and costs T(k, B)
seconds (``cost_model``: the measured time of each (B, k) shape, blended with a linear model for shapes
measured rarely or never). With ``per_request``, each request's acceptance is tracked as a scale of the
shared a_j, and E(k) is the mean over the requests of the coming step: when requests with very
different acceptance share a batch, the choice follows the batch that is actually running (e.g. it
drops k as soon as the repetitive requests finish). Modes:

* ``"goodput"`` (default): the k in the allowed set maximising the goodput E(k) / T(k, B) at the step's
  batch size B; or, for a batch that runs until its last request finishes (``next_k``'s
  ``remaining_tokens``, as ``SpeculativeDecoder.generate`` gives), the progress per second toward
  the end of the request that would finish last: 1 / T(k, B) over the expected steps until every
  request is done, each request needing r_b / E_b(k) steps give or take its own spread (speculation
  that helps the other requests finish early buys nothing while that one runs). k is decided every
  ``min_dwell_steps`` steps (at once when the batch changes: another size, or with ``per_request``
  requests that joined or left since the last decision making up a quarter of it, so at batch 64
  continuous batching's swaps of a request or two wait for the next decision; where half of it or
  more is new, again 2 steps later, on the new requests' first counts), switching only for
  a ``switch_margin`` gain; a decision that keeps k with a 5% lead over the runner-up doubles the
  steps to the next one, up to ``max_dwell_steps``, so a batch whose best k is clear pays for few
  decisions. A k never timed at a batch size is tried once there (its cost is otherwise only
  extrapolated, and a k predicted worse than it is would never be chosen); and with probability
  ``explore_prob`` a step tries the k that wins a draw of each k's predicted goodput with its
  uncertainty (Thompson sampling: shapes timed often are drawn tighter), so a k that may be best is
  measured again and one known to be worse rarely is.
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
Both are cheap enough for every step: ``update`` checks and keeps the counts and queues the step's
timing, and the estimates fold the kept steps in when a decision reads them (a few vectorised numpy
operations for all of them, no Python loop over requests; the cost table's code once for several
timings; ``benchmarks/bench_controller.py``). Per-request counts live in one store
indexed by request slot, so a batch that changes (continuous batching) costs its new requests' slots
and a fold step by step, not a fold at every change.
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import asdict, dataclass, replace
from statistics import NormalDist
from typing import Any, Literal

import numpy as np

from scv_jax.adaptive.cost_model import CostPrior, StepCostModel, StepCostTable
from scv_jax.arguments import require_int

Mode = Literal["goodput", "target", "fixed"]
_MAX_ACCEPTANCE = 0.999
# exploration draws each k's log goodput with variance _EXPLORE_VARIANCE / (1 + its step timings at the
# batch size) (Thompson sampling: a k is tried as often as it may be the best, less once well measured)
_EXPLORE_VARIANCE = 0.04
_KNOWN = 2.0               # expected accepted drafts of a request before its own scale speaks for it
_CHANGED_SHARE = 0.25      # requests joined or left since the last decision, over the batch: decided at once
_PAST_SCALES = 256         # the latest requests whose scales are the prior of a batch's unknown requests
_FIRST_REACHED = 12        # draft positions a request reaches in its first steps, which describe a new request
_AFTER_CHANGE = 2          # steps after a decision forced by a new batch to the next decision
_NEW_BATCH_SHARE = 0.5     # ... where requests joined or left since the last decision make up half the batch
_PROBE_FLOOR = 0.7         # a never-timed k is tried if its extrapolated objective is within 30% of the best
_PROBES = 2                # tries of a k never timed at a batch size (a try may go untimed: a compile)
_LEAD = 1.05               # a kept k leading the runner-up by this factor is decided again after twice the steps
_PACKED_RATE = 0.2         # weight of a step in its k's moving mean of packed target tokens per row


def _expected_max_normal(count: int) -> float:
    """The expected largest of ``count`` independent standard normals (Blom's approximation; 0 for one)."""
    return NormalDist().inv_cdf((count - 0.375) / (count + 0.25)) if count > 1 else 0.0


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
      min_dwell_steps: steps between decisions (k is held in between unless the batch changes: another
        size or, with ``per_request``, requests that joined or left since the last decision making up a
        quarter of it).
      max_dwell_steps: the most steps between decisions: each decision that keeps k with a 5% lead
        over the next best doubles the steps to the next one up to this; a switch, a new batch or a
        probe starts again from ``min_dwell_steps``. Steps are folded into the estimates at least
        this often.
      explore_prob: chance per step that "goodput" draws a k to try (the held one when it wins the draw).
      warmup_steps: steps before the first decision (alternating k_init and the smallest positive k).
      acceptance_decay: forgetting factor per step of the acceptance counts, in (0, 1] (while k = 0 is
        held the estimates drift back to the prior, so drafting is tried again in time).
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
    min_dwell_steps: int = 8
    max_dwell_steps: int = 32
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
        for name in ("k_min", "k_max", "min_dwell_steps", "max_dwell_steps", "warmup_steps"):
            require_int("ControllerConfig", name, getattr(self, name), minimum=0)
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
        for name in ("target_band", "switch_margin", "prior_strength"):
            if getattr(self, name) < 0:
                fail(name, ">= 0")
        if not isinstance(self.cost_prior, CostPrior):
            fail("cost_prior", "a CostPrior")
        require_int("ControllerConfig", "max_tracked_requests", self.max_tracked_requests, minimum=1)
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
        positive = [k for k in self._allowed_list if k > 0]
        self._num_positive = len(positive)
        # [2 * positive k, k_max]: for each positive allowed k, the sums over positions j <= k of reach_j,
        # then of (2j - 1) reach_j (``_finishing_rate``)
        positions = np.arange(1, cfg.k_max + 1)
        upto = (positions[None, :] <= np.array(positive)[:, None]).astype(np.float64)
        self._moment_sums = np.concatenate([upto, upto * (2.0 * positions - 1.0)])
        self._k_init = cfg.k_init if cfg.k_init is not None else self._allowed_list[-1]
        self._k_probe = positive[0] if positive else self._k_init
        self._success = [0.0] * cfg.k_max   # decayed accepted counts per draft position
        self._trials = [0.0] * cfg.k_max    # decayed counts of drafts reached per position
        self._acceptance: list[float] | None = None  # cache of ``acceptance()``
        self._model = StepCostModel(cfg.cost_prior, decay=cfg.cost_decay)
        self._table = StepCostTable(self._model, tuple(self._allowed_list),
                                    tuple(self._forwards(k) for k in self._allowed_list),
                                    draft_model=cfg.draft_model, decay=cfg.cost_decay)
        self._rng = random.Random(cfg.seed)
        # per request (slot = id % max_tracked_requests): its id; its decayed accepted drafts and their
        # expectation under the shared estimate; the same undecayed over its first steps, and the
        # draft positions it reached in them (its first steps: until that reaches ``_FIRST_REACHED``)
        self._request_owner = np.full(cfg.max_tracked_requests, -1, np.int64)
        self._request_counts = np.zeros((5, cfg.max_tracked_requests))
        # the request ids of the last update (the caller's object: the same object is the same batch),
        # and them as int64[B] with their slots; a request mixture's reach until the next fold
        self._ids: Any = None
        self._batch: tuple[np.ndarray, np.ndarray] = (np.zeros(0, np.int64), np.zeros(0, np.int64))
        self._reach_of: tuple[Any, list[float]] | None = None
        self._k = self._k_init  # the held choice; exploration and warm-up steps do not change it
        self._last_k = self._k_init
        self._last_explored = False
        self._last_batch = 1
        self._steps = 0
        self._since_decision = 0
        self._max_dwell = max(cfg.max_dwell_steps, cfg.min_dwell_steps, 1)   # also the most steps kept unfolded
        self._dwell = cfg.min_dwell_steps       # steps from the last decision to the next
        self._decided_for: tuple[int, Any] = (0, None)     # the batch size and request ids of the last decision
        self._compared: tuple[Any, int, float] = (None, 0, 0.0)   # _changed_share's last ids, decision, answer
        # per slot: the number of the last decision whose batch held the slot's request; that batch's size
        self._decided_in = np.zeros(cfg.max_tracked_requests, np.int64)
        self._decisions = self._decided_count = 0
        self._decision_objective: list[float] | None = None  # what the last "goodput" decision maximised
        self._probes: dict[tuple[int, int], int] = {}       # (batch size, column) -> tries while never timed
        # ((batch size, decisions) when last asked, the columns a probe may still try then)
        self._probe_candidates: tuple[tuple[int, int], list[int]] = ((0, -1), [])
        self._past: tuple[Any, np.ndarray] = (None, np.zeros(0))    # (for which ids, ``_past_scales``)
        self._accepted_per_step = 1.0                       # a request's accepted drafts per drafting step
        self._num_explored = 0
        self._k_counts = [0] * (cfg.k_max + 1)
        self._packed_means: dict[int, float] = {}   # step k -> moving mean of its target tokens per row - 1
        self._totals = [0.0, 0.0, 0.0, 0.0]  # drafted, accepted, emitted, timed seconds outside the cost table
        # int64[2, B] (drafts, accepted) of the steps not yet folded into the estimates (all with
        # per-request ids, then each one's (ids, slots) too, or all without), folded when an estimate is
        # read; the weight of each of n pending steps in the fold (decay ** age)
        self._pending: list[np.ndarray] = []
        self._pending_requests: list[tuple[np.ndarray, np.ndarray]] = []
        self._age_weights = [cfg.acceptance_decay ** np.arange(n - 1, -1, -1.0) for n in range(self._max_dwell + 1)]
        self._repeated_weights: dict[tuple[int, int], np.ndarray] = {}   # (steps, B) -> each entry's weight
        self._estimate()      # the prior's a_j (a fold needs the last estimate)

    # ----------------------------------------------------------------- estimates
    def _shared(self) -> list[float]:
        """The shared a_j as a list (see ``acceptance``), the pending steps folded in."""
        if self._pending:
            self._fold()
        return self._estimate()

    def _estimate(self) -> list[float]:
        """The shared a_j from the folded counts, as a list and an array (``_acceptance_array``), and
        their running sums from 0 (``_acceptance_sums``, float64[k_max + 1])."""
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
            both = np.array(out + sums)
            self._acceptance, self._acceptance_array, self._acceptance_sums = out, both[:len(out)], both[len(out):]
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
            self._table.flush()
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
        if self._pending:
            self._fold()
        if self.config.per_request and request_ids is not None:
            if self._reach_of is not None and self._reach_of[0] is request_ids:
                return self._reach_of[1]                # these requests', since the last fold
            ids = np.asarray(request_ids)
            if ids.size:
                reach = self._mixture(self._counts_of(ids))
                self._reach_of = (request_ids, reach)
                return reach
        reach, running = [], 1.0
        for a in self._shared():
            running *= a
            reach.append(running)
        return reach

    def _counts_of(self, ids: np.ndarray) -> np.ndarray:
        """float64[2, B] the (accepted, expected) counts of requests ``ids``, the pending steps folded in
        (0 for requests never seen, or whose slot a later id took)."""
        if self._pending:
            self._fold()
        if ids is self._ids:            # the last update's requests: they hold their slots
            return self._request_counts[:2, self._batch[1]]
        slots = self._slots(ids)
        return np.where(self._request_owner[slots] == ids, self._request_counts[:2, slots], 0.0)

    def _slots(self, request_ids: Any) -> np.ndarray:
        """int64[B] the store slots of requests ``request_ids`` (the last update's, if they are its ids
        object)."""
        if request_ids is self._ids:
            return self._batch[1]
        return np.asarray(request_ids) % self.config.max_tracked_requests

    def _claim(self, ids: np.ndarray) -> np.ndarray:
        """int64[B] the slots of requests ``ids``; a request new to its slot starts there from zero counts."""
        slots = self._slots(ids)
        fresh = self._request_owner[slots] != ids
        if fresh.any():
            taken = slots[fresh]
            self._request_owner[taken] = ids[fresh]
            self._request_counts[:, taken] = 0.0
        return slots

    def _past_scales(self, request_ids: Any) -> np.ndarray:
        """float64[n] sorted shrunk scales over their first steps (``_FIRST_REACHED``) of the
        ``_PAST_SCALES`` latest requests with some history, as of the first time a batch
        (``request_ids``, the caller's object) asks: what a new request looks like (acceptance often
        changes over a request's life, e.g. output that turns repetitive, so its latest scale is not)."""
        if self._past[0] is not request_ids:
            store = self._request_counts
            known = np.flatnonzero(store[3] >= _KNOWN)
            if known.size > _PAST_SCALES:
                known = known[np.argpartition(self._request_owner[known], -_PAST_SCALES)[-_PAST_SCALES:]]
            self._past = (request_ids, np.sort(self._shrunk_scales(store[2:4, known]))
                          if known.size else np.zeros(0))
        return self._past[1]

    def _scales(self, counts: np.ndarray) -> np.ndarray:
        """float64[B] each request's scale of the shared a_j, (accepted + s) / (expected + s) from its
        float64[2, B] counts, s = ``prior_strength``."""
        strength = self.config.prior_strength
        return (counts[0] + strength) / (counts[1] + strength)

    def _shrunk_scales(self, counts: np.ndarray) -> np.ndarray:
        """float64[B] ``_scales`` shrunk toward their mean by how much of their spread is noise
        (empirical Bayes; an estimate's variance ~ scale (1 + m) / (expected + s), its accepted drafts
        counted in runs of m per step on average, as for a geometric count): the least of a batch's
        scales is then a request truly poorer than the others, not the unluckiest."""
        strength = self.config.prior_strength
        scales = self._scales(counts)
        noise = scales * (1.0 + self._accepted_per_step) / (counts[1] + strength)
        mean = float(scales.sum()) / scales.shape[0]
        centered = scales - mean
        spread = max(float(centered @ centered - noise.sum()) / scales.shape[0], 0.0)   # noise removed
        centered *= spread / (spread + noise)
        centered += mean
        return centered

    def _request_reach(self, scales: np.ndarray) -> np.ndarray:
        """float64[k_max, B] P(draft j accepted), j = 1..k_max, of requests whose a_j are the shared ones
        times float64[B] ``scales`` (``_scales``). Positions on the leading axis, so the running
        product runs over contiguous rows."""
        reach = np.multiply.outer(self._shared_array(), scales)
        np.minimum(reach, _MAX_ACCEPTANCE, out=reach)
        return np.multiply.accumulate(reach, axis=0, out=reach)

    def _mixture(self, counts: np.ndarray) -> list[float]:
        """The mean over requests with float64[2, B] ``counts`` of their reach (``_request_reach``)."""
        inverse = 1.0 / counts.shape[1]
        return [r * inverse for r in self._request_reach(self._scales(counts)).sum(axis=1).tolist()]

    def _finishing_rate(self, request_ids: Any, remaining: np.ndarray) -> list[float]:
        """Per allowed k: 1 / the expected steps until every request has emitted its ``remaining``
        tokens. Request b needs about r_b / E_b(k) steps, give or take sqrt(r_b V_b(k) / E_b(k)^3)
        (V_b: the variance of its tokens per step); the batch finishes with the last of them, taken
        as max_b of mean + z_B std (z_B: the expected largest of B standard normals). Scales are
        shrunk by their noise (``_shrunk_scales``); requests with little history take evenly spaced
        quantiles of the latest requests' over their first steps (``_past_scales``: the request that
        finishes last is likely one of the poor ones)."""
        counts = self._counts_of(np.asarray(request_ids))
        scales = self._shrunk_scales(counts)
        unknown = np.flatnonzero(counts[1] < _KNOWN)
        past = self._past_scales(request_ids) if unknown.size else None
        if past is not None and past.size:
            last = past.shape[0] - 1     # np.quantile's linear rule on the sorted scales
            scales[unknown] = np.interp((np.arange(unknown.size) + 0.5) * (last / unknown.size),
                                        np.arange(last + 1), past)
        # accepted drafts L: E[L] = sum_j reach_j, E[L^2] = sum_j (2j - 1) reach_j (reaching j means
        # reaching every i < j), both for each positive allowed k in one product
        moments = self._moment_sums @ self._request_reach(scales)
        accepted, squares = moments[:self._num_positive], moments[self._num_positive:]
        remaining = np.maximum(remaining, 1.0)
        squares -= accepted * accepted                                    # the variance of L
        accepted += 1.0                                                   # E_b(k)
        per_step = remaining / accepted                                   # steps to finish, on average
        np.maximum(squares, 0.0, out=squares)
        spread = np.sqrt(squares * per_step / (accepted * accepted))      # their standard deviation
        steps = (per_step + _expected_max_normal(remaining.shape[0]) * spread).max(axis=1).tolist()
        return [1.0 / float(remaining.max())] * (len(self._allowed_list) - len(steps)) + [1.0 / n for n in steps]

    def _shared_array(self) -> np.ndarray:
        self._shared()
        return self._acceptance_array

    def predicted_goodput(self, batch_size: int, request_ids: Any = None) -> np.ndarray:
        """float64[len(allowed)] expected emitted tokens per second for each allowed k at batch B."""
        emitted = np.cumsum([1.0] + self._reach(request_ids))[self._allowed]
        return batch_size * emitted / self.predicted_step_cost(batch_size)

    # ----------------------------------------------------------------- decisions
    def next_k(self, batch_size: int, request_ids: Any = None, remaining_tokens: Any = None) -> int:
        """The number of drafts for the coming step of ``batch_size`` requests (the batch the step
        computes, padding included: the cost model's batch size; the choice does not depend on how
        many of them are real). ``request_ids``: the step's requests (with ``per_request``, the
        expected tokens are theirs). ``remaining_tokens``: int[B] tokens each of them has yet to emit,
        for a batch that runs until its last request finishes (no request joins it): k then
        maximises the progress of the request that would finish last (see ``_choose_goodput``);
        None: the batch's tokens per second (a server that refills finished slots)."""
        require_int("AdaptiveController.next_k", "batch_size", batch_size, minimum=1)
        if remaining_tokens is not None:
            remaining_tokens = np.asarray(remaining_tokens)
            requests = None if request_ids is None else np.shape(request_ids)
            if remaining_tokens.ndim != 1 or remaining_tokens.dtype.kind not in "iu" or \
                    (requests is not None and requests != remaining_tokens.shape):
                raise ValueError(f"AdaptiveController.next_k: remaining_tokens must be an int[B] vector, one per "
                                 f"request id, got shape {remaining_tokens.shape} dtype {remaining_tokens.dtype}"
                                 + ("" if requests is None else f" for request_ids of shape {requests}"))
        cfg = self.config
        self._last_explored = False
        if cfg.mode == "fixed":
            k = self._k_init
        elif self._steps < cfg.warmup_steps:
            k = self._k_init if self._steps % 2 == 0 else self._k_probe
        else:
            share = self._changed_share(int(batch_size), request_ids)
            changed = share >= _CHANGED_SHARE
            if self._since_decision >= self._dwell or changed:
                choice = (self._choose_goodput(int(batch_size), request_ids, remaining_tokens)
                          if cfg.mode == "goodput" else self._choose_target())
                # a kept k is decided again after twice the steps (up to max_dwell_steps); a switch or a
                # new batch (also one whose decision was due anyway) starts again from min_dwell_steps
                kept = not changed and choice == self._k and self._lead() >= _LEAD
                self._dwell = min(2 * self._dwell, self._max_dwell) if kept else cfg.min_dwell_steps
                # a new batch's first choice rests on little of its own history: decide again soon (not
                # where most of the batch was there before: continuous batching's swaps at batch 64)
                renewed = share >= _NEW_BATCH_SHARE
                self._k, self._since_decision = choice, max(self._dwell - _AFTER_CHANGE, 0) if renewed else 0
                self._decided_for = (int(batch_size), request_ids)
                self._decisions += 1
                if cfg.per_request and request_ids is not None:
                    slots = self._slots(request_ids)
                    self._decided_in[slots], self._decided_count = self._decisions, slots.size
            k = self._k
            probe = self._probe(int(batch_size)) if cfg.mode == "goodput" else None
            if probe is not None:              # a k never timed at this batch size: time it once
                self._dwell = cfg.min_dwell_steps
                k, self._last_explored, self._since_decision = probe, True, self._dwell
                self._num_explored += 1
            elif cfg.mode == "goodput" and self._rng.random() < cfg.explore_prob:
                tried = self._explored(int(batch_size), request_ids)
                if tried != k:
                    k, self._last_explored = tried, True
                    self._num_explored += 1
        self._last_k = int(k)
        return self._last_k

    def _lead(self) -> float:
        """The last decision's best objective over the runner-up's (1 without a runner-up or objective)."""
        rates = self._decision_objective
        if len(rates or ()) < 2:
            return 1.0
        first, second = sorted(rates)[-1:-3:-1]
        return first / second

    def _probe(self, batch_size: int) -> int | None:
        """An allowed k whose step was never timed at this batch size (its cost there is only
        extrapolated, and a k predicted worse than it is would never be tried) and whose objective is
        within ``_PROBE_FLOOR`` of the best, tried at most ``_PROBES`` times: the first of them in the
        order of the last decision's objective. Once none is left, asked again only after the next
        decision (timings only remove candidates, but for a rare reset of the cost model)."""
        key = (batch_size, self._decisions)
        if self._probe_candidates[0] == key and not self._probe_candidates[1]:
            return None
        counts = self._table.counts(batch_size)
        objective = self._decision_objective or [1.0] * len(counts)
        floor = _PROBE_FLOOR * max(objective)
        candidates = [i for i in sorted(range(len(counts)), key=lambda i: -objective[i])
                      if counts[i] < 1.0 and objective[i] >= floor and self._probes.get((batch_size, i), 0) < _PROBES]
        self._probe_candidates = (key, candidates)
        if not candidates:
            return None
        i = candidates[0]
        self._probes[batch_size, i] = self._probes.get((batch_size, i), 0) + 1
        return self._allowed_list[i]

    def _changed_share(self, batch_size: int, request_ids: Any) -> float:
        """How much of the coming step's batch changed since the last decision: 1 for another size (or
        ids where the last decision had none, or none where it had ids), else with ``per_request``
        the requests that joined or left, over the larger batch. From ``_CHANGED_SHARE`` k is decided
        again at once, as for a new batch: at batch 8 when a request takes a finished one's place (a
        request moves the batch's expectation by an eighth), at batch 64 once 16 requests came or
        went (continuous batching swaps a few a step, each moving it by 1/64)."""
        size, ids = self._decided_for
        if batch_size != size:
            return 1.0
        if not self.config.per_request or request_ids is ids:
            return 0.0
        if ids is None or request_ids is None:
            return 1.0
        if request_ids is self._compared[0] and self._compared[1] == self._decisions:    # asked before
            return self._compared[2]
        slots = self._slots(request_ids)
        joined = np.count_nonzero(self._decided_in[slots] != self._decisions)   # not in the decided batch
        before = self._decided_count
        share = (joined + before - (slots.size - joined)) / max(slots.size, before, 1)
        self._compared = (request_ids, self._decisions, share)
        return share

    def _rates(self, batch_size: int, request_ids: Any) -> list[float]:
        """Expected emitted tokens per unit of cost (the load cancels) of each allowed k."""
        emitted, total = [1.0], 1.0
        for r in self._reach(request_ids):
            total += r
            emitted.append(total)
        return [emitted[k] / cost for k, cost in zip(self._allowed_list, self._choice_costs(batch_size))]

    def _choice_costs(self, batch_size: int) -> list[float]:
        """The relative cost of choosing each allowed k at ``batch_size``: its step's (the table's), or
        after packed steps (``update(target_tokens=...)``) the packed step that k leads to, whose
        target scores ``m + 1`` tokens per row (m: the mean over k's recent steps, or for a k not run
        since, k times the share m / k of the nearest k that was): the table interpolated at m, plus
        the draft model's work for k rather than m."""
        costs = self._table.relative(batch_size)
        if not self._packed_means:
            return costs
        out = list(costs)
        allowed = self._allowed_list
        theta = self._model.coefficients(batch_size) if self.config.draft_model else None
        for i, k in enumerate(allowed):
            m = self._packed_means.get(k)
            if m is None and k:
                nearest = min(self._packed_means, key=lambda seen: abs(seen - k))
                m = k * self._packed_means[nearest] / nearest
            if m is None or m >= k:
                continue
            j = max(bisect.bisect_right(allowed, m) - 1, 0)     # allowed[j] <= m < allowed[j + 1] (<= k)
            share = min(max((m - allowed[j]) / (allowed[j + 1] - allowed[j]), 0.0), 1.0)  # m below the least k
            out[i] = costs[j] + share * (costs[j + 1] - costs[j])
            if theta is not None:      # the interpolation has the draft work of about m drafts
                forwards = self._forwards(allowed[j]) + share * (self._forwards(allowed[j + 1])
                                                                 - self._forwards(allowed[j]))
                out[i] += (max(theta[2], 0.0) * (self._forwards(k) - forwards)
                           + max(theta[3], 0.0) * batch_size * (k - m))      # the table's units
            out[i] = min(out[i], costs[i])
        return out

    def _choose_goodput(self, batch_size: int, request_ids: Any, remaining: Any) -> int:
        """The k maximising the goodput; with per-request estimates and ``remaining`` tokens of several
        requests, the batch's progress per second toward its last request's end: ``_finishing_rate`` /
        T(k) (for one request the two are the same)."""
        if remaining is not None and self.config.per_request and request_ids is not None and len(remaining) > 1:
            costs = self._choice_costs(batch_size)
            rates = [rate / cost for rate, cost in zip(self._finishing_rate(request_ids, remaining), costs)]
        else:
            rates = self._rates(batch_size, request_ids)
        self._decision_objective = rates
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

    def _explored(self, batch_size: int, request_ids: Any) -> int:
        """The k to try this step: each k's log objective (the last decision's, made for this batch: a
        new one decides at once) drawn with its uncertainty, the best draw (often the held k: then
        nothing is explored). A k timed often, or predicted far below the best, is rarely tried."""
        rates = self._decision_objective or self._rates(batch_size, request_ids)
        draws = [math.log(rate) + self._rng.gauss(0.0, math.sqrt(_EXPLORE_VARIANCE / (1.0 + timed)))
                 for rate, timed in zip(rates, self._table.counts(batch_size))]
        return self._allowed_list[max(range(len(draws)), key=draws.__getitem__)]

    def request_k(self, request_ids: Any) -> np.ndarray:
        """int32[B] drafts per request within the last ``next_k``; needs ``per_request=True``.

        For engines whose step cost grows with each request's own drafts (a packed verify forward):
        a request drafts position i only while its chance of reaching and accepting it exceeds the
        step's tokens-per-second times the marginal cost of one more draft token (target + draft
        per-token cost). Requests without history use the shared estimate. (``SpeculativeDecoder``
        does not trim: in a dense [B, k + 1] step a trimmed draft saves nothing; a packed step
        (``DecoderConfig.packed_verify``) of a batch that runs until its last request ends would slow
        the requests the batch waits for, and on the demo stream (continuous batching, n-gram drafts)
        trimming at k = 4 cost both steps and target tokens: README, "End-to-end benchmark".)
        """
        if not self.config.per_request:
            raise ValueError("AdaptiveController.request_k needs ControllerConfig(per_request=True)")
        ids = np.asarray(list(request_ids) if not isinstance(request_ids, np.ndarray) else request_ids,
                         np.int64).reshape(-1)
        k = self._last_k
        if k == 0 or not ids.size:
            return np.full(ids.size, k, np.int32)
        a = np.array(self._shared()[:k])
        counts = self._counts_of(ids)
        reach = np.cumprod(np.clip(self._scales(counts)[:, None] * a, 0.0, _MAX_ACCEPTANCE), axis=1)
        batch = ids.size
        rate = batch * expected_tokens(a)[k] / self._step_seconds(batch, k)
        theta = self._model.coefficients(batch)
        threshold = rate * max(theta[1] + theta[3], 0.0)
        return np.sum(reach >= threshold, axis=1).astype(np.int32)

    # ----------------------------------------------------------------- observations
    def update(self, num_draft_tokens: Any, num_accepted: Any, step_seconds: float | None = None,
               batch_size: int | None = None, request_ids: Any = None, *, step_k: int | None = None,
               target_tokens: int | None = None) -> None:
        """Records one step.

        Args:
          num_draft_tokens: int[B] drafts each request verified this step (<= k_max).
          num_accepted: int[B] drafts accepted per request (<= num_draft_tokens).
          step_seconds: measured wall time of the step (draft + verify), or None if not timed.
          batch_size: requests the step computed, for the cost model (B plus padding rows); default B.
          request_ids: int[B] non-negative request ids, for ``per_request`` estimates.
          step_k: the drafts per request the step computed, for a dense [batch_size, k + 1] step (the
            cost model is charged ``batch_size * step_k`` draft tokens). None: each request computed
            its own drafts and padding rows ``max(num_draft_tokens)`` (a packed step). With ``step_k``
            0 (nothing verified) the counts may be counterfactual: drafts proposed but not verified and
            how many of them the tokens emitted next matched (a point-mass drafter's, e.g. n-gram: the
            chance rejection sampling accepts them); they inform the acceptance estimates only.
          target_tokens: with ``step_k``, the tokens the target scored when fewer than
            ``batch_size * (step_k + 1)`` (a packed verify; the draft model still ran ``step_k``
            drafts per request).
        """
        drafts, accepted = self._checked_counts(num_draft_tokens, num_accepted)
        cfg = self.config
        batch = drafts.shape[0] if batch_size is None else max(int(batch_size), drafts.shape[0])
        self._last_batch = max(batch, 1)
        with_ids = cfg.per_request and request_ids is not None
        if with_ids and request_ids is not self._ids:     # another batch (another ids object)
            ids = np.asarray(request_ids)
            if ids.shape != drafts.shape or ids.dtype.kind not in "iu" or (ids.size and ids.min() < 0):
                raise ValueError(f"AdaptiveController.update: request_ids must be {drafts.shape[0]} non-negative "
                                 f"ints (one per request), got {ids.shape} of dtype {ids.dtype}")
            ids = ids.astype(np.int64)
            if not np.array_equal(ids, self._batch[0]):     # (the same requests in a new object: the same batch)
                self._batch = (ids, self._claim(ids))
            self._ids = request_ids
        if self._pending and with_ids != bool(self._pending_requests):     # ids in all pending steps or none
            self._fold()
        if step_seconds is not None:
            self._observe_cost(batch, drafts, step_k, float(step_seconds), target_tokens)
        if step_k == 0 and drafts.any():          # counterfactual counts: no drafted or emitted tokens
            unverified = drafts.sum(), accepted.sum()
            self._totals[0] -= unverified[0]
            self._totals[1] -= unverified[1]
            self._totals[2] -= unverified[1]
        self._pending.append(np.array((drafts, accepted), np.int64))      # a copy: kept until folded
        if with_ids:
            self._pending_requests.append(self._batch)
        if len(self._pending) >= self._max_dwell:
            self._fold()
        self._k_counts[self._last_k if step_k is None else step_k] += 1
        if target_tokens is not None and step_k:      # the packed share of the steps of this k
            mean = target_tokens / batch - 1.0
            known = self._packed_means.get(step_k, float(step_k))
            self._packed_means[step_k] = known + _PACKED_RATE * (mean - known)
        elif step_k in self._packed_means:
            self._packed_means[step_k] += _PACKED_RATE * (step_k - self._packed_means[step_k])
        self._steps += 1
        self._since_decision += 1

    def _fold(self) -> None:
        """Folds the pending steps into the estimates, as if each had been folded when it happened
        (decay ** age weights), except that a request's expected count uses the shared estimate as of
        the fold: every position's decayed reached and accepted counts, each request's accepted and
        expected drafts (with per-request ids), and the totals."""
        steps, self._pending = self._pending, []
        requests, self._pending_requests = self._pending_requests, []
        cfg = self.config
        both = np.concatenate(steps, axis=1) if len(steps) > 1 else steps[0]
        drafts, accepted = both
        age_weights = self._age_weights[len(steps)]
        same = bool(requests) and all(r is requests[0] for r in requests)    # one batch throughout
        if same:
            weights = self._repeated_weights.get((len(steps), steps[0].shape[1]))
            if weights is None:
                weights = self._repeated_weights[len(steps), steps[0].shape[1]] = np.repeat(age_weights,
                                                                                           steps[0].shape[1])
        else:
            weights = np.repeat(age_weights, [step.shape[1] for step in steps])
        # Request b reached positions 1..min(d_b, n_b + 1) and accepted 1..n_b.
        reached = np.minimum(drafts, accepted + 1)
        forget = age_weights[0] * cfg.acceptance_decay
        if requests:
            # each request's accepted drafts, the sum of a_j over the positions it reached (a_j as last
            # estimated: the expectation before these steps were seen) and those positions, per step
            per_step = np.empty((3, both.shape[1]))
            per_step[0] = accepted
            np.take(self._acceptance_sums, reached, out=per_step[1])
            per_step[2] = reached
            self._fold_requests(requests, per_step, forget, age_weights, same)
        reached_at = np.bincount(reached, weights, minlength=cfg.k_max + 1).tolist()
        accepted_at = np.bincount(accepted, weights, minlength=cfg.k_max + 1).tolist()
        trials, success = self._trials, self._success
        reached_total = accepted_total = 0.0
        for j in range(cfg.k_max, 0, -1):     # every position forgets: unreached ones drift to the one before
            reached_total += reached_at[j]
            accepted_total += accepted_at[j]
            trials[j - 1] = forget * trials[j - 1] + reached_total
            success[j - 1] = forget * success[j - 1] + accepted_total
        self._acceptance = self._reach_of = None
        drafted, accepted_sum = both.sum(axis=1).tolist()
        decay = cfg.acceptance_decay ** len(steps)
        if both.shape[1]:      # (steps without requests move nothing)
            self._accepted_per_step = decay * self._accepted_per_step + (1.0 - decay) * accepted_sum / both.shape[1]
        totals = self._totals
        totals[0] += drafted
        totals[1] += accepted_sum
        totals[2] += accepted_sum + both.shape[1]

    def _fold_requests(self, requests: list[tuple[np.ndarray, np.ndarray]], per_step: np.ndarray, forget: float,
                       age_weights: np.ndarray, same: bool) -> None:
        """Folds float64[3, N] (accepted, expected, reached) counts of the pending steps' requests
        (``requests``: each step's (ids, slots); N: their total) into the per-request counts: a
        request's (accepted, expected) decay at each step it takes part in, and those of its first
        steps (``_FIRST_REACHED``) also add up undecayed, with the positions reached. One
        batch throughout (``same``): one gather and scatter; else step by step, skipping requests whose
        slot a later id took."""
        owner, store = self._request_owner, self._request_counts
        if same:
            slots, steps = requests[0][1], len(requests)
            counts = store[:, slots]
            counts[:2] *= forget
            per_request = per_step.reshape(3, steps, -1)
            counts[:2] += np.matmul(age_weights, per_request[:2])
            if counts[4].min(initial=_FIRST_REACHED) < _FIRST_REACHED:
                # [steps, B] whether each step is one of a request's first: the positions reached before it
                first = np.cumsum(per_request[2], axis=0) - per_request[2] + counts[4] < _FIRST_REACHED
                counts[2:] += (per_request * first).sum(axis=1)
            store[:, slots] = counts
        else:
            decay, start = self.config.acceptance_decay, 0
            for ids, slots in requests:
                end = start + slots.shape[0]
                step = per_step[:, start:end]
                current = owner[slots] == ids
                if not current.all():
                    slots, step = slots[current], step[:, current]
                counts = store[:, slots]
                counts[:2] *= decay
                counts[:2] += step[:2]
                np.add(counts[2:], step, out=counts[2:], where=counts[4] < _FIRST_REACHED)
                store[:, slots] = counts
                start = end

    def _observe_cost(self, batch: int, drafts: np.ndarray, step_k: int | None, seconds: float,
                      target_tokens: int | None) -> None:
        """Feeds a timed step to the cost table (queued there; it skips outliers); a packed step the
        table has no shape for counts its seconds in ``_totals``."""
        if step_k is None:
            k = int(drafts.max(initial=0))
            draft_tokens = int(drafts.sum()) + (batch - drafts.shape[0]) * k
        else:
            k, draft_tokens = int(step_k), batch * int(step_k)
        scored = batch + draft_tokens if target_tokens is None else int(target_tokens)
        if scored != batch + draft_tokens:
            if self.config.draft_model:    # a packed step with a draft model: no shape of the cost model's
                self._totals[3] += seconds
                return
            # without a draft model, a packed step of m + 1 target tokens per row is a dense step of k = m
            k = scored // batch - 1
            draft_tokens = batch * k
        features = (1.0, float(scored), float(self._forwards(k)), float(draft_tokens * self.config.draft_model))
        shape = k if draft_tokens == batch * k else None       # a dense step of one of the table's shapes
        self._table.observe(batch, shape, features, seconds)     # queued: applied at the next read

    def _checked_counts(self, num_draft_tokens: Any, num_accepted: Any) -> tuple[np.ndarray, np.ndarray]:
        where = "AdaptiveController.update"
        drafts, accepted = np.asarray(num_draft_tokens), np.asarray(num_accepted)
        for name, x in (("num_draft_tokens", drafts), ("num_accepted", accepted)):
            if x.ndim != 1 or x.dtype.kind not in "iu":
                raise ValueError(f"{where}: {name} must be an int[B] vector, got shape {x.shape} dtype {x.dtype}")
        if drafts.shape != accepted.shape:
            raise ValueError(f"{where}: num_draft_tokens {drafts.shape} and num_accepted {accepted.shape} "
                             "must have the same shape [B]")
        if drafts.size and (np.bitwise_or(drafts - accepted, accepted).min() < 0 or drafts.max() > self.config.k_max):
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
        self._table.flush()
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
        if self._pending:
            self._fold()
        self._table.flush()
        drafted, accepted, emitted, untabled_seconds = self._totals
        seconds = untabled_seconds + self._table.timed_seconds
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
