"""Concurrent and background compilation (``graph.compiler.Compiler``): the same executables as a serial
warm-up, a call never compiling a bucket that is scheduled in the background (it runs padded to a larger
compiled bucket, or hurries its own and waits), a clean stop, and the log of every compile outside a
warm-up (once per shape, with what was new)."""

from __future__ import annotations

import contextlib
import logging
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scv_jax import CompileCounter
from scv_jax.graph.compile_counter import BACKEND_COMPILE_EVENT, CACHE_LOAD_EVENT
from scv_jax.graph.compiler import Compiler, largest_first
from tests.graph.test_executable_cache import KV_SIZE, make_cache, random_batch


class CompileThreads:
    """The names of the threads that compiled (or loaded from the persistent cache) while open."""

    def __init__(self):
        self.names: list[str] = []

    def _listener(self, event: str, duration: float, **kwargs) -> None:
        if event in (BACKEND_COMPILE_EVENT, CACHE_LOAD_EVENT):
            self.names.append(threading.current_thread().name)

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listener)


def _example(seed=0):
    return (jnp.zeros(KV_SIZE, jnp.float32), *random_batch(np.random.default_rng(seed), 3, 2))


def _run_all(cache, calls):
    kv, outs = jnp.zeros(KV_SIZE, jnp.float32), []
    for ids, cu, weights, k in calls:
        kv, out = cache(kv, ids, cu, weights, k=k)
        outs.append(np.asarray(out)[:len(cu) - 1])
    return np.asarray(kv), outs


def _calls(seed=3, n=12):
    rng = np.random.default_rng(seed)
    calls = []
    for _ in range(n):
        k = int(rng.choice([1, 2, 4]))
        calls.append((*random_batch(rng, int(rng.integers(1, 5)), k), k))
    return calls


def test_threaded_warmup_compiles_the_same_executables_and_then_nothing(no_persistent_cache):
    serial, threaded = make_cache(), make_cache()
    assert serial.warmup(*_example(), k=2, max_workers=1, progress=False).compiled == 6
    with CompileThreads() as threads:
        report = threaded.warmup(*_example(), k=2, max_workers=2, progress=False)
    assert report.compiled == 6 and sorted(threaded.compiled_keys) == sorted(serial.compiled_keys)
    assert len(threads.names) == 6 and all(name.startswith("scv-jax-compile") for name in threads.names)
    calls = _calls()
    with CompileCounter() as compiles:
        kv_serial, out_serial = _run_all(serial, calls)
        kv_threaded, out_threaded = _run_all(threaded, calls)
    assert (compiles.count, compiles.loads) == (0, 0)
    np.testing.assert_array_equal(kv_serial, kv_threaded)
    for a, b in zip(out_serial, out_threaded):
        np.testing.assert_array_equal(a, b)


class Parked:
    """A compiler that has not got to its jobs: ``hurry`` compiles the bucket on its own thread."""

    def __init__(self, example):
        self.example, self.hurried = example, []

    def hurry(self, cache, key):
        self.hurried.append(key)
        thread = threading.Thread(target=cache.compile_job, args=(key, self.example), name="parked-compiler")
        thread.start()

    def waited_on(self):
        return contextlib.nullcontext()


def test_a_call_runs_padded_to_a_larger_compiled_bucket_while_its_own_is_scheduled():
    """Every bucket but the largest is scheduled and never compiled: each call borrows the largest one
    (batch 4), compiles nothing and gives what its own bucket gives."""
    exact, padded = make_cache(), make_cache()
    exact.warmup(*_example(), k=4, progress=False)
    jobs = padded.jobs(*_example(), k=4)
    largest = max(jobs, key=lambda job: job.key[0])
    Compiler(1).run([largest])
    parked = Parked(largest.example)
    for job in jobs:
        if job is not largest:
            assert padded.schedule(job.key, parked) is not None
    calls = [c for c in _calls() if c[3] > 2]           # k bucket 4: the largest's
    with CompileCounter() as compiles:
        kv_padded, out_padded = _run_all(padded, calls)
    smaller = sum(len(cu) - 1 <= 2 for _, cu, _, _ in calls)           # batch bucket below 4
    assert compiles.count == 0 and parked.hurried == [] and padded.stats.borrowed == smaller > 0
    kv_exact, out_exact = _run_all(exact, calls)
    np.testing.assert_array_equal(kv_exact, kv_padded)
    for a, b in zip(out_exact, out_padded):
        np.testing.assert_array_equal(a, b)


def test_a_call_without_a_larger_bucket_hurries_its_own_and_never_compiles_it(no_persistent_cache):
    cache = make_cache()
    jobs = cache.jobs(*_example(), k=2)
    smallest = min(jobs, key=lambda job: job.key[0])
    parked = Parked(smallest.example)
    for job in jobs:
        cache.schedule(job.key, parked)
    ids, cu, weights = random_batch(np.random.default_rng(5), 1, 2)
    with CompileThreads() as threads:
        _, out = cache(jnp.zeros(KV_SIZE, jnp.float32), ids, cu, weights, k=2)
    assert parked.hurried == [smallest.key] and threads.names == ["parked-compiler"]
    assert cache.stats.waits == 1 and cache.scheduled == len(jobs) - 1
    np.testing.assert_allclose(np.asarray(out)[:1], np.diff(cu) * weights, rtol=1e-6)


def test_stop_ends_the_threads_and_unschedules_what_was_queued(no_persistent_cache, caplog):
    cache = make_cache()
    compiler = Compiler(1)
    queued = compiler.submit(cache.jobs(*_example(), k=2))
    assert len(queued) == 6 and cache.scheduled == 6
    assert compiler.stop(timeout=60)
    assert compiler.pending == 0 and cache.scheduled == 0 and threading.active_count() >= 1
    assert not any(t.name.startswith("scv-jax-compile") for t in threading.enumerate())
    compiled = len(cache.compiled_keys)
    assert compiled < 6                                   # the queue was dropped
    # a dropped bucket compiles where it is called, logged
    missing = next(job for job in queued if job.key not in cache.compiled_keys)
    (batch, _), (k, _), _ = missing.key                   # its own k: a compiled bucket's k must not serve it
    ids, cu, weights = random_batch(np.random.default_rng(2), batch, k)
    with caplog.at_level(logging.WARNING):
        cache(jnp.zeros(KV_SIZE, jnp.float32), ids, cu, weights, k=k)
    assert any("on the calling thread" in r.getMessage() for r in caplog.records)


def test_every_compile_outside_a_warmup_is_logged_once_with_what_was_new(caplog):
    cache = make_cache()
    kv = jnp.zeros(KV_SIZE, jnp.float32)
    rng = np.random.default_rng(7)
    with caplog.at_level(logging.WARNING, logger="scv_jax.graph.executable_cache"):
        for _ in range(3):
            kv, _ = cache(kv, *random_batch(rng, 1, 2), k=2)       # one shape, three calls
        kv, _ = cache(kv, *random_batch(rng, 3, 2), k=2)           # a new batch bucket
        kv, _ = cache(kv, *random_batch(rng, 3, 4), k=4)           # a new k (and tokens)
        kv, _ = cache(kv, *random_batch(rng, 4, 2), k=2)           # compiled: no log
        kv, _ = cache(kv, *random_batch(rng, 1, 4), k=4)           # batch 1 and k 4 known, tokens 4 new
    messages = [r.getMessage() for r in caplog.records if "compiling bucket" in r.getMessage()]
    assert len(messages) == 4, messages
    assert "the first executable of toy_step, warmup() was never called" in messages[0]
    assert "new batch=4, tokens=8, warmup() was never called" in messages[1]
    assert "new tokens=16, k=4" in messages[2]
    assert messages[3].endswith("new tokens=4, warmup() was never called")


def _scaled(x, *, double: bool):
    """x, or [x, 2x] when ``double``: a step whose ``double=True`` executable computes more."""
    return (x, 2 * x) if double else (x,)


def test_a_stand_in_static_runs_a_call_while_its_own_bucket_is_scheduled(no_persistent_cache):
    """``stand_ins={"double": {False: True}}``: a double=False call borrows the compiled double=True
    bucket (at least as large, the same arguments), never the other way round, and gives its own outputs
    first; a stand-in for an argument that is not static is refused naming it."""
    from scv_jax.graph.buckets import Pad
    from scv_jax.graph.executable_cache import ExecutableCache

    cache = ExecutableCache(_scaled, dims={"n": (2, 4)}, pads={"x": Pad("n")}, static_argnames=("double",),
                            stand_ins={"double": {False: True}})
    jobs = {(job.key[0], job.key[1]): job for job in cache.jobs(jnp.zeros(2), double=False)
            + cache.jobs(jnp.zeros(2), double=True)}
    big_double = jobs[((4,), (True,))]
    assert cache.can_run(big_double.key, jobs[((2,), (False,))].key)
    assert cache.can_run(big_double.key, jobs[((4,), (False,))].key)
    assert not cache.can_run(jobs[((4,), (False,))].key, jobs[((2,), (True,))].key)    # not the other way
    assert not cache.can_run(jobs[((2,), (True,))].key, jobs[((4,), (False,))].key)    # smaller
    Compiler(1).run([big_double])
    parked = Parked(big_double.example)
    for key, job in jobs.items():
        if job is not big_double:
            cache.schedule(job.key, parked)
    x = np.arange(3, dtype=np.float32)
    with CompileCounter() as compiles:
        out = cache(x, double=False)
    assert compiles.count == 0 and parked.hurried == [] and cache.stats.borrowed == 1
    np.testing.assert_array_equal(np.asarray(out[0])[:3], np.asarray(x))
    try:
        ExecutableCache(_scaled, dims={"n": (2,)}, pads={"x": Pad("n")}, static_argnames=("double",),
                        stand_ins={"x": {0: 1}})
    except ValueError as error:
        assert "stand_ins names 'x'" in str(error)
    else:
        raise AssertionError("a stand-in for a dynamic argument was accepted")


def test_a_compiler_sets_the_switch_interval_while_it_runs_and_restores_it(no_persistent_cache):
    import sys

    before = sys.getswitchinterval()
    seen = []
    compiler = Compiler(1, switch_interval=before / 4, on_compiled=lambda *_: seen.append(sys.getswitchinterval()))
    compiler.run(make_cache().jobs(*_example(), k=2)[:2])
    assert seen == [before / 4] * 2 and sys.getswitchinterval() == before


def test_a_priming_compiler_runs_each_executable_once_before_a_call_uses_it(no_persistent_cache, caplog):
    """``Compiler(prime=True)``: each compiled executable runs once on zeros (its donated arguments
    fresh) and is marked run, so the first call is not its first run; a plain compiler runs nothing;
    arguments over ``PRIME_MAX_BYTES`` are not primed."""
    from scv_jax.graph import scheduling
    from scv_jax.graph.buckets import Pad
    from scv_jax.graph.executable_cache import ExecutableCache

    for prime, max_bytes, want_runs in ((True, scheduling.PRIME_MAX_BYTES, 2), (False, None, 0), (True, 4, 0)):
        runs = []

        def counted(x):
            """x + 1, counting its runs in ``runs`` (a host callback runs at every execution)."""
            jax.debug.callback(lambda: runs.append(1))
            return x + 1

        cache = ExecutableCache(counted, dims={"n": (2, 4)}, pads={"x": Pad("n")},
                                donate_argnames=("x",))
        original, scheduling.PRIME_MAX_BYTES = scheduling.PRIME_MAX_BYTES, max_bytes or 0
        try:
            with caplog.at_level(logging.INFO, logger="scv_jax.graph.executable_cache"):
                Compiler(1, prime=prime).run(cache.jobs(jnp.zeros(4, jnp.float32)) + cache.jobs(jnp.zeros(2, jnp.float32)))
        finally:
            scheduling.PRIME_MAX_BYTES = original
        jax.effects_barrier()
        assert len(runs) == want_runs, (prime, max_bytes, runs)
        out = cache(jnp.arange(3, dtype=jnp.float32))
        np.testing.assert_array_equal(np.asarray(out)[:3], [1, 2, 3])
        jax.effects_barrier()
        assert len(runs) == want_runs + 1
        assert cache.last_call_first_run == (want_runs == 0)
    assert "primed (n=2)" in caplog.text


def test_split_dims_first_compile_the_smallest_bucket_and_split_calls_while_others_compile(no_persistent_cache):
    """A cache with ``split_dims=("batch",)``: ``largest_first`` takes its smallest batch bucket (the
    largest along the other dims) first; ``split_size`` is the size itself when nothing is scheduled or
    its own bucket is compiled, else the largest compiled batch below it; a dim that is not split, or
    not bucketed, is refused."""
    cache = make_cache(split_dims=("batch",))
    jobs = cache.jobs(*_example(), k=4)
    first, rest = largest_first(jobs)
    assert first and {job.key[0][0] for job in first} == {1} and len(rest) == len(jobs) - len(first)
    assert [cache.split_size("batch", n) for n in (1, 3, 4)] == [1, 3, 4]       # nothing scheduled
    Compiler(1).run(first)
    parked = Parked(None)
    for job in rest:
        cache.schedule(job.key, parked)
    assert [cache.split_size("batch", n) for n in (1, 2, 3, 4)] == [1, 1, 1, 1]
    cache.compile_job(next(job.key for job in rest if job.key[0][0] == 2), rest[0].example)
    assert [cache.split_size("batch", n) for n in (1, 2, 3, 4)] == [1, 2, 2, 2]
    for bad, message in (("tokens", "not a split dim"), ("k", "not a split dim")):
        with pytest.raises(ValueError, match=message):
            cache.split_size(bad, 2)
    with pytest.raises(ValueError, match="split_dims names 'tokens', not one of the bucketed dims"):
        make_cache(split_dims=("tokens",))
