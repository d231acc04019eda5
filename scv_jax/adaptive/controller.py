"""Host-side speculation-length controller: the k (drafts per request per step) of most tokens per second.

A step with k drafts emits E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j tokens per request (a_j: the chance
draft j is accepted given drafts 1..j-1 were). The controller estimates a_j per draft position and the
seconds T(k) of a step of each allowed k per batch bucket (``cost_model.StepCostTable``) and holds the k
of the most E(k) / T(k); docs/adaptive.md describes the estimates, the decisions and the probes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np

from scv_jax.adaptive.cost_model import StepCostTable, batch_bucket
from scv_jax.arguments import require_int

_MAX_ACCEPTANCE = 0.999
_TRIES = 3          # steps a never-timed k is run in a bucket before it is left out of the choice


def expected_tokens(conditional_acceptance: np.ndarray) -> np.ndarray:
    """E(k) for k = 0..K: float64[..., K + 1] expected emitted tokens per request from float[..., K] a_j."""
    a = np.asarray(conditional_acceptance, np.float64)
    reach = np.cumprod(a, axis=-1)
    return np.concatenate([np.ones(a.shape[:-1] + (1,)), 1.0 + np.cumsum(reach, axis=-1)], axis=-1)


@dataclass(frozen=True)
class ControllerConfig:
    """Settings of ``AdaptiveController``; all checked on construction.

    Attributes:
      mode: "goodput" (choose k) or "fixed" (always ``k_init``).
      k_min, k_max: bounds of k (0 <= k_min <= k_max).
      allowed_k: the k values that may be chosen (within [k_min, k_max]); None: all of them.
      k_init: the k before any decision and of "fixed" mode; None: the largest allowed k.
      decide_every: steps between decisions while the batch stays the same.
      switch_margin: a decision switches k only for a relative gain in E(k) / T(k) above this.
      probe_every: steps between one-step runs of the runner-up k (0: never).
      acceptance_decay: forgetting factor per step of the acceptance counts, in (0, 1].
      prior_acceptance, prior_strength: prior of a_1 (later positions: the estimate of the one before)
        and how many drafts it is worth.
      cost_rate: weight of a new step time in its shape's moving mean, in (0, 1].
    """

    mode: Literal["goodput", "fixed"] = "goodput"
    k_min: int = 0
    k_max: int = 8
    allowed_k: tuple[int, ...] | None = None
    k_init: int | None = None
    decide_every: int = 4
    switch_margin: float = 0.03
    probe_every: int = 16
    acceptance_decay: float = 0.97
    prior_acceptance: float = 0.7
    prior_strength: float = 2.0
    cost_rate: float = 0.2

    def __post_init__(self) -> None:
        def fail(name: str, expected: str) -> None:
            raise ValueError(f"ControllerConfig: {name} must be {expected}, got {getattr(self, name)!r}")

        if self.mode not in ("goodput", "fixed"):
            fail("mode", 'one of "goodput", "fixed"')
        for name, minimum in (("k_min", 0), ("k_max", 0), ("probe_every", 0), ("decide_every", 1)):
            require_int("ControllerConfig", name, getattr(self, name), minimum=minimum)
        if self.k_min > self.k_max:
            raise ValueError(f"ControllerConfig: k_min ({self.k_min}) must be <= k_max ({self.k_max})")
        if self.allowed_k is not None:
            object.__setattr__(self, "allowed_k", tuple(sorted({int(k) for k in self.allowed_k})))
        if not self.allowed:
            fail("allowed_k", f"a non-empty set with values in [k_min, k_max] = [{self.k_min}, {self.k_max}]")
        if self.k_init is not None and self.k_init not in self.allowed:
            fail("k_init", f"one of the allowed k {self.allowed}")
        if not 0.0 < self.prior_acceptance < 1.0:
            fail("prior_acceptance", "in (0, 1)")
        for name in ("acceptance_decay", "cost_rate"):
            if not 0.0 < getattr(self, name) <= 1.0:
                fail(name, "in (0, 1]")
        for name in ("switch_margin", "prior_strength"):
            if not getattr(self, name) >= 0:
                fail(name, ">= 0")

    @property
    def allowed(self) -> tuple[int, ...]:
        """The choosable k values, ascending."""
        candidates = range(self.k_min, self.k_max + 1) if self.allowed_k is None else self.allowed_k
        return tuple(k for k in candidates if self.k_min <= k <= self.k_max)


_ANY_LENGTH = np.iinfo(np.int64).max


def _int_vector(where: str, name: str, value: Any, longest: int) -> np.ndarray:
    """``value`` as int64[n] with 0 <= entries and n <= ``longest``, else a ValueError naming it. An int64
    array comes back as it is (not copied: copy it to keep it)."""
    array = value if isinstance(value, np.ndarray) else np.asarray(value)
    if (array.ndim != 1 or array.dtype.kind not in "iu" or array.size > longest
            or (array.size and np.minimum.reduce(array) < 0)):
        raise ValueError(f"{where}: {name} must be a vector of at most {longest} non-negative ints, got shape "
                         f"{array.shape} dtype {array.dtype}" + (f" min {array.min()}" if array.size else ""))
    return array.astype(np.int64, copy=False)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether vectors ``a`` and ``b`` of one dtype hold the same values in the same order."""
    return a.shape == b.shape and a.tobytes() == b.tobytes()


class _Requests:
    """The last update's requests: their ids (row order, as given) and float64[2, n] decayed accepted
    drafts and their expectation under the shared a_j; with the ids' argsort, found once when needed."""

    def __init__(self, ids: np.ndarray, counts: np.ndarray):
        self.ids, self.counts = ids, counts
        self._order: np.ndarray | None = None
        self._ascending = self.ids
        self._distinct = False

    def order(self) -> np.ndarray:
        """int64[n] ``np.argsort(ids)`` (the ids ascending)."""
        if self._order is None:
            self._order = np.argsort(self.ids)
            self._ascending = self.ids[self._order]
            self._distinct = not (self._ascending[1:] == self._ascending[:-1]).any()
        return self._order

    def are(self, ids: np.ndarray) -> bool:
        """Whether ``ids`` are these requests' ids, distinct and in the same order (row b's counts are
        then column b's)."""
        if not (ids.size and _same(ids, self.ids)):
            return False
        self.order()
        return self._distinct

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """float64[2, n] the counts of requests ``ids`` (0 for ids not among these; for an id held twice,
        the first of its columns in ``order``)."""
        if self.are(ids):
            return self.counts
        if not (self.ids.size and ids.size):
            return np.zeros((2, ids.size))
        order = self.order()
        if self._distinct and _same(ids, self._ascending):    # the same requests, ids ascending
            return self.counts[:, order]
        at = order[np.minimum(np.searchsorted(self.ids, ids, sorter=order), self.ids.size - 1)]
        found = self.ids[at] == ids
        out = np.zeros((2, ids.size))
        out[:, found] = self.counts[:, at[found]]
        return out


class AdaptiveController:
    """Chooses the drafts per request of each step (see the module doc; its host cost: docs/adaptive.md).

    Build with a ``ControllerConfig`` and/or its fields as keywords: ``AdaptiveController(k_max=6)``.
    Call ``next_k(batch_size)`` before each step and ``update(...)`` with the step's counts after.
    """

    def __init__(self, config: ControllerConfig | None = None, **overrides: Any):
        config = config or ControllerConfig()
        self.config = cfg = replace(config, **overrides) if overrides else config
        self._allowed_k = cfg.allowed
        self._allowed = np.array(self._allowed_k)
        self._column = {k: i for i, k in enumerate(self._allowed_k)}
        self._k = cfg.k_init if cfg.k_init is not None else self._allowed_k[-1]   # the held k
        self._last_k = self._k
        self._table = StepCostTable(self._allowed_k, cfg.cost_rate)
        self._counts = np.zeros((2, cfg.k_max))   # decayed drafts accepted at / reaching each position
        # int64[k_max + 1, k_max]: requests that stopped at position i count at positions j + 1 <= i
        self._tails = np.tri(cfg.k_max + 1, cfg.k_max, -1, np.int64)
        self._estimated: tuple[np.ndarray, np.ndarray] | None = None   # ``_estimates()`` of ``_counts``
        self._requests = _Requests(np.zeros(0, np.int64), np.zeros((2, 0)))
        self._decided_for: tuple[int, np.ndarray | None] = (0, None)   # (bucket, sorted ids) of the last decision
        # next_k's last request ids, sorted, and the order that sorts them
        self._last_ids = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
        self._since_decision = self._since_probe = 0
        self._probing = False    # the last k was a never-timed one's: look for the next at once

    def _estimates(self) -> tuple[np.ndarray, np.ndarray]:
        """(float64[k_max] a_j, float64[k_max + 1] their cumulative sums from 0): kept until the next update."""
        if self._estimated is None:
            cfg = self.config
            strength, prior, acceptance = cfg.prior_strength, cfg.prior_acceptance, []
            for success, trials in zip(*self._counts.tolist()):
                prior = (success + strength * prior) / (trials + strength)
                prior = _MAX_ACCEPTANCE if _MAX_ACCEPTANCE < prior else prior     # min(prior, _MAX_ACCEPTANCE)
                acceptance.append(prior)
            cumulative = [0.0, *itertools.accumulate(acceptance)]
            self._estimated = (np.array(acceptance, np.float64), np.array(cumulative, np.float64))
        return self._estimated

    def acceptance(self) -> np.ndarray:
        """float64[k_max] estimated a_j for positions j = 1..k_max."""
        return self._estimates()[0].copy()

    def step_seconds(self, batch_size: int) -> np.ndarray:
        """float64[len(allowed)] measured seconds of a step of each allowed k at ``batch_size`` (nan: never)."""
        return self._table.seconds(batch_size)

    def rates(self, batch_size: int, request_ids: np.ndarray | None = None,
              remaining_tokens: np.ndarray | None = None) -> np.ndarray:
        """float64[len(allowed)] expected tokens per request per second of each allowed k (nan: never timed).
        With int[n] ``request_ids`` each request's a_j are the shared ones times its own scale (its accepted
        over its expected drafts, shrunk by ``prior_strength``); with int[n] ``remaining_tokens`` too, each
        request's tokens are capped at those it has left (a step's drafts never pass a request's budget)."""
        a = self._estimates()[0][None, :]
        if request_ids is not None and request_ids.size:
            counts = self._requests.lookup(request_ids) + self.config.prior_strength
            a = np.minimum((counts[0] / counts[1])[:, None] * a, _MAX_ACCEPTANCE)
        elif remaining_tokens is not None and remaining_tokens.size:
            a = np.broadcast_to(a, (remaining_tokens.size, a.shape[1]))
        # accepted drafts of a request with k drafts: sum_{j<=k} reach_j, capped at the tokens it has left
        rows, width = a.shape[0], a.shape[1] + 1
        mean = np.zeros((rows, width))
        np.multiply.accumulate(a, axis=1, out=mean[:, 1:])     # reach_j = a_1 ... a_j
        np.add.accumulate(mean, axis=1, out=mean)
        if remaining_tokens is None or not remaining_tokens.size or rows != remaining_tokens.size:
            chosen = mean[:, self._allowed]
        else:
            caps = np.minimum(self._allowed[None, :], np.maximum(remaining_tokens[:, None] - 1, 0))
            caps += np.arange(0, rows * width, width)[:, None]      # flat indices into ``mean``
            chosen = mean.ravel()[caps]
        per_request = 1.0 + np.add.reduce(chosen, axis=0) / rows    # the mean over the requests
        return per_request / self._table.predicted(batch_size)

    def next_k(self, batch_size: int, request_ids: Any = None, remaining_tokens: Any = None) -> int:
        """The drafts per request of the coming step of ``batch_size`` rows (padding rows included: the step's
        cost). ``request_ids``: the step's requests (int[n], n <= batch_size; other requests than at the
        last decision decide at once). ``remaining_tokens``: int[n] tokens each has yet to emit (its
        tokens per step are capped there); None: no cap."""
        where = "AdaptiveController.next_k"
        require_int(where, "batch_size", batch_size, minimum=1)
        ids, order = (None, None) if request_ids is None else self._sorted_ids(request_ids, batch_size)
        remaining = None if remaining_tokens is None else _int_vector(where, "remaining_tokens", remaining_tokens,
                                                                      batch_size)
        if ids is not None and remaining is not None:
            if ids.shape != remaining.shape:
                raise ValueError(f"{where}: remaining_tokens {remaining.shape} must have one entry per request id "
                                 f"{ids.shape}")
            remaining = remaining[order]          # paired with the sorted ids
        cfg = self.config
        if cfg.mode == "fixed":
            return self._k
        bucket = batch_bucket(batch_size)
        decided_bucket, decided_ids = self._decided_for
        new_batch = bucket != decided_bucket or (ids is not None and (decided_ids is None
                                                                     or not _same(ids, decided_ids)))
        rates, k = None, self._k
        if new_batch or self._probing or self._since_decision >= cfg.decide_every:
            untimed = [never and allowed != self._last_k   # the last step's time is still to come
                       for never, allowed in zip(self._table.untimed(batch_size, _TRIES), self._allowed_k)]
            self._probing = any(untimed)
            if self._probing:                                 # a k never timed here: time it
                k = self._allowed_k[len(untimed) - 1 - untimed[::-1].index(True)]
            else:
                rates = self.rates(batch_size, ids, remaining)
                self._decide(rates)
                self._decided_for, self._since_decision, k = (bucket, ids), 0, self._k
        if not self._probing:
            if cfg.probe_every and self._since_probe >= cfg.probe_every:   # the runner-up, for one step
                rates = self.rates(batch_size, ids, remaining) if rates is None else rates
                order = np.argsort(-np.nan_to_num(rates, nan=-1.0))
                if len(order) > 1 and not np.isnan(rates[order[1]]):
                    k = int(self._allowed[order[0] if self._allowed[order[0]] != self._k else order[1]])
                self._since_probe = 0
        self._last_k = k
        return k

    def time_step(self, batch_size: int, k: int, step_seconds: float) -> None:
        """Records the wall time of a step ``update`` recorded untimed (``step_seconds=None``): its time
        learned later (over several processes every controller learns process 0's time a step late)."""
        require_int("AdaptiveController.time_step", "batch_size", batch_size, minimum=1)
        self._table.time(batch_size, k, float(step_seconds))

    def _sorted_ids(self, request_ids: Any, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """``request_ids`` checked and sorted, and the order that sorts them; the last call's answer when
        they hold the same values again (compared by content: a static batch's ids, given anew each step)."""
        raw = request_ids if isinstance(request_ids, np.ndarray) else np.asarray(request_ids)
        last_raw, last_sorted, last_order = self._last_ids
        if raw.dtype == last_raw.dtype and raw.size <= batch_size and _same(raw, last_raw):
            return last_sorted, last_order
        checked = _int_vector("AdaptiveController.next_k", "request_ids", raw, batch_size)
        order = np.argsort(checked, kind="stable")
        ids = checked[order]
        self._last_ids = (raw.copy(), ids, order)
        return ids, order

    def _decide(self, rates: np.ndarray) -> None:
        """Holds the allowed k of the best ``rates`` where it beats the held k's by ``switch_margin``."""
        values = rates.tolist()
        measured = [i for i, rate in enumerate(values) if rate == rate]
        if not measured:               # all nan
            return
        best = max(measured, key=values.__getitem__)    # the first of the largest (np.nanargmax)
        held = values[self._column[self._k]]
        if held != held or values[best] > held * (1.0 + self.config.switch_margin):
            self._k = self._allowed_k[best]

    def update(self, num_draft_tokens: Any, num_accepted: Any, step_seconds: float | None = None,
               batch_size: int | None = None, request_ids: Any = None, *, k: int | None = None) -> None:
        """Records one step.

        Args:
          num_draft_tokens: int[B] drafts each request verified (<= k_max); at a k = 0 step they may be
            counterfactual: drafts proposed but not verified (n-gram), that inform the acceptance only.
          num_accepted: int[B] drafts accepted per request (<= num_draft_tokens).
          step_seconds: the step's wall time, or None if not timed (a compile).
          batch_size: rows the step computed (B plus padding); default B.
          request_ids: int[B] the requests' ids, for their own acceptance scales (kept while they run).
          k: the ``next_k`` answer the step ran with (its cost is what choosing k costs: with n-gram
            drafts or budgets ending, the step may compute fewer); default the last ``next_k``.
        """
        where = "AdaptiveController.update"
        cfg = self.config
        drafts = _int_vector(where, "num_draft_tokens", num_draft_tokens, _ANY_LENGTH)
        accepted = _int_vector(where, "num_accepted", num_accepted, drafts.size)
        if drafts.shape != accepted.shape:
            raise ValueError(f"{where}: num_draft_tokens {drafts.shape} and num_accepted {accepted.shape} must "
                             "have the same shape [B]")
        if drafts.size and (np.maximum.reduce(drafts) > cfg.k_max or (accepted > drafts).any()):
            raise ValueError(f"{where}: num_draft_tokens must be in [0, k_max={cfg.k_max}] and num_accepted in "
                             "[0, num_draft_tokens] per request")
        batch = drafts.size if batch_size is None else batch_size
        require_int(where, "batch_size", batch, minimum=max(drafts.size, 1))
        if k is not None:
            require_int(where, "k", k, minimum=0)
        # request b accepted positions 1..n_b and reached 1..min(d_b, n_b + 1): [2, k_max + 1] how many
        # requests stopped at each position
        width = cfg.k_max + 1
        reached = np.minimum(drafts, accepted + 1)
        stops = np.bincount(np.concatenate([accepted, reached + width]), minlength=2 * width).reshape(2, width)
        if request_ids is not None:
            ids = _int_vector(where, "request_ids", request_ids, drafts.size)
            if ids.size != drafts.size:
                raise ValueError(f"{where}: request_ids must have one id per request ({drafts.size}), got {ids.size}")
            expected = self._estimates()[1][reached]
            same = self._requests.are(ids)
            counts = self._requests.lookup(ids) * cfg.acceptance_decay
            counts[0] += accepted
            counts[1] += expected
            if same:     # the same requests: their ids (and argsort) stay
                self._requests.counts = counts
            else:
                self._requests = _Requests(ids.copy(), counts)
        self._counts *= cfg.acceptance_decay
        self._counts += stops.dot(self._tails)    # [2, k_max] requests that accepted / reached each position
        self._estimated = None
        self._table.observe(batch, self._last_k if k is None else k,
                            None if step_seconds is None else float(step_seconds))
        self._since_decision += 1
        self._since_probe += 1


__all__ = ["AdaptiveController", "ControllerConfig", "expected_tokens"]
