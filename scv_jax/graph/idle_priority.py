"""Idle scheduling priority for background compiles (Linux): a thread under ``SCHED_IDLE`` gets a core
only when no other thread wants it, and yields it at once when one wakes up.

A compile is not only the thread that calls it: XLA:CPU spreads each compile over its own pool of helper
threads (``xla_compile_threads``), started at normal priority when the backend starts. With only the
calling thread lowered (nice 10), a served demo stream's decode steps took 26 ms instead of 19 ms while
compiles ran in the background on the 2-core CPU; with the helpers at idle priority too, 19 ms: what the
same padded step takes with no compile running (benchmarks/RESULTS.md, "Start-up").

``lower_xla_compile_threads`` / ``restore_xla_compile_threads`` are counted (nested compilers share one
lowering) and act only where the process may restore the threads' priority afterwards (root or
``RLIMIT_NICE``): a helper left at idle priority would starve later compiles whenever other work runs.
"""

from __future__ import annotations

import os
import threading

_lock = threading.Lock()
_holders = 0            # compilers holding the helpers lowered
_lowered = False        # whether the first holder lowered them (the process may restore them)


def _idle_policy() -> int | None:
    return getattr(os, "SCHED_IDLE", None)


def set_thread_idle() -> bool:
    """Puts the calling thread under ``SCHED_IDLE`` (permanently: unprivileged threads cannot come back);
    False where the platform has none."""
    idle = _idle_policy()
    if idle is None:
        return False
    try:
        os.sched_setscheduler(threading.get_native_id(), idle, os.sched_param(0))
    except OSError:
        return False
    return True


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


def _may_restore() -> bool:
    """Whether a thread lowered to ``SCHED_IDLE`` may be put back: probed on a throwaway thread."""
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


def lower_xla_compile_threads() -> None:
    """Puts ``xla_compile_threads`` under ``SCHED_IDLE`` (the first holder; a no-op where they could not
    be restored). Pair with ``restore_xla_compile_threads``."""
    global _holders, _lowered
    with _lock:
        _holders += 1
        if _holders > 1 or not _may_restore():
            return
        _lowered = True
        for tid in xla_compile_threads():
            try:
                os.sched_setscheduler(tid, _idle_policy(), os.sched_param(0))
            except OSError:     # ended meanwhile
                pass


def restore_xla_compile_threads() -> None:
    """The last holder puts ``xla_compile_threads`` back under the main thread's policy: those lowered and
    those a compile at idle priority started meanwhile (a thread inherits its creator's policy)."""
    global _holders, _lowered
    with _lock:
        _holders = max(0, _holders - 1)
        if _holders or not _lowered:
            return
        _lowered = False
        policy, param = os.sched_getscheduler(os.getpid()), os.sched_getparam(os.getpid())
        for tid in xla_compile_threads():
            try:
                os.sched_setscheduler(tid, policy, param)
            except OSError:     # ended meanwhile
                pass
