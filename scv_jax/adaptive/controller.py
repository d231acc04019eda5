"""Host-side speculation-length controller: the k (drafts per request per step) of most tokens per second.

With conditional acceptance a_j (the chance draft j is accepted given drafts 1..j-1 were), a step with k
drafts emits on average E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j tokens per request. The controller keeps

* a_j per draft position: decayed counts over the batch's requests (``acceptance_decay`` per step),
  each position shrunk toward the one before (position 1 toward ``prior_acceptance``), so positions
  past the held k extrapolate and, while k = 0 runs no drafts, drift back to the prior;
* the measured seconds of a step of each allowed k per batch bucket (``cost_model.StepCostTable``).

Every ``decide_every`` steps, and at once when the batch changes (another bucket or other requests), it
picks the k maximising E(k) / T(k) (E: the mean over the step's requests, each capped at the tokens it
has left, ``remaining_tokens``), switching only for a gain above ``switch_margin``. A k never timed in a bucket is run there first (up to 3 tries: a try may be an untimed compile),
and every ``probe_every`` steps the runner-up runs one step, so a held k = 0 is left when drafting would
pay again and the costs of other k follow the machine.
"""

from __future__ import annotations

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
        for name in ("k_min", "k_max", "probe_every"):
            require_int("ControllerConfig", name, getattr(self, name), minimum=0)
        require_int("ControllerConfig", "decide_every", self.decide_every, minimum=1)
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


def _int_vector(where: str, name: str, value: Any, longest: int) -> np.ndarray:
    """``value`` as int64[n] with 0 <= entries and n <= ``longest``, else a ValueError naming it."""
    array = np.asarray(value)
    if array.ndim != 1 or array.dtype.kind not in "iu" or array.size > longest or (array.size and array.min() < 0):
        raise ValueError(f"{where}: {name} must be a vector of at most {longest} non-negative ints, got shape "
                         f"{array.shape} dtype {array.dtype}" + (f" min {array.min()}" if array.size else ""))
    return array.astype(np.int64)


class AdaptiveController:
    """Chooses the drafts per request of each step (see the module doc). Host-side, numpy only.

    Build with a ``ControllerConfig`` and/or its fields as keywords: ``AdaptiveController(k_max=6)``.
    Call ``next_k(batch_size)`` before each step and ``update(...)`` with the step's counts after.
    """

    def __init__(self, config: ControllerConfig | None = None, **overrides: Any):
        config = config or ControllerConfig()
        self.config = cfg = replace(config, **overrides) if overrides else config
        self._allowed = np.array(cfg.allowed)
        self._k = cfg.k_init if cfg.k_init is not None else cfg.allowed[-1]   # the held k
        self._last_k = self._k
        self._table = StepCostTable(cfg.allowed, cfg.cost_rate)
        self._counts = np.zeros((2, cfg.k_max))   # decayed drafts accepted at / reaching each position
        # the last update's requests (their ids) and their decayed accepted drafts and expectation under a_j
        self._requests: tuple[np.ndarray, np.ndarray] = (np.zeros(0, np.int64), np.zeros((2, 0)))
        self._decided_for: tuple[int, np.ndarray | None] = (0, None)   # (bucket, sorted ids) of the last decision
        self._since_decision = self._since_probe = 0
        self._probing = False    # the last k was a never-timed one's: look for the next at once

    def acceptance(self) -> np.ndarray:
        """float64[k_max] estimated a_j for positions j = 1..k_max."""
        cfg = self.config
        out, prior = np.empty(cfg.k_max), cfg.prior_acceptance
        for j, (success, trials) in enumerate(zip(*self._counts.tolist())):
            prior = out[j] = min((success + cfg.prior_strength * prior) / (trials + cfg.prior_strength),
                                 _MAX_ACCEPTANCE)
        return out

    def step_seconds(self, batch_size: int) -> np.ndarray:
        """float64[len(allowed)] measured seconds of a step of each allowed k at ``batch_size`` (nan: never)."""
        return self._table.seconds(batch_size)

    def _request_counts(self, ids: np.ndarray) -> np.ndarray:
        """float64[2, n] the last update's (accepted, expected) counts of requests ``ids`` (0 for others)."""
        known, counts = self._requests
        out = np.zeros((2, ids.size))
        if known.size and ids.size:
            order = np.argsort(known)
            at = order[np.minimum(np.searchsorted(known, ids, sorter=order), known.size - 1)]
            found = known[at] == ids
            out[:, found] = counts[:, at[found]]
        return out

    def rates(self, batch_size: int, request_ids: np.ndarray | None = None,
              remaining_tokens: np.ndarray | None = None) -> np.ndarray:
        """float64[len(allowed)] expected tokens per request per second of each allowed k (nan: never timed).
        With int[n] ``request_ids`` each request's a_j are the shared ones times its own scale (its accepted
        over its expected drafts, shrunk by ``prior_strength``); with int[n] ``remaining_tokens`` too, each
        request's tokens are capped at those it has left (a step's drafts never pass a request's budget)."""
        a = self.acceptance()[None, :]
        if request_ids is not None and request_ids.size:
            counts = self._request_counts(request_ids) + self.config.prior_strength
            a = np.minimum(np.outer(counts[0] / counts[1], a), _MAX_ACCEPTANCE)
        elif remaining_tokens is not None and remaining_tokens.size:
            a = np.broadcast_to(a, (remaining_tokens.size, a.shape[1]))
        # accepted drafts of a request with k drafts: sum_{j<=k} reach_j, capped at the tokens it has left
        reach = np.concatenate([np.zeros((a.shape[0], 1)), np.cumprod(a, axis=1)], axis=1)
        mean = np.cumsum(reach, axis=1)
        if remaining_tokens is None or not remaining_tokens.size or a.shape[0] != remaining_tokens.size:
            per_request = 1.0 + mean[:, self._allowed].mean(axis=0)
        else:
            caps = np.minimum(self._allowed[None, :], np.maximum(remaining_tokens[:, None] - 1, 0))
            per_request = 1.0 + np.take_along_axis(mean, caps, axis=1).mean(axis=0)
        return per_request / self._table.seconds(batch_size)

    def next_k(self, batch_size: int, request_ids: Any = None, remaining_tokens: Any = None) -> int:
        """The drafts per request of the coming step of ``batch_size`` rows (padding rows included: the step's
        cost). ``request_ids``: the step's requests (int[n], n <= batch_size; other requests than at the
        last decision decide at once). ``remaining_tokens``: int[n] tokens each has yet to emit (its
        tokens per step are capped there); None: no cap."""
        where = "AdaptiveController.next_k"
        require_int(where, "batch_size", batch_size, minimum=1)
        ids = None if request_ids is None else np.sort(_int_vector(where, "request_ids", request_ids, batch_size))
        remaining = None if remaining_tokens is None else _int_vector(where, "remaining_tokens", remaining_tokens,
                                                                      batch_size)
        if ids is not None and remaining is not None and ids.shape != remaining.shape:
            raise ValueError(f"{where}: remaining_tokens {remaining.shape} must have one entry per request id "
                             f"{ids.shape}")
        cfg = self.config
        if cfg.mode == "fixed":
            return self._k
        bucket = batch_bucket(batch_size)
        decided_bucket, decided_ids = self._decided_for
        new_batch = bucket != decided_bucket or (ids is not None and (decided_ids is None
                                                                     or not np.array_equal(ids, decided_ids)))
        rates, k = None, self._k
        if new_batch or self._probing or self._since_decision >= cfg.decide_every:
            untimed = np.isnan(self._table.seconds(batch_size)) & (self._table.tries(batch_size) < _TRIES)
            untimed[self._allowed == self._last_k] = False   # the last step's time is still to come
            self._probing = bool(untimed.any())
            if self._probing:                                 # a k never timed here: time it
                k = int(self._allowed[np.flatnonzero(untimed)[-1]])
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

    def _decide(self, rates: np.ndarray) -> None:
        """Holds the allowed k of the best ``rates`` where it beats the held k's by ``switch_margin``."""
        if np.isnan(rates).all():
            return
        best = int(np.nanargmax(rates))
        held = rates[self.config.allowed.index(self._k)]
        if np.isnan(held) or rates[best] > held * (1.0 + self.config.switch_margin):
            self._k = int(self._allowed[best])

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
        drafts = _int_vector(where, "num_draft_tokens", num_draft_tokens, np.iinfo(np.int64).max)
        accepted = _int_vector(where, "num_accepted", num_accepted, drafts.size)
        if drafts.shape != accepted.shape:
            raise ValueError(f"{where}: num_draft_tokens {drafts.shape} and num_accepted {accepted.shape} must "
                             "have the same shape [B]")
        if drafts.size and (drafts.max() > cfg.k_max or (accepted > drafts).any()):
            raise ValueError(f"{where}: num_draft_tokens must be in [0, k_max={cfg.k_max}] and num_accepted in "
                             "[0, num_draft_tokens] per request")
        batch = drafts.size if batch_size is None else batch_size
        require_int(where, "batch_size", batch, minimum=max(drafts.size, 1))
        if k is not None:
            require_int(where, "k", k, minimum=0)
        # request b accepted positions 1..n_b and reached 1..min(d_b, n_b + 1): [2, k_max + 1] how many
        # requests stopped at each position, summed from the last position down
        width = cfg.k_max + 1
        stops = np.bincount(np.concatenate([accepted, np.minimum(drafts, accepted + 1) + width]),
                            minlength=2 * width).reshape(2, width)
        if request_ids is not None:
            ids = _int_vector(where, "request_ids", request_ids, drafts.size)
            if ids.size != drafts.size:
                raise ValueError(f"{where}: request_ids must have one id per request ({drafts.size}), got {ids.size}")
            expected = np.concatenate([[0.0], np.cumsum(self.acceptance())])[np.minimum(drafts, accepted + 1)]
            counts = self._request_counts(ids) * cfg.acceptance_decay + np.stack([accepted, expected])
            self._requests = (ids, counts)
        self._counts *= cfg.acceptance_decay
        self._counts += np.cumsum(stops[:, ::-1], axis=1)[:, -2::-1]
        self._table.observe(batch, self._last_k if k is None else k,
                            None if step_seconds is None else float(step_seconds))
        self._since_decision += 1
        self._since_probe += 1


__all__ = ["AdaptiveController", "ControllerConfig", "expected_tokens"]
