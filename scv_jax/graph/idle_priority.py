"""Idle scheduling priority for background compiles (Linux): a thread under ``SCHED_IDLE`` gets a core
only when no other thread wants it, and yields it at once when one wakes up.

A compile is not only the thread that calls it: XLA:CPU spreads each compile over its own pool of helper
threads (``xla_compile_threads``), started at normal priority when the backend starts. With only the
calling thread lowered (nice 10), a served demo stream's decode steps took 20.9 ms at p50 while compiles
ran in the background on the 2-core CPU; with the helpers at idle priority too, 14.1 ms, against 13.3 ms
for the same padded steps with no compile running (one process: benchmarks/RESULTS.md, "Steps during
background compiles").

Idle threads starve while other work keeps the cores busy, so a ``Compiler`` lowers them only while no
caller waits for it, and puts them back when one does: hence everything here is done only where the
process may restore a thread's policy (``may_restore``: root or ``RLIMIT_NICE``).
``lower_xla_compile_threads`` / ``restore_xla_compile_threads`` are counted: compilers lowering at the
same time share one lowering.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterable, Iterator

_lock = threading.Lock()
_holders = 0            # compilers holding the helpers lowered
_urgent = 0             # compiles someone waits for (``at_normal_priority``): the helpers stay up meanwhile


def _idle_policy() -> int | None:
    return getattr(os, "SCHED_IDLE", None)


def may_restore() -> bool:
    """Whether a thread lowered to ``SCHED_IDLE`` may be put back (probed on a throwaway thread)."""
    idle, result = _idle_policy(), []
    if idle is None:
        return False

    def probe() -> None:
        tid = threading.get_native_id()
        try:
            before = os.sched_getscheduler(tid), os.sched_getparam(tid)
            os.sched_setscheduler(tid, idle, os.sched_param(0))
            os.sched_setscheduler(tid, *before)
            result.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=probe, name="scv-jax-priority-probe")
    thread.start()
    thread.join()
    return bool(result)


def set_threads_idle(tids: Iterable[int], idle: bool) -> None:
    """Puts threads ``tids`` under ``SCHED_IDLE`` (``idle``) or under the main thread's policy; threads
    that ended meanwhile are skipped. Call only where ``may_restore()``."""
    policy, param = ((_idle_policy(), os.sched_param(0)) if idle
                     else (os.sched_getscheduler(os.getpid()), os.sched_getparam(os.getpid())))
    for tid in tids:
        try:
            os.sched_setscheduler(tid, policy, param)
        except OSError:     # ended meanwhile
            pass


def xla_compile_threads() -> list[int]:
    """Native ids of this process's threads that help XLA compile: LLVM's ``llvm-worker-*`` and the
    threads XLA leaves unnamed (they carry the process's name), its compile pool among them; XLA names its
    execution pools (``tf_XLAEigen``, ``tf_XLAExecute``) and Python threads are never included. Empty
    where ``/proc`` is missing."""
    try:
        process_name = open("/proc/self/comm").read().strip()
        tids = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return []
    python = {thread.native_id for thread in threading.enumerate()}
    found = []
    for tid in tids:
        try:
            name = open(f"/proc/self/task/{tid}/comm").read().strip()
        except OSError:     # ended meanwhile
            continue
        if tid not in python and (name == process_name or name.startswith("llvm-worker")):
            found.append(tid)
    return found


def lower_xla_compile_threads() -> None:
    """Puts ``xla_compile_threads`` under ``SCHED_IDLE`` (the first holder). Pair with
    ``restore_xla_compile_threads``; call only where ``may_restore()``."""
    global _holders
    with _lock:
        _holders += 1
        if _holders == 1 and not _urgent:
            set_threads_idle(xla_compile_threads(), True)


def restore_xla_compile_threads() -> None:
    """The last holder puts ``xla_compile_threads`` back under the main thread's policy: those lowered and
    those a compile at idle priority started meanwhile (a thread inherits its creator's policy)."""
    global _holders
    with _lock:
        _holders = max(0, _holders - 1)
        if not _holders:
            set_threads_idle(xla_compile_threads(), False)


@contextlib.contextmanager
def at_normal_priority() -> Iterator[None]:
    """While open, ``xla_compile_threads`` run under the main thread's policy, however many holders keep them
    lowered (the helpers are the process's: a compile someone waits for must not share them at idle
    priority with another compiler's background work); the holders' lowering is back when the last one
    closes. Touches no thread while nothing holds them lowered."""
    global _urgent
    with _lock:
        _urgent += 1
        if _urgent == 1 and _holders:
            set_threads_idle(xla_compile_threads(), False)
    try:
        yield
    finally:
        with _lock:
            _urgent -= 1
            if not _urgent and _holders:
                set_threads_idle(xla_compile_threads(), True)


def lift_helpers() -> None:
    """While ``at_normal_priority`` is open, puts ``xla_compile_threads`` under the main thread's policy
    again: those a thread still at idle priority started since (they inherit its policy)."""
    with _lock:
        if _urgent:
            set_threads_idle(xla_compile_threads(), False)
