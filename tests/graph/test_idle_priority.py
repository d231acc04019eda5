"""Idle scheduling priority of background compiles (``graph.idle_priority``, ``Compiler(background=True)``):
the compile threads and XLA's compile helper threads run under ``SCHED_IDLE`` while a background compiler
has work and nobody waits for it, at normal priority while a caller waits (``wait``, a call waiting for
its bucket), and the helpers get the main thread's policy back when it ends (nested holders share one
lowering); the helpers found are XLA's own threads, never a Python thread or an execution pool's."""

from __future__ import annotations

import os
import threading
import time

import jax.numpy as jnp
import pytest

from scv_jax.graph import idle_priority
from scv_jax.graph.compiler import Compiler
from tests.graph.test_compiler import _example
from tests.graph.test_executable_cache import make_cache

pytestmark = pytest.mark.skipif(not idle_priority.may_restore(),
                                reason="needs Linux SCHED_IDLE and the right to restore a thread's policy")


def _policies(tids) -> set[int]:
    policies = set()
    for tid in tids:
        try:
            policies.add(os.sched_getscheduler(tid))
        except OSError:     # ended meanwhile
            pass
    return policies


def _helper_policies_after_exits() -> set[int]:
    """The helpers' policies once the compile threads that just ended are gone (a Python thread's OS
    thread outlives ``join`` for a moment and, unnamed, looks like a helper meanwhile)."""
    for _ in range(100):
        policies = _policies(idle_priority.xla_compile_threads())
        if policies == {os.SCHED_OTHER}:
            break
        time.sleep(0.02)
    return policies


def _seen_policies(seen: list):
    def on_compiled(*_):
        seen.append((os.sched_getscheduler(threading.get_native_id()),
                     _policies(idle_priority.xla_compile_threads())))
    return on_compiled


def test_xla_compile_threads_are_xla_helpers_never_python_or_execution_threads():
    jnp.ones(3).block_until_ready()         # the backend and its pools started
    found = idle_priority.xla_compile_threads()
    assert found, "XLA:CPU's compile pool was not found: its threads are no longer unnamed?"
    python = {thread.native_id for thread in threading.enumerate()}
    process_name = open("/proc/self/comm").read().strip()
    for tid in found:
        name = open(f"/proc/self/task/{tid}/comm").read().strip()
        assert tid not in python and (name == process_name or name.startswith("llvm-worker")), name
    named = [int(tid) for tid in os.listdir("/proc/self/task")
             if open(f"/proc/self/task/{tid}/comm").read().startswith("tf_XLA")]
    assert named and not set(named) & set(found)


def test_a_background_compiler_idles_while_nobody_waits_and_restores_the_helpers(no_persistent_cache):
    assert _helper_policies_after_exits() == {os.SCHED_OTHER}
    seen, done = [], threading.Event()
    on_compiled = _seen_policies(seen)
    compiler = Compiler(1, background=True, on_compiled=lambda *a: (on_compiled(*a), a[3] == 2 and done.set()))
    compiler.submit(make_cache().jobs(*_example(), k=2)[:2])
    assert done.wait(300) and compiler.stop(timeout=60)
    assert seen == [(os.SCHED_IDLE, {os.SCHED_IDLE})] * 2
    # those lowered and those an idle compile started meanwhile (they inherit its policy) are back
    assert _helper_policies_after_exits() == {os.SCHED_OTHER}


def _waited_policies(compiler: Compiler) -> tuple[set[int], set[int]]:
    """(the policies of ``compiler``'s threads (named after it: no other compiler may share its name), of XLA's
    helpers) while a caller waits for its jobs."""
    try:
        with compiler.waited_on():
            workers = [thread.native_id for thread in threading.enumerate() if thread.name.startswith(compiler.name)]
            policies = _policies(workers), _policies(idle_priority.xla_compile_threads())
            assert compiler.wait(timeout=300)
    finally:
        compiler.stop(timeout=60)
    return policies


def test_a_waited_for_or_foreground_compiler_runs_at_normal_priority(no_persistent_cache):
    compiler = Compiler(1, background=True, name="waited-for")
    compiler.submit(make_cache().jobs(*_example(), k=2)[:2])
    assert _waited_policies(compiler) == ({os.SCHED_OTHER}, {os.SCHED_OTHER})    # wait(), run(): a caller waits
    seen = []
    Compiler(1, on_compiled=_seen_policies(seen)).run(make_cache().jobs(*_example(), k=4)[:1])
    assert seen == [(os.SCHED_OTHER, {os.SCHED_OTHER})]                       # a foreground one never lowers


def test_nested_holders_share_one_lowering():
    jnp.ones(3).block_until_ready()
    helpers = idle_priority.xla_compile_threads()
    idle_priority.lower_xla_compile_threads()
    idle_priority.lower_xla_compile_threads()
    try:
        idle_priority.restore_xla_compile_threads()
        assert _policies(helpers) == {os.SCHED_IDLE}
    finally:
        idle_priority.restore_xla_compile_threads()
    assert _policies(helpers) == {os.SCHED_OTHER}


def test_a_compile_someone_waits_for_lifts_the_helpers_another_holder_keeps_lowered(no_persistent_cache):
    """The helpers are the process's: while another background compiler (here a bare hold) keeps them idle,
    a compile someone waits for (``waited_on``, a call's own compile: ``at_normal_priority``) has them at
    normal priority, and the hold's lowering is back afterwards."""
    jnp.ones(3).block_until_ready()
    helpers = idle_priority.xla_compile_threads()
    idle_priority.lower_xla_compile_threads()
    try:
        with idle_priority.at_normal_priority():
            assert _policies(helpers) == {os.SCHED_OTHER}
            with idle_priority.at_normal_priority():
                idle_priority.lower_xla_compile_threads()       # a compiler going idle meanwhile lowers nothing
                idle_priority.restore_xla_compile_threads()
                assert _policies(helpers) == {os.SCHED_OTHER}
            assert _policies(helpers) == {os.SCHED_OTHER}
        assert _policies(helpers) == {os.SCHED_IDLE}
        compiler = Compiler(1, background=True, name="waited-for")
        compiler.submit(make_cache().jobs(*_example(), k=2)[:2])
        assert _waited_policies(compiler) == ({os.SCHED_OTHER}, {os.SCHED_OTHER})
        assert _policies(helpers) == {os.SCHED_IDLE}
    finally:
        idle_priority.restore_xla_compile_threads()
    assert _helper_policies_after_exits() == {os.SCHED_OTHER}
