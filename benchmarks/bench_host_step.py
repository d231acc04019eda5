"""Host work per decoding step, with the device taken out: the decoder's loop on the demo models with its
decode executable replaced by a stub that returns a finished step at once (every draft accepted).

What remains is everything the host does per step: the controller, the n-gram proposals, block
allocation, the step's input buffers, planning, the call into the executable (argument flattening and
dispatch of the real executable are not included: the stub replaces them), the fetch of the step's
summary (a ready device array) and the bookkeeping after it. On a CPU backend the real step's device
work competes with the host for the same cores, so this isolates the host's own cost (on a GPU the two
overlap). The stub's own work (building the summary) is timed and subtracted. The last number of each
cell is the part of it before the step's dispatch and after its fetch: on a GPU the rest (the
adaptive controller's update and next k) runs while the device computes the step.

``--cold-caches-mb N [N ...]`` (a row each): after each stubbed step, N MB are streamed through the
caches (inside the stub, so not counted), as the real step's device work does on a CPU backend: it
evicts the host's working set, and the host's work then takes longer (the end-to-end benchmark's
host column on a CPU). A GPU step leaves the host's caches alone. The last column is the adaptive
controller's ``update`` + ``next_k`` per step in the loop (``bench_controller.py`` times them in a
loop of their own).

Run: ``JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_host_step.py [--batch-sizes 1 64] [--cold-caches-mb N ...]
[--append]``
"""

from __future__ import annotations

import argparse
import functools
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from harness import publish  # noqa: E402
from scv_jax import DecoderConfig, SpeculativeDecoder  # noqa: E402
from scv_jax.decoding import carry  # noqa: E402
from scv_jax.decoding.plan import StepRow  # noqa: E402
from scv_jax.decoding.runner import StepRunner  # noqa: E402
from scv_jax.decoding.scheduler import Scheduler  # noqa: E402
from scv_jax.demo.e2e import benchmark_prompts  # noqa: E402
from scv_jax.models import load_demo  # noqa: E402
from scv_jax.verify.summary import StepSummary  # noqa: E402

MODES = ("autoregressive", "k=4", "adaptive", "ngram k=4")


class InstantStep:
    """Stands in for the decode executable's ``call_planned``: every request accepts all its drafts and
    emits them plus one token; the caches (and the logit-control state) pass through, the carry (one step
    in flight) is moved on as the real step moves it; then streams ``cold_bytes`` through the CPU's
    caches (if > 0). Times its own work (wall and thread CPU)."""

    def __init__(self, executable, proposer, cold_bytes: int = 0):
        self._names = executable.dynamic_argnames
        self._evict = np.ones(cold_bytes // 8) if cold_bytes else None
        self._carried = jax.jit(carry.carried_inputs)
        self._carry_after = jax.jit(functools.partial(carry.carry_after_step, lag_rule=proposer.lag_after_step,
                                                      max_lag=proposer.max_lag), static_argnames="k")
        self.seconds = self.cpu_seconds = 0.0

    def __call__(self, plan, dynamic):
        start, cpu = time.perf_counter(), time.thread_time()
        args = dict(zip(self._names, dynamic))
        rows = args["rows"]
        if "carry" in args:         # the rows the step in flight moves on, as the real step moves them
            rows = np.asarray(self._carried(args["carry"], rows, args["sampling"], args["block_tables"])[0])
        drafts = rows[:, StepRow.NUM_DRAFTS]
        width = plan.statics["k"] + 1
        tokens = np.where(np.arange(width) <= drafts[:, None], 65, -1).astype(np.int32)
        packed = np.concatenate([tokens, drafts[:, None], (drafts + 1)[:, None], drafts[:, None]], axis=1)
        summary = StepSummary(jax.device_put(packed).block_until_ready())
        mask = np.ones(len(rows), bool) if args.get("request_mask") is None else args["request_mask"]
        carried = (self._carry_after(args["carry"], rows, packed, mask, k=plan.statics["k"]),) if "carry" in args else ()
        if self._evict is not None:
            self._evict.sum()
        self.seconds += time.perf_counter() - start
        self.cpu_seconds += time.thread_time() - cpu
        controls = (args["controls"],) if "controls" in args else ()      # the logit-control state passes through
        return (args["target_cache"], args["draft_cache"], summary, *controls, *carried)


class StepClock:
    """While entered, wraps the roles' methods that make a decode step's host side (the scheduler's
    ``schedule`` / ``while_device_runs`` / ``update``, the runner's ``dispatch`` / ``fetch``, with the
    device step it dispatches): the thread CPU seconds spent in them."""

    METHODS = ((Scheduler, "schedule"), (Scheduler, "while_device_runs"), (Scheduler, "update"),
               (StepRunner, "dispatch"), (StepRunner, "fetch"))

    def __init__(self):
        self.cpu_seconds = 0.0
        self._originals = [getattr(cls, name) for cls, name in self.METHODS]

    def __enter__(self) -> "StepClock":
        clock = self

        def timed(method):
            def wrapper(*args, **kwargs):
                cpu = time.thread_time()
                try:
                    return method(*args, **kwargs)
                finally:
                    clock.cpu_seconds += time.thread_time() - cpu
            return wrapper

        for (cls, name), method in zip(self.METHODS, self._originals):
            setattr(cls, name, timed(method))
        return self

    def __exit__(self, *exc) -> None:
        for (cls, name), method in zip(self.METHODS, self._originals):
            setattr(cls, name, method)


class ControllerClock:
    """Wraps the adaptive controllers' ``update`` and ``next_k`` (instance attributes): their wall seconds
    in the loop, where the step's other host work runs between the calls (unlike a benchmark loop of
    controller calls alone, ``bench_controller.py``)."""

    def __init__(self, controllers):
        self.seconds = 0.0
        for controller in controllers:
            for name in ("update", "next_k"):
                setattr(controller, name, self._timed(getattr(controller, name)))

    def _timed(self, method):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def host_microseconds(target, draft, mode: str, batch: int, max_new_tokens: int,
                      repeats: int, cold_bytes: int = 0) -> tuple[float, float, float, float]:
    """Median host microseconds per step of ``mode`` at ``batch`` over ``repeats`` generate calls: wall
    time, the thread's CPU time (what an idle host's wall time would be), the wall time before the
    step's dispatch and after its fetch (what a device step does not hide) and the adaptive
    controller's ``update`` + ``next_k`` (0 without one)."""
    config = DecoderConfig(batch_buckets=(batch,), adaptive=mode == "adaptive", num_blocks=64 * batch,
                           k=0 if mode in ("autoregressive", "adaptive") else 4)
    drafter = None if mode == "autoregressive" else ("ngram" if mode.startswith("ngram") else draft)
    decoder = SpeculativeDecoder(target, drafter, config=config)
    prompts = benchmark_prompts(batch)
    stub = InstantStep(decoder.runner.decode_executable, decoder.runner.proposer, cold_bytes)
    decoder.runner.decode_executable.call_planned = stub     # the device step, taken out
    controllers = ControllerClock(decoder.controllers.values())
    decoder.generate(prompts, max_new_tokens)           # compiles the prefill; warms the controller, the plans
    samples = []
    for _ in range(repeats):
        stub.seconds = stub.cpu_seconds = controllers.seconds = 0.0
        with StepClock() as clock:
            stats = decoder.generate(prompts, max_new_tokens).stats
        steps = sum(v[0] for v in stats.step_seconds.values())   # timed steps (the controller runs in all)
        seconds = sum(v[1] for v in stats.step_seconds.values())
        outside = sum(v[2] for v in stats.step_seconds.values())
        samples.append(((seconds - stub.seconds) / steps * 1e6, (clock.cpu_seconds - stub.cpu_seconds) / steps * 1e6,
                        outside / steps * 1e6, controllers.seconds / stats.steps * 1e6))
    return tuple(float(x) for x in np.median(samples, axis=0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cold-caches-mb", type=int, nargs="+", default=[0],
                        help="MB streamed through the caches after each step (a CPU device step's eviction); "
                             "a row per value")
    parser.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    target, draft = load_demo()
    rows = ["| batch | cold caches (MB) | " + " | ".join(MODES) + " | adaptive's controller |",
            "|---:|---:|" + "---:|" * (len(MODES) + 1)]
    for batch in args.batch_sizes:
        for cold_mb in args.cold_caches_mb:
            cells = {mode: host_microseconds(target, draft, mode, batch, args.max_new_tokens, args.repeats,
                                             cold_mb << 20) for mode in MODES}
            rows.append(f"| {batch} | {cold_mb} | " + " | ".join("{:.0f} ({:.0f}; {:.0f})".format(*cells[mode][:3])
                                                               for mode in MODES)
                        + f" | {cells['adaptive'][3]:.1f} |")
            print(rows[-1], flush=True)
    load = os.getloadavg()[0]
    publish(__file__, "Host work per decoding step (device step stubbed out)",
            f"Demo models; median of {args.repeats} generate calls of {args.max_new_tokens} tokens, every draft "
            f"accepted; µs per step: wall (the host thread's CPU time; the wall time before the step's dispatch and "
            f"after its fetch, which a device step does not hide); adaptive's controller: its update + next_k per "
            f"step in the loop (included in the adaptive column's wall time); cold caches: MB streamed through the "
            f"caches after each step, inside the stub (not counted); load average {load:.1f} during the run. ",
            "\n".join(rows), append=args.append)


if __name__ == "__main__":
    main()
