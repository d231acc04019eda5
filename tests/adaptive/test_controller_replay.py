"""AdaptiveController replays recorded call sequences exactly: the same k at every step and the same
estimates (acceptance, step seconds, rates; to 1e-9 relative) as the controller that recorded them (first recorded at commit
ac1472f, before its per-step host cost was cut: fewer small numpy calls, the same arithmetic; re-recorded
when ``next_k`` started pairing each request's remaining tokens with its own id, not the sorted order's).

The sequences are seeded: static batches (ids in row order that is not id order, remaining tokens),
continuous batching (requests replaced and rows reordered), no ids, counterfactual k = 0 steps, untimed
steps, batch sizes across buckets, repeated ids, and several configs. ``controller_replay.json`` holds,
per case, the k chosen at each step and moments of every float the controller reported, in order
(``moments``: the count of NaNs, then the sum, sum of squares and position-weighted sum of the rest),
matched to 1e-9 relative. (Until 2026-12-04 it held a SHA-256 of the floats' bits; numpy's
SIMD-dispatched ``log`` / ``exp`` differ in the last bit between CPUs, so a new CI machine failed every
case with the same k.)

Re-record (only from a controller whose decisions are known good):
``python tests/adaptive/test_controller_replay.py --record``
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from scv_jax import AdaptiveController

RECORDING = os.path.join(os.path.dirname(os.path.abspath(__file__)), "controller_replay.json")

# case -> (controller overrides, batch, churn: requests replaced per step on average, steps)
CASES: dict[str, tuple[dict, int, float, int]] = {
    "static b64 k-set": (dict(allowed_k=(0, 2, 4, 6, 8)), 64, 0.0, 400),
    "static b1": ({}, 1, 0.0, 300),
    "static b16 margin 0, decide every step": (dict(switch_margin=0.0, decide_every=1), 16, 0.0, 300),
    "stream b64 churn 2.5": (dict(allowed_k=(0, 2, 4, 6, 8)), 64, 2.5, 400),
    "stream b8 churn 0.3, no probes": (dict(probe_every=0), 8, 0.3, 300),
    "stream b32 k_max 4, no decay": (dict(k_max=4, acceptance_decay=1.0, prior_strength=0.5), 32, 1.0, 300),
    "varying batch": ({}, 0, 1.0, 400),          # batch 0: a batch size drawn each step (1..64)
    "no ids": (dict(cost_rate=1.0), -1, 0.0, 300),  # batch -1: batch 12 without request ids
    "repeated ids": ({}, -2, 0.0, 200),           # batch -2: batch 6 with ids [3, 3, 5, 9, 9, 9]
    "fixed mode": (dict(mode="fixed", k_init=3), 16, 1.0, 100),
}


def moments(values: np.ndarray) -> list[float]:
    """[count of non-finite values (NaN: no estimate yet), then the sum, sum of squares and sum weighted
    by position / count of the others (in place, non-finite ones as 0)] of float64 ``values``: equal to
    1e-9 relative for the same arithmetic (up to last-bit differences of transcendental functions)."""
    finite = np.isfinite(values)
    values = np.where(finite, values, 0.0)
    position = np.arange(1, values.size + 1) / values.size
    return [float((~finite).sum()), float(values.sum()), float((values * values).sum()),
            float((values * position).sum())]


def replay(overrides: dict, batch: int, churn: float, steps: int, seed: int = 0) -> tuple[str, list[float]]:
    """Runs one case: (the k of each step as a string of digits, ``moments`` of the floats reported)."""
    rng = np.random.default_rng(seed)
    ctrl = AdaptiveController(**overrides)
    k_max = ctrl.config.k_max
    reported = []
    size = {0: 64, -1: 12, -2: 6}.get(batch, batch)
    ids = rng.permutation(np.arange(1000, 1000 + size)).astype(np.int64)   # row order is not id order
    if batch == -2:
        ids = np.array([3, 3, 5, 9, 9, 9], np.int64)
    acceptance = rng.uniform(0.2, 0.95, size)
    remaining = rng.integers(1, 300, size)
    next_id = 2000
    chosen = []
    for step in range(steps):
        rows = int(rng.integers(1, 65)) if batch == 0 else size
        if churn and batch != -2:                  # requests end; new ones take their rows
            ended = np.flatnonzero(rng.random(size) < churn / size)
            ids[ended] = next_id + np.arange(ended.size)
            next_id += ended.size
            acceptance[ended] = rng.uniform(0.2, 0.95, ended.size)
            remaining[ended] = rng.integers(1, 300, ended.size)
            if rng.random() < 0.1:                 # rows compacted: the same requests, reordered
                order = rng.permutation(size)
                ids, acceptance, remaining = ids[order], acceptance[order], remaining[order]
        active = slice(0, min(rows, size))
        step_ids = None if batch == -1 else ids[active]
        step_remaining = None if batch == -1 and step % 2 else remaining[active]
        k = ctrl.next_k(max(rows, size) if batch else rows, step_ids, step_remaining)
        chosen.append(k)
        n = step_remaining.size if step_remaining is not None else size
        if k == 0 and step % 3 == 0:               # counterfactual drafts at a k = 0 step
            drafts = rng.integers(0, k_max + 1, n)
        else:
            drafts = np.minimum(np.full(n, k), np.maximum(remaining[:n] - 1, 0))
        leading = rng.geometric(1.0 - acceptance[:n]) - 1
        accepted = np.minimum(leading, drafts)
        seconds = None if rng.random() < 0.05 else float((0.004 + 0.0006 * k) * rng.lognormal(0.0, 0.2))
        ctrl.update(drafts, accepted, seconds, max(rows, n), step_ids, k=k)
        remaining[:n] = np.maximum(remaining[:n] - accepted - 1, 1)
        for value in (ctrl.acceptance(), ctrl.step_seconds(max(rows, n)),
                      ctrl.rates(max(rows, n), None if step_ids is None else np.sort(step_ids), step_remaining)):
            reported.append(np.ravel(np.asarray(value, np.float64)))
    return "".join(str(k) for k in chosen), moments(np.concatenate(reported))


def _recorded() -> dict:
    with open(RECORDING) as f:
        return json.load(f)


@pytest.mark.parametrize("case", list(CASES))
def test_replay_matches_the_recording(case):
    expected = _recorded()[case]
    ks, got = replay(*CASES[case])
    first = next((i for i, (a, b) in enumerate(zip(ks, expected["k"])) if a != b), None)
    assert ks == expected["k"], f"{case}: k differs first at step {first}"
    np.testing.assert_allclose(got, expected["moments"], rtol=1e-9, atol=0,
                               err_msg=f"{case}: the same k, but the estimates differ")


def test_the_recording_covers_several_k():
    ks = "".join(entry["k"] for entry in _recorded().values())
    assert len(set(ks)) >= 4


if __name__ == "__main__" and "--record" in sys.argv:
    recording = {}
    for name, case in CASES.items():
        ks, reported = replay(*case)
        recording[name] = {"k": ks, "moments": reported}
        print(f"{name}: {len(ks)} steps, k used {sorted(set(ks))}")
    with open(RECORDING, "w") as f:
        json.dump(recording, f, indent=1)
        f.write("\n")
