"""Online model of one speculative decoding step's wall time (host-side, numpy only).

Two layers, both cheap enough to update every step:

* ``StepCostModel``, a linear model: a step with batch size B, D draft tokens computed and F
  sequential draft forwards costs

      seconds ~ theta . [1, B + D, F, D']
                (fixed, target tokens, draft forwards, draft tokens)

  (D' = D with a draft model, 0 for drafts that cost no device work, e.g. n-gram prompt lookup)

  with non-negative coefficients fitted by exponentially forgetting least squares, locally in batch
  size, regularised toward a default model (pseudo-observations on a grid of (k, B)), so
  predictions are sensible before any timing arrives and for shapes never measured. The default
  model is in units of one batch-1 target forward; the first measured step fixes the unit in seconds.
  Its sufficient statistics are kept per batch size, so an observation costs O(1) and a refit sums
  a handful of 4 x 4 matrices.
* ``StepCostTable``: the measured time of each (batch size, k) shape, blended with the linear model's
  prediction by how well that model fits the shapes measured (a shape measured often is predicted
  by its own measurements where the cost is not linear, e.g. XLA:CPU's step-wise cost in tokens),
  times a load factor that follows the machine, so shapes measured at different times compare.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

NUM_FEATURES = 4
_PRIOR_KS = (0, 1, 4, 8)
_PRIOR_BATCHES = (1, 8, 64, 256)


def step_features(batch_size: np.ndarray | int, num_draft_tokens: np.ndarray | int,
                  num_draft_forwards: np.ndarray | int, *, draft_model: bool = True) -> np.ndarray:
    """float64[..., 4] features of steps: (1, target tokens B + D, draft forwards F, draft-model tokens
    D, or 0 when ``draft_model`` is False)."""
    b, d, f = (np.asarray(v, np.float64) for v in (batch_size, num_draft_tokens, num_draft_forwards))
    shape = np.broadcast_shapes(b.shape, d.shape, f.shape)
    out = np.empty(shape + (NUM_FEATURES,))
    out[..., 0], out[..., 1], out[..., 2], out[..., 3] = 1.0, b + d, f, d if draft_model else 0.0
    return out


def _solve(gram: list[list[float]], moment: list[float], index: list[int]) -> list[float]:
    """x solving gram[index, index] x = moment[index]: Gaussian elimination with partial pivoting in
    plain Python (a handful of unknowns: cheaper than a LAPACK call)."""
    n = len(index)
    a = [[gram[i][j] for j in index] + [moment[i]] for i in index]
    for c in range(n):
        pivot = max(range(c, n), key=lambda r: abs(a[r][c]))
        a[c], a[pivot] = a[pivot], a[c]
        top = a[c]
        for row in a[c + 1:]:
            factor = row[c] / top[c]
            for j in range(c, n + 1):
                row[j] -= factor * top[j]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (a[r][n] - sum(a[r][j] * x[j] for j in range(r + 1, n))) / a[r][r]
    return x


def _nonnegative_solve(gram: np.ndarray, moment: np.ndarray,
                       active: list[bool] | None = None) -> tuple[list[float], list[bool]]:
    """Least squares with every coefficient >= 0 (no cost is negative) for a positive definite
    ``gram``: an active-set method started from ``active`` (e.g. the last fit's; default all free)
    that drops the most negative coefficient while any is, then frees a held one whose gradient
    says it would lower the error (the optimality conditions). Returns (coefficients, active set)."""
    size = moment.shape[0]
    g, m = gram.tolist(), moment.tolist()
    active = [True] * size if active is None else list(active)
    tolerance = 1e-12 * max(abs(v) for v in m)
    feasible = ([0.0] * size, [False] * size)
    for _ in range(4 * size):
        index = [i for i in range(size) if active[i]]
        theta = [0.0] * size
        for i, value in zip(index, _solve(g, m, index)):
            theta[i] = value
        lowest = min(index, key=theta.__getitem__, default=None)
        if lowest is not None and theta[lowest] < 0:
            active[lowest] = False
            continue
        feasible = (theta, list(active))
        gradient = [m[i] - sum(g[i][j] * theta[j] for j in index) for i in range(size)]
        entering = max((i for i in range(size) if not active[i]), key=gradient.__getitem__, default=None)
        if entering is None or gradient[entering] <= tolerance:
            break
        active[entering] = True
    return feasible


def _blended_log(count: float, mean: float, weight: float, model: float) -> float:
    """A shape's log relative cost: its ``count`` measurements' mean log seconds and the linear model's
    log prediction worth ``weight`` measurements, averaged."""
    return (count * mean + weight * model) / (count + weight)


def _nondecreasing(values: list[float], weights: list[float]) -> list[float]:
    """The weighted least-squares fit of ``values`` that never decreases (pool adjacent violators)."""
    blocks: list[list[float]] = []          # [weighted sum, weight, size] of each pooled run
    for value, weight in zip(values, weights):
        blocks.append([weight * value, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] * blocks[-1][1] > blocks[-1][0] * blocks[-2][1]:
            last = blocks.pop()        # below the run before it: pooled into it
            for i in range(3):
                blocks[-1][i] += last[i]
    return [total / pooled for total, pooled, size in blocks for _ in range(int(size))]


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
    Observations are buffered and folded into per-batch-size sufficient statistics when a fit is
    needed; a fit is cached per batch size and refreshed after ``refit_every`` observations, or once
    the observations at its batch size have doubled (a new batch size's fit follows its first steps),
    so an observation costs O(1).

    Args:
      prior: the default model.
      decay: forgetting factor per observation, in (0, 1]; 0.98 weights the last ~50 steps.
      batch_bandwidth: kernel width in log2(batch size) (0.5: batch sizes 1.4x apart weigh 0.6).
      prior_weight: how many observations the default model is worth.
      outlier_ratio: a step slower than ``outlier_ratio`` x the prediction (a compile, a
        pause) is skipped, at most ``max_skips`` times in a row; a step faster than prediction / ratio
        means the earlier data were outliers, and the fit restarts from it.
      refit_every: observations a cached fit serves before it is refitted.
    """

    def __init__(self, prior: CostPrior, *, decay: float = 0.98, batch_bandwidth: float = 0.5,
                 prior_weight: float = 0.1, outlier_ratio: float = 4.0, max_skips: int = 3,
                 refit_every: int = 32):
        self._prior_theta = prior.coefficients()
        self._prior_list = self._prior_theta.tolist()   # ``theta`` before any timing (one object: cacheable)
        grid = np.array([(k, b) for k in _PRIOR_KS for b in _PRIOR_BATCHES], np.float64)
        x = step_features(grid[:, 1], grid[:, 0] * grid[:, 1], grid[:, 0])
        self._prior_gram = prior_weight / len(x) * x.T @ x
        self._prior_moment = self._prior_gram @ self._prior_theta     # in target-forward units
        self._decay = decay
        self._bandwidth = batch_bandwidth
        self._outlier_ratio = outlier_ratio
        self._max_skips = max_skips
        self._refit_every = refit_every
        self.num_skipped = 0
        self._skips_in_row = 0
        self._reset()

    def _reset(self) -> None:
        """Forgets every observation (predictions fall back to the default model's units)."""
        self._unit: float | None = None  # seconds per target-forward unit; None until timed
        self._batch_index: dict[int, int] = {}                 # batch size -> row of the statistics
        self._log_batch = np.zeros(0)
        self._grams = np.zeros((0, NUM_FEATURES, NUM_FEATURES))   # decayed sum of x x^T per batch size,
        self._moments = np.zeros((0, NUM_FEATURES))               # and of x * seconds, as of _folded_at
        self._folded_at = 0
        self._pending: list[tuple[int, tuple[float, ...], float]] = []   # (row, features, seconds)
        self._row_counts: list[int] = []                        # observations per batch size
        # batch size -> (coefficients, observations in all and at that batch size when fitted, the
        # coefficients free of their bound, where the next fit starts)
        self._fits: dict[int, tuple[list[float], int, int, list[bool]]] = {}
        self.num_observations = 0

    @property
    def timed(self) -> bool:
        """True once a measured step time has arrived (predictions are then in seconds)."""
        return self._unit is not None

    def coefficients(self, batch_size: int) -> np.ndarray:
        """float64[4] coefficients at ``batch_size`` (seconds once ``timed``, else target-forward units)."""
        return np.array(self.theta(int(batch_size)))

    def _fold(self) -> None:
        """Moves the buffered observations into the per-batch-size statistics."""
        if not self._pending:
            return
        rows = np.array([p[0] for p in self._pending])
        x = np.array([p[1] for p in self._pending])
        seconds = np.array([p[2] for p in self._pending])
        now = self.num_observations
        weight = self._decay ** (now - self._folded_at)
        self._grams *= weight
        self._moments *= weight
        age = self._decay ** (now - 1 - np.arange(now - len(rows), now))
        # [rows, pending] weights of each observation in its batch size's row: one product per statistic
        owner = (rows == np.arange(len(self._row_counts))[:, None]) * age
        self._grams += (owner @ (x[:, :, None] * x[:, None, :]).reshape(len(rows), -1)).reshape(self._grams.shape)
        self._moments += owner @ (seconds[:, None] * x)
        self._pending.clear()
        self._folded_at = now

    def theta(self, batch_size: int) -> list[float]:
        """The coefficients at ``batch_size`` as a list (cached until the next refit: do not modify)."""
        if self._unit is None:
            return self._prior_list
        cached = self._fits.get(batch_size)
        row = self._batch_index.get(batch_size)
        here = self._row_counts[row] if row is not None else 0
        if (cached is not None and self.num_observations - cached[1] < self._refit_every
                and here <= 2 * cached[2]):      # and not twice as many observations at this batch size
            return cached[0]
        self._fold()
        distance = (self._log_batch - math.log2(max(batch_size, 1))) / self._bandwidth
        weight = np.exp(-0.5 * distance ** 2)
        gram = self._prior_gram + (weight @ self._grams.reshape(len(weight), -1)).reshape(self._prior_gram.shape)
        moment = self._unit * self._prior_moment + weight @ self._moments
        theta, active = _nonnegative_solve(gram, moment, None if cached is None else cached[3])
        self._fits[batch_size] = (theta, self.num_observations, here, active)
        return theta

    def predict_one(self, batch_size: int, num_draft_tokens: float, num_draft_forwards: float,
                    draft_model_tokens: float) -> float:
        """Predicted seconds of one step (the features of ``step_features``), in plain Python."""
        t0, t1, t2, t3 = self.theta(batch_size)
        return max(t0 + t1 * (batch_size + num_draft_tokens) + t2 * num_draft_forwards + t3 * draft_model_tokens,
                   1e-6 * max(t0, 1e-12))

    def predict(self, features: np.ndarray) -> np.ndarray:
        """Predicted step seconds for float64[..., 4] features (batch size = target tokens - drafts)."""
        features = np.asarray(features, np.float64)
        batch = np.rint(features[..., 1] - features[..., 3]).astype(np.int64)
        out = np.empty(features.shape[:-1])
        for b in np.unique(batch):
            rows = batch == b
            theta = np.array(self.theta(int(b)))
            out[rows] = np.maximum(features[rows] @ theta, 1e-6 * max(theta[0], 1e-12))
        return out

    def is_outlier(self, predicted: float, seconds: float, *, measured: bool = True) -> bool:
        """Whether a step of ``seconds`` against a prediction of ``predicted`` is skipped as too slow
        (counts the skip); a fast one resets the model (the data so far were slow outliers).
        ``measured``: whether the prediction rests on measurements of this step's shape; one that is
        only extrapolated (a batch size never timed) neither skips nor resets anything."""
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"step_seconds must be a positive finite number, got {seconds!r}")
        if self._unit is None or not measured:
            return False
        if seconds > self._outlier_ratio * predicted and self._skips_in_row < self._max_skips:
            self._skips_in_row += 1
            self.num_skipped += 1
            return True
        if seconds * self._outlier_ratio < predicted:
            self._reset()
        self._skips_in_row = 0
        return False

    def observe(self, features: np.ndarray, seconds: float) -> bool:
        """Adds one measured step (float64[4] features); returns False when skipped as an outlier."""
        if self.is_outlier(float(self.predict(features)), seconds):
            return False
        self.add(tuple(float(f) for f in features), seconds)
        return True

    def add(self, features: tuple[float, float, float, float], seconds: float) -> None:
        """Adds one measured step (4 features, floats) without the outlier test (the caller made it)."""
        if self._unit is None:
            self._unit = seconds / sum(f * t for f, t in zip(features, self._prior_list))
        batch = int(round(features[1] - features[3]))
        row = self._batch_index.get(batch)
        if row is None:
            self._fold()
            row = self._batch_index[batch] = len(self._batch_index)
            self._log_batch = np.append(self._log_batch, math.log2(max(batch, 1)))
            self._grams = np.concatenate([self._grams, np.zeros((1, NUM_FEATURES, NUM_FEATURES))])
            self._moments = np.concatenate([self._moments, np.zeros((1, NUM_FEATURES))])
            self._row_counts.append(0)
            self._fits.clear()   # a new batch size moves every local fit near it
        self._row_counts[row] += 1
        self._pending.append((row, features, seconds))
        self.num_observations += 1


class StepCostTable:
    """Step seconds per shape (batch size, k) as a machine-wide load factor times a relative cost.

    A shape's relative cost blends, in logs, the forgetting mean of its ``n`` (decayed)
    load-normalised measurements (a geometric mean: one step slowed by a burst of other work moves it
    little) with the linear model's prediction, the model worth ``w`` measurements: ``w`` is the
    ratio of the measurements' noise variance to the model's misfit variance across this batch
    size's measured shapes (empirical Bayes), so where the linear model fits (a cost linear in
    tokens) it speaks for every shape, and where it does not (XLA:CPU, where 2 and 4 drafts can cost
    the same and 6 much more) each shape's own measurements do. The load factor follows the machine
    (other processes, clock changes): each measurement of a shape whose cost is known moves it toward
    measured / predicted (``load_rate`` of the log-ratio, scaled by how well the shape is known), so a
    shape measured under one load and another measured later under a heavier one still compare by
    their own costs. Decisions compare shapes at the current load: only relative costs matter to them.
    A row's costs are then made non-decreasing in k (a weighted isotonic fit, each shape weighing its
    measurements plus the model's worth): a step with more drafts computes more, so a larger k that
    looks cheaper is noise (a timing on a quiet machine), pooled with its neighbours.

    Args:
      model: the linear model (fed the load-normalised measurements here).
      k_values: the k of the shapes; forwards: the draft forwards of a step with each of them.
      draft_model: whether drafts run through a draft model (its per-token cost).
      decay: forgetting factor per measurement of a shape.
      load_rate: how far one measurement of a well-known shape moves the load factor (in log-ratio).
    """

    _NOISE_PRIOR = 0.01      # log-variance of one measurement before any are repeated (10% noise)
    _MISFIT_PRIOR = 0.0025   # log-variance of the model's misfit before two shapes are measured (5%)
    _WEIGHT_EVERY = 8        # measurements at a batch size between refreshes of the model's worth there
    _QUEUE_LIMIT = 64        # queued measurements applied without waiting for a read

    def __init__(self, model: StepCostModel, k_values: tuple[int, ...], forwards: tuple[int, ...], *,
                 draft_model: bool = True, decay: float = 0.98, load_rate: float = 0.1):
        self.model = model
        self.columns = {k: i for i, k in enumerate(k_values)}
        self._shapes = tuple((k, f, k if draft_model else 0) for k, f in zip(k_values, forwards))
        self._decay, self._load_rate = decay, load_rate
        self.load = 1.0
        # batch -> per k: decayed count, mean and decayed squared deviations of log seconds
        self._measured: dict[int, tuple[list[float], list[float], list[float]]] = {}
        self._model_rows: dict[int, tuple[list[float], list[float]]] = {}  # batch -> (theta, log seconds per k)
        # batch -> (its model row, its measurements' version, ``relative``): valid until either changes
        self._relative: dict[int, tuple[list[float], int, list[float]]] = {}
        # batch -> (its model row, the version, the model's worth there): refreshed every few versions
        self._weights: dict[int, tuple[list[float], int, float]] = {}
        self._versions: dict[int, int] = {}   # batch -> measurements added at that batch size
        self._queue: list[tuple[int, int | None, tuple[float, float, float, float], float]] = []
        self.timed_seconds = 0.0     # the seconds of the applied (not outlier) measurements

    def _model_row(self, batch_size: int) -> list[float]:
        theta = self.model.theta(batch_size)
        cached = self._model_rows.get(batch_size)
        if cached is None or cached[0] is not theta:
            t0, t1, t2, t3 = theta
            floor = 1e-6 * max(t0, 1e-12)
            row = [math.log(max(t0 + t1 * batch_size * (k + 1) + t2 * f + t3 * batch_size * d, floor))
                   for k, f, d in self._shapes]
            cached = self._model_rows[batch_size] = (theta, row)
        return cached[1]

    def _model_weight(self, counts: list[float], means: list[float], squares: list[float],
                      model: list[float]) -> float:
        """How many measurements the model's prediction is worth at this batch size (see the class)."""
        total = sum(counts)
        repeated = sum(n for n in counts if n > 1.0)
        noise = sum(squares) / repeated if repeated else self._NOISE_PRIOR
        misfits = [(n, (mean - m) ** 2 - noise / n) for n, mean, m in zip(counts, means, model) if n >= 1.0]
        if len(misfits) < 2:
            misfit = self._MISFIT_PRIOR
        else:
            misfit = max(sum(n * v for n, v in misfits) / total, 1e-6)
        return min(max(noise, 1e-6) / misfit, 100.0)

    def _weight(self, batch_size: int, model: list[float], measured) -> float:
        """``_model_weight`` at ``batch_size``, recomputed when the model row changes or every
        ``_WEIGHT_EVERY`` measurements (it moves slowly)."""
        version = self._versions.get(batch_size, 0)
        cached = self._weights.get(batch_size)
        if cached is None or cached[0] is not model or version - cached[1] >= self._WEIGHT_EVERY:
            cached = self._weights[batch_size] = (model, version, self._model_weight(*measured, model))
        return cached[2]

    def relative(self, batch_size: int) -> list[float]:
        """The relative cost (seconds at load 1) of a step at ``batch_size`` with each of the k values."""
        self.flush()
        model = self._model_row(batch_size)
        version = self._versions.get(batch_size, 0)
        cached = self._relative.get(batch_size)
        if cached is not None and cached[0] is model and cached[1] == version:
            return cached[2]
        measured = self._measured.get(batch_size)
        if measured is None or not self.model.timed:
            out = [math.exp(m) for m in model]
        else:
            w = self._weight(batch_size, model, measured)
            counts, means, _ = measured
            logs = [_blended_log(n, mean, w, m) for n, mean, m in zip(counts, means, model)]
            out = [math.exp(x) for x in _nondecreasing(logs, [n + w for n in counts])]
        self._relative[batch_size] = (model, version, out)
        return out

    def _relative_one(self, batch_size: int, i: int) -> float:
        """Shape ``i``'s own relative cost at ``batch_size`` (``relative`` before the row is made
        non-decreasing in k): what a measurement of it is compared with."""
        model = self._model_row(batch_size)
        measured = self._measured.get(batch_size)
        if measured is None or not self.model.timed:
            return math.exp(model[i])
        weight = self._weight(batch_size, model, measured)
        return math.exp(_blended_log(measured[0][i], measured[1][i], weight, model[i]))

    def counts(self, batch_size: int) -> list[float]:
        """The decayed number of measurements of each shape at ``batch_size``."""
        self.flush()
        measured = self._measured.get(batch_size)
        return list(measured[0]) if measured is not None else [0.0] * len(self._shapes)

    def row(self, batch_size: int) -> list[float]:
        """Predicted seconds of a step at ``batch_size`` with each of the k values, at the current load."""
        relative = self.relative(batch_size)        # (applies the queue, which moves the load)
        load = self.load
        return [load * c for c in relative]

    def observe(self, batch_size: int, k: int | None, features: tuple[float, float, float, float],
                seconds: float) -> None:
        """Queues a measured step of shape (batch_size, k) (k None: not one of the shapes, only the linear
        model learns from it) with the linear model's features. The queue is applied in order at the
        next read (``flush``; at the latest after ``_QUEUE_LIMIT`` steps), as if each step had been
        applied when it came: a decoding step then costs an append, and the table's code runs once for
        several steps, its caches warm."""
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"step_seconds must be a positive finite number, got {seconds!r}")
        self._queue.append((batch_size, k, features, seconds))
        if len(self._queue) >= self._QUEUE_LIMIT:
            self.flush()

    def flush(self) -> None:
        """Applies the queued measurements in order (outliers skipped: ``StepCostModel.is_outlier``);
        ``timed_seconds`` sums the applied ones' seconds."""
        if self._queue:
            queue, self._queue = self._queue, []
            for batch_size, k, features, seconds in queue:
                if self._apply(batch_size, k, features, seconds):
                    self.timed_seconds += seconds

    def _apply(self, batch_size: int, k: int | None, features: tuple[float, float, float, float],
               seconds: float) -> bool:
        """Adds one measured step (see ``observe``); False when skipped as an outlier."""
        i = self.columns.get(k)
        measured = self._measured.get(batch_size)
        if i is None:
            t0, t1, t2, t3 = self.model.theta(batch_size)
            relative = max(t0 + t1 * features[1] + t2 * features[2] + t3 * features[3], 1e-6 * max(t0, 1e-12))
            known = 0.5
        else:
            relative = self._relative_one(batch_size, i)
            known = measured[0][i] / (measured[0][i] + 1.0) if measured else 0.0
        if self.model.is_outlier(self.load * relative, seconds, measured=known > 0.0):
            return False
        if not self.model.timed:       # the first timing, or a restart after slow outliers
            self.reset()
            measured = None
        else:
            self.load *= (seconds / (self.load * relative)) ** (self._load_rate * known)
        normalised = seconds / self.load
        if i is not None:
            if measured is None:
                measured = self._measured[batch_size] = tuple([0.0] * len(self._shapes) for _ in range(3))
            counts, means, squares = measured
            x = math.log(normalised)
            counts[i] = self._decay * counts[i] + 1.0
            delta = x - means[i]
            means[i] += delta / counts[i]
            squares[i] = self._decay * squares[i] + delta * (x - means[i])
            self._versions[batch_size] = self._versions.get(batch_size, 0) + 1
        self.model.add(features, normalised)
        return True

    def reset(self) -> None:
        """Forgets every measurement and the load."""
        self.load = 1.0
        self._measured.clear()
        self._model_rows.clear()
        self._relative.clear()
        self._weights.clear()
