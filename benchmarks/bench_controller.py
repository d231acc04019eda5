"""Host cost of the adaptive controller per decoding step: ``next_k`` + ``update``, as the decoder calls
them (per-request estimates, remaining tokens, the step's dense k, a measured step time), at batch 1
and 64.

The per-step inputs (acceptance draws, step times) are drawn before timing; each step's two calls are
timed with ``time.perf_counter`` (the simulated step outcome between them is not counted). Prints
median / p90 / p99 / mean microseconds per step.

Run: ``.venv/bin/python benchmarks/bench_controller.py [--steps 3000] [--append]``
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from harness import publish
from scv_jax import AdaptiveController, ControllerConfig

ALLOWED = (0, 2, 4, 6, 8)


def step_microseconds(batch: int, steps: int, *, per_request: bool, seed: int = 0) -> np.ndarray:
    """float64[steps] microseconds of next_k + update per step (first 10% of steps dropped as warm-up)."""
    rng = np.random.default_rng(seed)
    ctrl = AdaptiveController(ControllerConfig(allowed_k=ALLOWED, per_request=per_request))
    acceptance = rng.uniform(0.3, 0.95, batch)                  # each request's own acceptance
    leading = rng.geometric(1.0 - acceptance[None, :], size=(steps, batch)) - 1
    noise = rng.lognormal(0.0, 0.05, steps)
    ids = np.arange(batch, dtype=np.int64)
    remaining = np.full(batch, 1000, np.int64)         # as the decoder gives: tokens each request has left
    out = np.empty(steps)
    for i in range(steps):
        start = time.perf_counter()
        k = ctrl.next_k(batch, ids, remaining)
        chosen = time.perf_counter()
        drafts = np.full(batch, k, np.int64)          # the step's outcome (not the controller's cost)
        accepted = np.minimum(leading[i], drafts)
        seconds = (0.004 + 0.0005 * k) * noise[i]
        observed = time.perf_counter()
        ctrl.update(drafts, accepted, seconds, batch, ids, step_k=k)
        out[i] = chosen - start + time.perf_counter() - observed
    return out[steps // 10:] * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    rows = ["| batch | per-request | median µs | p90 µs | p99 µs | mean µs |", "|---:|---|---:|---:|---:|---:|"]
    for batch in (1, 64):
        for per_request in (False, True):
            us = step_microseconds(batch, args.steps, per_request=per_request)
            rows.append(f"| {batch} | {'yes' if per_request else 'no'} | {np.median(us):.1f} | "
                        f"{np.percentile(us, 90):.1f} | {np.percentile(us, 99):.1f} | {us.mean():.1f} |")
            print(rows[-1], flush=True)
    load = os.getloadavg()[0]
    publish(__file__, "Adaptive controller cost per step (next_k + update)",
            f"{args.steps} steps per row, allowed k {ALLOWED}, requests of acceptance 0.3-0.95, the decoder's "
            f"calls (per-request ids and remaining tokens, the step's dense k, a measured step time); "
            f"µs per step; load average {load:.1f} during the run. ", "\n".join(rows), append=args.append)


if __name__ == "__main__":
    main()
