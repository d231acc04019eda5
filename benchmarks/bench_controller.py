"""Host cost of the adaptive controller per decoding step: ``next_k`` + ``update``, as the decoder calls
them (request ids, remaining tokens, its k, a measured step time), at batch 1 and 64:
with the same requests throughout (a static batch, which runs until its last request is done:
remaining tokens given), and under continuous batching, where each request runs ``--request-steps``
steps and a new one takes its place (staggered, so the batch changes every few steps; no remaining
tokens).

The per-step inputs (acceptance draws, step times) are drawn before timing; each step's two calls are
timed with ``time.perf_counter`` (the simulated step outcome between them is not counted), or with
``--clock cpu`` the thread's CPU time (``time.thread_time``: on a machine shared with other jobs, wall time
also counts the slices the scheduler gives them; each reading costs ~0.5-1 µs, in the figures). Prints
median / p90 / p99 / mean microseconds per step.

Run: ``.venv/bin/python benchmarks/bench_controller.py [--steps 3000] [--request-steps 100 25] [--clock cpu]
[--append]``
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Callable

import numpy as np

from harness import publish
from scv_jax import AdaptiveController, ControllerConfig

ALLOWED = (0, 2, 4, 6, 8)


def step_microseconds(batch: int, steps: int, *, request_steps: int = 0, seed: int = 0,
                      clock: Callable[[], float] = time.perf_counter) -> np.ndarray:
    """float64[steps] microseconds of next_k + update per step (first 10% of steps dropped as warm-up).
    ``request_steps`` > 0: each request runs that many steps, then a new id takes its row (the rows'
    ages staggered); 0: the same requests throughout."""
    rng = np.random.default_rng(seed)
    ctrl = AdaptiveController(ControllerConfig(allowed_k=ALLOWED))
    acceptance = rng.uniform(0.3, 0.95, batch)                  # each request's own acceptance
    leading = rng.geometric(1.0 - acceptance[None, :], size=(steps, batch)) - 1
    noise = rng.lognormal(0.0, 0.05, steps)
    ids = np.arange(batch, dtype=np.int64)
    # as the decoder gives them: tokens each request has left (a static batch), or None (requests wait)
    remaining = None if request_steps else np.full(batch, 1000, np.int64)
    started = -rng.integers(0, max(request_steps, 1), batch)   # staggered ages
    out = np.empty(steps)
    for i in range(steps):
        if request_steps:       # (not timed) new requests in the rows whose request ran its steps
            renewed = np.flatnonzero((i - started) % request_steps == 0)
            if renewed.size:
                ids[renewed] = ids.max() + 1 + np.arange(renewed.size)
                acceptance[renewed] = rng.uniform(0.3, 0.95, renewed.size)
            leading[i] = rng.geometric(1.0 - acceptance) - 1
        start = clock()
        k = ctrl.next_k(batch, ids, remaining)
        chosen = clock()
        drafts = np.full(batch, k, np.int64)          # the step's outcome (not the controller's cost)
        accepted = np.minimum(leading[i], drafts)
        seconds = (0.004 + 0.0005 * k) * noise[i]
        observed = clock()
        ctrl.update(drafts, accepted, seconds, batch, ids, k=k)
        out[i] = chosen - start + clock() - observed
    return out[steps // 10:] * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--request-steps", type=int, nargs="*", default=[100, 25],
                        help="rows with continuous batching: steps each request runs")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall: time.perf_counter; cpu: the thread's CPU time (time.thread_time)")
    parser.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    rows = ["| batch | steps per request | median µs | p90 µs | p99 µs | mean µs |", "|---:|---|---:|---:|---:|---:|"]
    for batch in (1, 64):
        for request_steps in [0, *args.request_steps]:
            us = step_microseconds(batch, args.steps, request_steps=request_steps,
                                   clock=time.thread_time if args.clock == "cpu" else time.perf_counter)
            rows.append(f"| {batch} | {request_steps or 'all (static)'} | "
                        f"{np.median(us):.1f} | {np.percentile(us, 90):.1f} | {np.percentile(us, 99):.1f} | "
                        f"{us.mean():.1f} |")
            print(rows[-1], flush=True)
    load = os.getloadavg()[0]
    publish(__file__, "Adaptive controller cost per step (next_k + update)",
            f"{args.steps} steps per row, allowed k {ALLOWED}, requests of acceptance 0.3-0.95, the decoder's "
            f"calls (request ids and remaining tokens, its k, a measured step time); steps per "
            f"request: a static batch's requests run throughout, else each runs that many steps and a new one "
            f"takes its row (continuous batching: the stream's objective, no remaining tokens); "
            f"µs per step ({'thread CPU time' if args.clock == 'cpu' else 'wall time'}); load average {load:.1f} "
            f"during the run. ", "\n".join(rows), append=args.append)


if __name__ == "__main__":
    main()
