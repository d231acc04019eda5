"""Graph mode's compile scheduling: a cache's buckets compiled ahead of time by a ``Compiler`` (``warmup``, or
in the background), primed before calls use them, and, while some still compile, calls served by a larger
compiled bucket (``ready_plan``) or split over smaller ones (``split_size``) instead of waiting."""

from __future__ import annotations

import concurrent.futures
import logging
import math
import sys
import threading
import time
from typing import Any, Callable

import jax
import numpy as np

from scv_jax.graph.bucket_plan import BucketKey, BucketPlan
from scv_jax.graph.compile_errors import error_lines
from scv_jax.graph.compiled_buckets import CompiledBuckets, Entry
from scv_jax.graph.compiler import CompileJob, Compiler
from scv_jax.graph.stats import WarmupReport

logger = logging.getLogger("scv_jax.graph.executable_cache")   # the cache's one logger

PRIME_MAX_BYTES = 1 << 30      # a primed executable's zero arguments (caches included) are at most this


class ScheduledBuckets(CompiledBuckets):
    """``CompiledBuckets`` whose compiles a ``Compiler`` may run ahead of the calls that need them."""

    def __init__(self, fn: Callable, **options: Any):
        super().__init__(fn, **options)
        self._warmed_up = False               # a warm-up ran (a later compile is a shape it missed)
        # buckets a ``Compiler`` will compile: a call needing one hurries it and waits, never compiles it
        self._scheduled: dict[BucketKey, tuple[concurrent.futures.Future, Compiler]] = {}

    def pending(self, *example_args, keep: Callable[[dict[str, int]], bool] | None = None,
                **example_kwargs) -> list[BucketKey]:
        """The buckets ``warmup`` with these arguments would compile now (those not compiled yet), without
        compiling anything: what a warm-up costs, before paying it."""
        keys = self._warmup_keys(self._bind(example_args, example_kwargs), keep)
        return [k for k in keys if k not in self._entries]

    def warmup(self, *example_args, keep: Callable[[dict[str, int]], bool] | None = None,
               max_workers: int = 1, progress: bool = True, **example_kwargs) -> WarmupReport:
        """Compiles every bucket ahead of time from one example call's arguments.

        The example's padded axes may have any size (they are replaced per bucket); its other shapes,
        dtypes, shardings and its unbucketed static values are what every bucket is compiled for.
        ``keep`` prunes buckets that can never occur (default: the constructor's);
        ``max_workers > 1`` compiles in threads (XLA releases the GIL while compiling).
        """
        jobs = self.jobs(*example_args, keep=keep, **example_kwargs)
        start = time.perf_counter()
        seconds_before = self.stats.compile_seconds

        def on_compiled(job: CompileJob, compiles: int, seconds: float, done: int, total: int) -> None:
            if progress:
                sys.stderr.write(f"[{self.name}] warm-up {done}/{total} ({self.describe(job.key)})"   # one write
                                 f"{' [fallback]' if job.key in self.failed else ''} compile {seconds:.2f}s, "
                                 f"{time.perf_counter() - start:.1f}s\n")
                sys.stderr.flush()

        compiled = Compiler(max_workers, on_compiled=on_compiled).run(jobs)
        self._warmed_up = True         # also when every bucket was compiled already
        keys = self._warmup_keys(self._bind(example_args, example_kwargs), keep)
        report = WarmupReport(len(keys), compiled, sum(k in self.failed for k in keys),
                              time.perf_counter() - start, self.stats.compile_seconds - seconds_before)
        if progress:
            print(f"[{self.name}] warm-up done: {report.compiled} executables for {report.buckets} "
                  f"buckets in {report.wall_seconds:.2f}s ({report.failed} on the fallback)",
                  file=sys.stderr, flush=True)
        return report

    def jobs(self, *example_args, keep: Callable[[dict[str, int]], bool] | None = None,
             **example_kwargs) -> list[CompileJob]:
        """The buckets ``warmup`` with these arguments would compile (those not compiled yet), as jobs for a
        ``Compiler`` (several caches' jobs can share one pool)."""
        bound = self._bind(example_args, example_kwargs)
        return [CompileJob(self, key, bound) for key in self._warmup_keys(bound, keep) if key not in self._entries]

    def schedule(self, key: BucketKey, compiler: Compiler) -> concurrent.futures.Future | None:
        """Marks ``key`` as compiled by ``compiler`` (a call needing it then hurries it and waits); the
        future it completes, or None when the bucket is compiled or scheduled already."""
        with self._lock:
            if key in self._entries or key in self._scheduled:
                return None
            future = concurrent.futures.Future()
            self._scheduled[key] = (future, compiler)
            self._warmed_up = True
            return future

    def unschedule(self, key: BucketKey) -> None:
        """Drops ``key``'s schedule (its compiler stopped): a call needing it compiles it where it runs."""
        with self._lock:
            future, _ = self._scheduled.pop(key, (None, None))
        if future is not None:
            future.cancel()

    @property
    def scheduled(self) -> int:
        """Buckets a ``Compiler`` is still to compile."""
        return len(self._scheduled)

    def compile_job(self, key: BucketKey, example: dict[str, Any], *, prime: bool = False) -> int:
        """Compiles bucket ``key`` from bound example arguments (a ``CompileJob``'s), completes its
        schedule, and logs it when it was scheduled in the background (after a warm-up); returns the
        XLA compiles (0: compiled already). ``prime``: the executable also runs once on zero arguments
        (``_prime``) before a call can use it."""
        future, _ = self._scheduled.get(key, (None, None))
        if key in self._entries:
            return 0
        start = time.perf_counter()
        try:
            abstract = self._abstract_args(example, key)
            entry, compiles = self._compile_one(key, abstract)
            if prime:
                self._prime(key, entry, abstract)
        except BaseException as error:
            with self._lock:
                self._scheduled.pop(key, None)
            if future is not None:
                future.set_exception(error)
            raise
        with self._lock:
            self._entries[key] = entry
            self._scheduled.pop(key, None)
        if future is not None and not future.cancelled():
            future.set_result(entry)
        logger.info("[%s] compiled (%s) in %.2fs on %s", self.name, self.describe(key), time.perf_counter() - start,
                    threading.current_thread().name)
        return compiles

    def _prime(self, key: BucketKey, entry: Entry, abstract: dict[str, Any]) -> None:
        """Runs ``entry``'s executable once on zeros of its abstract arguments (at most
        ``PRIME_MAX_BYTES``; donated ones are fresh zeros, and the outputs are dropped), so that a call's
        first run costs what later ones do; marks it run. A failure is logged, never raised."""
        def zeros(leaf: Any) -> Any:      # on the leaf's sharding (None: the default device)
            if not isinstance(leaf, jax.ShapeDtypeStruct):
                return leaf
            return jax.device_put(np.zeros(leaf.shape, leaf.dtype), leaf.sharding)

        start, values = time.perf_counter(), self._dynamic_values(abstract)
        try:
            if sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(values)
                   if isinstance(leaf, jax.ShapeDtypeStruct)) > PRIME_MAX_BYTES:
                return
            jax.block_until_ready(entry.executable(*jax.tree.map(zeros, values)))
        except Exception as error:  # noqa: BLE001 - priming is an optimisation: the first call runs it instead
            logger.warning("%s: priming bucket (%s) failed, its first call runs it: %s", self.name,
                           self.describe(key), error_lines(error))
            return
        entry.ran = True
        logger.info("[%s] primed (%s) in %.2fs", self.name, self.describe(key), time.perf_counter() - start)

    def ready_plan(self, plan: BucketPlan) -> BucketPlan:
        """The plan to run now for ``plan``: itself when its executable exists or nothing is scheduled in the
        background; else the smallest compiled bucket that can run it (``can_run``: at least as large in
        every dim, the same statics or their stand-ins): the call runs padded to it instead of waiting;
        else ``plan`` (the call hurries its own bucket and waits for it)."""
        if plan.key is None or not self._scheduled or plan.key in self._entries:
            return plan
        runners = [k for k in list(self._entries) if self.can_run(k, plan.key)]
        if not runners:
            return plan
        key = min(runners, key=lambda k: (int(np.prod(k[0])), k[1] != plan.key[1], k[0]))
        self.stats.borrowed += 1
        return BucketPlan(key, plan.real, dict(zip(self.dims, key[0])), dict(zip(self.static_argnames, key[1])))

    def split_size(self, dim: str, size: int) -> int:
        """How much of ``size`` along split dim ``dim`` one call should take: ``size`` when no bucket is
        scheduled in the background or one of ``size``'s own bucket along ``dim`` is compiled; else the
        largest compiled bucket size below ``size`` (the caller splits its call over calls of that size
        instead of padding it to a larger bucket), else ``size``."""
        if dim not in self.split_dims:
            raise ValueError(f"{self.name}: {dim!r} is not a split dim (split_dims: {self.split_dims})")
        with self._lock:
            if not self._scheduled:
                return size
            index = tuple(self.dims).index(dim)
            compiled = {key[0][index] for key in self._entries}
        if self.bucket(dim, size) in compiled:
            return size
        return max((s for s in compiled if s < size), default=size)

    def _await_scheduled(self, key: BucketKey) -> Entry | None:
        """The executable of a bucket scheduled on a ``Compiler``: hurried to the front and waited for
        (logged); None when it is not scheduled (or its compiler stopped)."""
        with self._lock:
            future, compiler = self._scheduled.get(key, (None, None))
        if future is None:
            return self._entries.get(key)
        logger.warning("%s: waiting for bucket (%s), compiling in the background: no larger bucket is compiled "
                       "yet", self.name, self.describe(key))
        compiler.hurry(self, key)
        self.stats.waits += 1
        try:
            with compiler.waited_on():
                return future.result()
        except concurrent.futures.CancelledError:
            return self._entries.get(key)
