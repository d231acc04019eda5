"""``Compiler``: compiles graph-mode buckets ahead of time in a pool of threads, in the order given (XLA
releases the interpreter lock while it compiles, so compiles overlap; tracing and lowering do not).

A job is one bucket of an ``ExecutableCache`` (``CompileJob``, from ``ExecutableCache.jobs``). Submitted
jobs are *scheduled* in their cache: a call that needs a scheduled bucket moves it to the front and waits
for it (``hurry``) instead of compiling it on its own thread. ``run`` compiles a list and waits (a
warm-up); ``submit`` returns at once and compiles in the background until done or ``stop``.

    compiler = Compiler(max_workers=4)
    compiler.submit(first + rest)        # background threads, in this order
    compiler.wait(first)                 # the shapes the first requests need
    ...                                  # serve; steps needing a bucket of ``rest`` hurry it
    compiler.stop()                      # at shutdown: the compile in progress ends, the queue is dropped
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import os
import sys
import threading
import time
from typing import Any, Callable, Iterator, NamedTuple, Sequence

from scv_jax.graph import idle_priority


class CompileJob(NamedTuple):
    """One bucket to compile: ``cache`` (an ``ExecutableCache``), its ``key`` and the bound example
    arguments its abstract signature is made from."""

    cache: Any
    key: tuple
    example: dict


def largest_first(jobs: Sequence[CompileJob]) -> tuple[list[CompileJob], list[CompileJob]]:
    """(the fewest largest buckets that can run every call of these jobs, the others from the smallest
    up). A kind is one cache's static values and given arguments; its largest bucket is the one of the
    largest dim sizes, which a call of any smaller sizes of that kind can run padded to
    (``ExecutableCache.ready_plan``); a kind whose largest bucket another kind's can run
    (``ExecutableCache.can_run``: its statics' stand-ins) needs none of its own first. Along a cache's
    ``split_dims`` the smallest bucket is taken instead: its caller splits a larger call over it."""
    def size(job: CompileJob) -> tuple[int, ...]:
        split = {tuple(job.cache.dims).index(dim) for dim in job.cache.split_dims}
        return tuple(-s if i in split else s for i, s in enumerate(job.key[0]))

    largest: dict[tuple, CompileJob] = {}
    for job in jobs:
        kind = (id(job.cache), job.key[1], job.key[2])
        if kind not in largest or size(job) > size(largest[kind]):
            largest[kind] = job
    first = [job for job in largest.values()
             if not any(other is not job and other.cache is job.cache and other.cache.can_run(other.key, job.key)
                        for other in largest.values())]
    chosen = {id(job) for job in first}
    rest = sorted((job for job in jobs if id(job) not in chosen), key=lambda job: math.prod(job.key[0]))
    return first, rest


def default_workers() -> int:
    """Compile threads by default: on an accelerator the CPU cores this process may use (XLA compiles for a
    GPU mostly on one core each); on a CPU backend one (XLA:CPU spreads one compile over the cores already:
    two threads were no faster on the 2-core CPU, benchmarks/RESULTS.md, and one leaves a core to the
    thread that steps)."""
    import jax

    if jax.default_backend() == "cpu":
        return 1
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:      # not on Linux
        return max(1, os.cpu_count() or 1)


class Compiler:
    """A pool of ``max_workers`` threads (default: ``default_workers()``) compiling ``CompileJob``s in order.
    ``background`` (settable while it runs) puts the threads and XLA's compile helper threads at idle
    scheduling priority (``idle_priority``: Linux ``SCHED_IDLE``, where the process may restore it) so
    that a thread running steps meanwhile keeps the cores, as long as no caller waits for the compiler
    (``waited_on``: ``wait``, ``stop`` and a call waiting for its scheduled bucket): idle threads starve while
    other work keeps the cores busy. ``switch_interval`` (seconds;
    settable likewise) sets the interpreter's switch interval (``sys.setswitchinterval``, 5 ms by
    default) while the threads run and restores it when the last one ends: tracing and lowering hold
    the interpreter lock, and a thread running steps that waits for the lock at every device call gets
    it back within this interval (0.5 ms: stalls of a served stream 0.23 -> 0.04 s while the
    background compile loads from a warm cache; benchmarks/RESULTS.md, "Start-up").

    ``prime``: each executable compiled also runs once, on zeros, before calls may use it
    (``ExecutableCache.compile_job``): its first run costs more than later ones (on XLA:CPU 100-200 ms of
    a demo decode step), which a served stream would otherwise wait for at a new shape.

    ``on_compiled(job, compiles, seconds, done, total)`` is called on a worker thread after each job
    (progress lines, logs), before ``wait()`` counts the job done. Thread-safe."""

    def __init__(self, max_workers: int | None = None, *, name: str = "scv-jax-compile",
                 background: bool = False,
                 switch_interval: float | None = None, prime: bool = False,
                 on_compiled: Callable[[CompileJob, int, float, int, int], None] | None = None):
        self.max_workers = default_workers() if max_workers is None else max_workers
        if not isinstance(self.max_workers, int) or self.max_workers < 1:
            raise ValueError(f"Compiler: max_workers must be an int >= 1, got {max_workers!r}")
        self.name, self.switch_interval = name, switch_interval
        self.on_compiled, self.prime = on_compiled, prime
        self._saved_interval: float | None = None      # the switch interval before this compiler set it
        self._background = background
        self._may_idle = idle_priority.may_restore()
        self._idle = False                             # whether its threads and XLA's helpers are lowered now
        self._waiters = 0                              # callers waiting for its work (``waited_on``)
        self._native_ids: list[int] = []
        self._queue: list[CompileJob] = []
        self._futures: dict[tuple[int, tuple], concurrent.futures.Future] = {}
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self._running = 0
        self.done = self.total = self.compiles = 0
        self.error: BaseException | None = None      # the first job that raised (the others go on)

    # ------------------------------------------------------------------ priority
    @property
    def background(self) -> bool:
        return self._background

    @background.setter
    def background(self, value: bool) -> None:
        with self._cond:
            self._background = value
            self._apply_priority()

    @contextlib.contextmanager
    def waited_on(self) -> Iterator[None]:
        """While open, the threads and XLA's helpers run at normal priority: a caller waits for them (the
        helpers even while another background compiler keeps them lowered)."""
        with idle_priority.at_normal_priority():    # first: the helpers are never down while its threads are up
            with self._cond:
                self._waiters += 1
                self._apply_priority()
            idle_priority.lift_helpers()            # those its threads started while still idle
            try:
                yield
            finally:
                with self._cond:
                    self._waiters -= 1
                    self._apply_priority()

    def _apply_priority(self) -> None:
        """Lowers or restores the threads and XLA's helpers as the state asks (under the lock)."""
        idle = self._may_idle and self._background and not self._waiters and bool(self._threads)
        if idle != self._idle:
            self._idle = idle
            idle_priority.set_threads_idle(self._native_ids, idle)
            if idle:
                idle_priority.lower_xla_compile_threads()
            else:
                idle_priority.restore_xla_compile_threads()

    # ------------------------------------------------------------------ queue
    def submit(self, jobs: Sequence[CompileJob]) -> list[CompileJob]:
        """Queues the jobs whose buckets are neither compiled nor scheduled yet (in this order, after those
        queued before); returns them. Starts the threads."""
        queued = []
        with self._cond:
            if self._stopping:
                raise RuntimeError(f"{self.name}: submit after stop")
            for job in jobs:
                future = job.cache.schedule(job.key, self)
                if future is not None:
                    self._futures[(id(job.cache), job.key)] = future
                    queued.append(job)
            self._queue.extend(queued)
            self.total += len(queued)
            while len(self._threads) < min(self.max_workers, len(self._queue)):
                thread = threading.Thread(target=self._work, name=f"{self.name}-{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
            self._cond.notify_all()
        return queued

    def hurry(self, cache: Any, key: tuple) -> None:
        """Moves ``cache``'s bucket ``key`` to the front of the queue (a call is waiting for it)."""
        with self._cond:
            for i, job in enumerate(self._queue):
                if job.cache is cache and job.key == key:
                    self._queue.insert(0, self._queue.pop(i))
                    return

    @property
    def pending(self) -> int:
        """Jobs queued or compiling."""
        with self._cond:
            return len(self._queue) + self._running

    def wait(self, jobs: Sequence[CompileJob] | None = None, timeout: float | None = None) -> bool:
        """Waits until ``jobs`` (default: every job submitted) are compiled; False on timeout. Raises the
        first job's error, if one raised."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.waited_on():
            if jobs is None:
                with self._cond:
                    while (self._queue or self._running) and not self._stopping:
                        if not self._cond.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
                            return False
            else:
                futures = [self._futures.get((id(job.cache), job.key)) for job in jobs]
                _, not_done = concurrent.futures.wait([f for f in futures if f is not None], timeout)
                if not_done:
                    return False
        if self.error is not None:
            raise self.error
        return True

    def run(self, jobs: Sequence[CompileJob]) -> int:
        """Compiles ``jobs`` and waits for them, then ends the threads; returns the XLA compiles (a bucket
        loaded from the persistent cache counts: it is one backend compile call)."""
        try:
            self.submit(jobs)
            self.wait()
        finally:
            self.stop()
        return self.compiles

    def stop(self, timeout: float | None = None) -> bool:
        """Drops the queued jobs (their buckets are no longer scheduled: a later call compiles them where it
        runs) and waits up to ``timeout`` for the compiles in progress to end; True when every thread ended."""
        with self._cond:
            self._stopping = True
            dropped, self._queue = self._queue, []
            self._cond.notify_all()
        for job in dropped:
            job.cache.unschedule(job.key)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            threads = list(self._threads)
        with self.waited_on():
            for thread in threads:
                thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in threads)

    # ------------------------------------------------------------------ workers
    def _end_settings(self) -> None:
        """The last thread's exit (under the lock): the switch interval and the helpers' priority back."""
        if self._saved_interval is not None:
            sys.setswitchinterval(self._saved_interval)
            self._saved_interval = None
        self._apply_priority()

    def _work(self) -> None:
        with self._cond:
            self._native_ids.append(threading.get_native_id())
            if self._idle:
                idle_priority.set_threads_idle(self._native_ids[-1:], True)
            self._apply_priority()
        while True:
            with self._cond:
                if self._stopping or not self._queue:
                    self._threads.remove(threading.current_thread())
                    self._native_ids.remove(threading.get_native_id())
                    if not self._threads:
                        self._end_settings()
                    self._cond.notify_all()
                    return
                job = self._queue.pop(0)
                self._running += 1
                if self.switch_interval is not None and self._saved_interval is None:
                    self._saved_interval = sys.getswitchinterval()
                    sys.setswitchinterval(self.switch_interval)
            start = time.perf_counter()
            compiles = 0
            try:
                compiles = job.cache.compile_job(job.key, job.example, prime=self.prime)
            except BaseException as error:  # noqa: BLE001 - recorded; wait() and a waiting call raise it
                self.error = self.error or error
            seconds = time.perf_counter() - start
            with self._cond:
                self.done += 1
                self.compiles += compiles
                done, total = self.done, self.total
            try:        # before the job counts as done: a caller's wait() returns after its report
                if self.on_compiled is not None:
                    self.on_compiled(job, compiles, seconds, done, total)
            finally:
                with self._cond:
                    self._running -= 1
                    self._cond.notify_all()
