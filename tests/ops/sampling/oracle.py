"""A float64 numpy oracle of the filters (one row at a time, as specified) and a chi-square check."""

from __future__ import annotations

import numpy as np

BOUNDARY = 1e-4   # masses or ratios this close to top_p / min_p: float32 may round either way


def filtered_row(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
                 min_p: float) -> tuple[np.ndarray, bool]:
    """(float64[V] the filtered distribution, whether a filter's boundary is within rounding)."""
    x = np.where(np.isnan(logits), -np.inf, logits.astype(np.float64))
    v = x.shape[0]
    if not temperature > 0 or not np.isfinite(x.max()):
        return np.eye(v)[int(np.argmax(x))], False
    z = (x - x.max()) / temperature
    probs = np.exp(z)
    if 0 < top_k < v:
        probs = np.where(z >= np.sort(z)[::-1][top_k - 1], probs, 0.0)
    probs /= probs.sum()
    ambiguous = False
    if top_p < 1:
        ordered = np.sort(probs)[::-1]
        exclusive = np.cumsum(ordered) - ordered
        kept = (exclusive < top_p) | (np.arange(v) == 0)
        ambiguous = bool(np.any(np.abs(exclusive[ordered > 0] - top_p) < BOUNDARY))
        probs = np.where(probs >= ordered[kept].min(), probs, 0.0)
        probs /= probs.sum()
    if min_p > 0:
        ratio = probs / probs.max()
        ambiguous |= bool(np.any(np.abs(ratio[ratio > 0] - min(min_p, 1.0)) < BOUNDARY))
        probs = np.where(ratio >= min(min_p, 1.0), probs, 0.0)
    return probs / probs.sum(), ambiguous


def filtered(logits: np.ndarray, temperature, top_k, top_p, min_p) -> tuple[np.ndarray, bool]:
    """``filtered_row`` of each row of float[R, V] with [R] parameters; ambiguous if any row is."""
    rows = [filtered_row(*args) for args in zip(logits, temperature, top_k, top_p, min_p)]
    return np.stack([r[0] for r in rows]), any(r[1] for r in rows)


def chi_square(counts: np.ndarray, expected_probs: np.ndarray) -> tuple[float, int]:
    """(chi-square statistic, degrees of freedom) of ``counts`` against ``expected_probs``; a count
    where the expected probability is 0 makes it infinite."""
    total = counts.sum()
    support = expected_probs > 0
    if np.any(counts[~support] > 0):
        return float("inf"), int(support.sum()) - 1
    expected = expected_probs[support] * total
    return float(np.sum((counts[support] - expected) ** 2 / expected)), int(support.sum()) - 1


def fits(counts: np.ndarray, expected_probs: np.ndarray, sigmas: float = 5.0, min_expected: float = 0.0) -> bool:
    """Whether ``counts`` are consistent with ``expected_probs`` (chi-square within ``sigmas``). The cells
    least expected (but not never) are pooled into one first, the fewest that together are expected
    ``min_expected`` times: one draw of a token expected 0.01 times is no evidence against the
    distribution, but alone in its cell it would add ~100 to the statistic."""
    order = np.argsort(np.where(expected_probs > 0, expected_probs, np.inf))
    cumulative = np.cumsum(expected_probs[order]) * counts.sum()
    rare = np.zeros(counts.shape, np.bool_)
    rare[order[:np.searchsorted(cumulative, min_expected) + 1]] = min_expected > 0
    rare &= expected_probs > 0
    if rare.sum() > 1:
        counts = np.append(counts[~rare], counts[rare].sum())
        expected_probs = np.append(expected_probs[~rare], expected_probs[rare].sum())
    stat, dof = chi_square(counts, expected_probs)
    return stat < dof + sigmas * np.sqrt(2 * max(dof, 1))
