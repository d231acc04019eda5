"""Online model of one speculative decoding step's wall time (host-side, numpy only).

A step with batch size B, D = sum of per-request drafts and F sequential draft forwards costs

    seconds ~ theta . [1, B + D, F, D]
              (fixed, target tokens, draft forwards, draft tokens)

i.e. a fixed part, a target forward over B + D tokens, F draft forwards and their per-token part.
The non-negative coefficients are fitted by exponentially forgetting least squares, locally in batch
size, regularised toward a default model (pseudo-observations on a grid of (k, B)), so predictions are
sensible before any timing arrives and track changes (load, context growth) afterwards. The default
model is in units of one batch-1 target forward; the first measured step fixes the unit in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NUM_FEATURES = 4
_PRIOR_KS = (0, 1, 4, 8)
_PRIOR_BATCHES = (1, 8, 64, 256)


def step_features(batch_size: np.ndarray | int, num_draft_tokens: np.ndarray | int,
                  num_draft_forwards: np.ndarray | int) -> np.ndarray:
    """float64[..., 4] features of steps: (1, target tokens B + D, draft forwards F, draft tokens D)."""
    b, d, f = (np.asarray(v, np.float64) for v in (batch_size, num_draft_tokens, num_draft_forwards))
    shape = np.broadcast_shapes(b.shape, d.shape, f.shape)
    out = np.empty(shape + (NUM_FEATURES,))
    out[..., 0], out[..., 1], out[..., 2], out[..., 3] = 1.0, b + d, f, d
    return out


def _nonnegative_solve(gram: np.ndarray, moment: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (no cost is negative): drops the most negative
    coefficient and refits until none is (a greedy active set; exact when at most one is dropped)."""
    active = np.ones(moment.shape[0], bool)
    while True:
        theta = np.zeros_like(moment)
        index = np.flatnonzero(active)
        theta[index] = np.linalg.solve(gram[np.ix_(index, index)], moment[index])
        if not np.any(theta < 0):
            return theta
        active[np.argmin(theta)] = False


@dataclass(frozen=True)
class CostPrior:
    """The default cost model, relative to one batch-1 target forward.

    Attributes:
      draft_cost_ratio: one batch-1 draft forward / one batch-1 target forward.
      target_saturation_tokens: tokens in one target forward at which its cost has doubled.
      draft_saturation_tokens: the same for one draft forward.
    """

    draft_cost_ratio: float = 0.1
    target_saturation_tokens: float = 256.0
    draft_saturation_tokens: float = 2048.0

    def __post_init__(self):
        for name in ("draft_cost_ratio", "target_saturation_tokens", "draft_saturation_tokens"):
            if not getattr(self, name) > 0:
                raise ValueError(f"CostPrior: {name} must be > 0, got {getattr(self, name)!r}")

    def coefficients(self) -> np.ndarray:
        """float64[4] coefficients of the default model, in target-forward units."""
        st, sd, c = self.target_saturation_tokens, self.draft_saturation_tokens, self.draft_cost_ratio
        return np.array([1.0 - 1.0 / st, 1.0 / st, c * (1.0 - 1.0 / sd), c / sd])


class StepCostModel:
    """Locally weighted, exponentially forgetting, non-negative least squares of step seconds.

    Predictions at batch size B weight each remembered step by ``decay ** age`` times a Gaussian
    kernel in log2 batch size (``batch_bandwidth``), so the linear model is fitted locally: step cost
    is convex in tokens (memory-bound, then compute-bound), which one global line cannot follow.

    Args:
      prior: the default model.
      decay: forgetting factor per observation, in (0, 1]; 0.98 weights the last ~50 steps.
      batch_bandwidth: kernel width in log2(batch size) (0.5: batch sizes 1.4x apart weigh 0.6).
      prior_weight: how many observations the default model is worth.
      capacity: steps remembered.
      outlier_ratio: a step slower than ``outlier_ratio`` x the prediction (a compile, a
        pause) is skipped, at most ``max_skips`` times in a row; a step faster than prediction / ratio
        means the earlier data were outliers, and the fit restarts from it.
    """

    def __init__(self, prior: CostPrior, *, decay: float = 0.98, batch_bandwidth: float = 0.5,
                 prior_weight: float = 0.1, capacity: int = 256, outlier_ratio: float = 4.0,
                 max_skips: int = 3):
        self._prior_theta = prior.coefficients()
        grid = np.array([(k, b) for k in _PRIOR_KS for b in _PRIOR_BATCHES], np.float64)
        x = step_features(grid[:, 1], grid[:, 0] * grid[:, 1], grid[:, 0])
        self._prior_gram = prior_weight / len(x) * x.T @ x
        self._decay = decay
        self._bandwidth = batch_bandwidth
        self._outlier_ratio = outlier_ratio
        self._max_skips = max_skips
        self._unit: float | None = None  # seconds per target-forward unit; None until timed
        self._features = np.zeros((capacity, NUM_FEATURES))  # ring buffers of observed steps
        self._seconds = np.zeros(capacity)
        self._log_batch = np.zeros(capacity)
        self._order = np.zeros(capacity)  # observation number, for ages
        self._fits: dict[int, np.ndarray] = {}  # batch size -> coefficients, until the next observation
        self.num_observations = 0
        self.num_skipped = 0
        self._skips_in_row = 0

    @property
    def timed(self) -> bool:
        """True once a measured step time has arrived (predictions are then in seconds)."""
        return self._unit is not None

    def coefficients(self, batch_size: int) -> np.ndarray:
        """float64[4] coefficients at ``batch_size`` (seconds once ``timed``, else target-forward units)."""
        batch_size = int(batch_size)
        if self._unit is None:
            return self._prior_theta.copy()
        if batch_size not in self._fits:
            n = min(self.num_observations, self._seconds.shape[0])
            age = self.num_observations - 1 - self._order[:n]
            distance = (self._log_batch[:n] - np.log2(max(batch_size, 1))) / self._bandwidth
            weight = self._decay ** age * np.exp(-0.5 * distance ** 2)
            x = self._features[:n]
            gram = self._prior_gram + (x * weight[:, None]).T @ x
            moment = self._unit * self._prior_gram @ self._prior_theta + x.T @ (weight * self._seconds[:n])
            self._fits[batch_size] = _nonnegative_solve(gram, moment)
        return self._fits[batch_size].copy()

    def predict(self, features: np.ndarray) -> np.ndarray:
        """Predicted step seconds for float64[..., 4] features (batch size = target tokens - drafts)."""
        features = np.asarray(features, np.float64)
        batch = np.rint(features[..., 1] - features[..., 3]).astype(np.int64)
        out = np.empty(features.shape[:-1])
        for b in np.unique(batch) if batch.size > 1 else batch.reshape(1):
            rows = batch == b
            theta = self._fits.get(int(b))
            theta = self.coefficients(int(b)) if theta is None else theta
            out[rows] = np.maximum(features[rows] @ theta, 1e-6 * max(theta[0], 1e-12))
        return out

    def observe(self, features: np.ndarray, seconds: float) -> bool:
        """Adds one measured step (float64[4] features); returns False when skipped as an outlier."""
        if not np.isfinite(seconds) or seconds <= 0:
            raise ValueError(f"step_seconds must be a positive finite number, got {seconds!r}")
        if self._unit is not None:
            predicted = float(self.predict(features))
            if seconds > self._outlier_ratio * predicted and self._skips_in_row < self._max_skips:
                self._skips_in_row += 1
                self.num_skipped += 1
                return False
            if seconds * self._outlier_ratio < predicted:
                self._unit = None  # the data so far were slow outliers: restart from this step
        self._skips_in_row = 0
        if self._unit is None:
            self._unit = seconds / float(features @ self._prior_theta)
            self.num_observations = 0
        slot = self.num_observations % self._seconds.shape[0]
        self._features[slot] = features
        self._seconds[slot] = seconds
        self._log_batch[slot] = np.log2(max(features[1] - features[3], 1.0))
        self._order[slot] = self.num_observations
        self.num_observations += 1
        self._fits.clear()
        return True
