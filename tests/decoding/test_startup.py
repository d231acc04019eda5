"""Ready in seconds: ``Engine.start_warmup`` compiles the largest bucket of each kind of step, the rest in
the background; meanwhile steps run padded to a compiled bucket (the same tokens as their own bucket's)
and nothing compiles on the thread that steps; the persistent compilation cache holds across engines
whose settings do not change a step's shapes."""

from __future__ import annotations

import dataclasses
import logging
import threading

import jax
import numpy as np
import pytest

from scv_jax import DecoderConfig, Engine, SamplingParams
from scv_jax.graph.compile_counter import CompileCounter
from scv_jax.graph.compiler import Compiler, largest_first
from scv_jax.graph.persistent_cache import enable_persistent_cache
from tests.decoding.common import prompts
from tests.graph.test_compiler import CompileThreads, Parked

CONFIG = DecoderConfig(block_size=8, num_blocks=64, max_seq_len=64, prefill_chunk=16, batch_buckets=(2, 4),
                       context_buckets=(8,), k=2)
MAX_LEN = 40


@pytest.fixture(scope="module")
def models(target, partial_draft):
    return target, partial_draft


def _requests():
    """(prompt, params) of every kind: greedy, sampled, with logprobs; arriving one, then three at once."""
    kinds = [SamplingParams(max_tokens=12), SamplingParams(temperature=0.8, seed=5, max_tokens=12),
             SamplingParams(logprobs=2, max_tokens=12), SamplingParams(temperature=1.0, seed=9, logprobs=1, max_tokens=12)]
    return list(zip(prompts(11, 4), kinds))


def _serve(engine: Engine, count: int = 4) -> dict[str, tuple]:
    """The first ``count`` requests (the first alone, the others after two steps), stepped on this thread:
    each one's tokens and logprobs."""
    requests, outputs = _requests()[:count], {}
    engine.add_request(*requests[0], request_id="r0")
    steps = 0
    while engine.has_unfinished():
        if steps == 2:
            for i, request in enumerate(requests[1:], 1):
                engine.add_request(*request, request_id=f"r{i}")
        for out in engine.step():
            tokens, logprobs = outputs.get(out.request_id, ([], []))
            outputs[out.request_id] = (tokens + list(out.new_token_ids), logprobs + list(out.logprobs or ()))
        steps += 1
    return outputs


def _assert_same(outputs, reference):
    assert outputs.keys() == reference.keys()
    for rid, (tokens, logprobs) in reference.items():
        assert outputs[rid][0] == tokens, rid
        for got, want in zip(outputs[rid][1], logprobs):
            np.testing.assert_allclose(got.logprob, want.logprob, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def reference(models):
    """Each request's output on its own buckets (compiled as first needed)."""
    return _serve(Engine(*models, config=CONFIG))


@pytest.mark.slow
def test_steps_padded_to_the_largest_buckets_give_their_own_buckets_tokens(models, reference):
    """Only the prefill of the smallest batch bucket and the largest context, and the largest sampled
    decode steps with logprobs are compiled, every other bucket is scheduled and never gets compiled:
    every decode step runs padded up to a largest bucket (greedy and logprobs-free steps on a sampled one
    with logprobs), a prefill of more rows splits over calls of the smallest batch (three arrivals: 2 + 1
    rows, not 4 padded), nothing compiles, and every request's tokens (and log-probabilities) are those
    of the fully warmed engine's exact buckets."""
    engine = Engine(*models, config=CONFIG)
    prefill, decode = engine.runner.prefill_executable, engine.runner.decode_executable
    jobs = engine.runner.warmup_jobs(4, MAX_LEN, temperatures=(0.0, 1.0), logprobs=True)
    first, rest = largest_first(jobs)
    kinds = {(id(j.cache), j.key[1], j.key[2]) for j in jobs}
    batch = {j.cache: tuple(j.cache.dims).index("batch") for j in jobs}

    def one_row(key):       # a prefill call of any rows can run on a bucket of one row's batch bucket
        return (tuple(CONFIG.batch_buckets[0] if i == batch[prefill] else s for i, s in enumerate(key[0])),
                *key[1:])

    assert all(any(f.cache is j.cache and f.cache.can_run(f.key, one_row(j.key) if j.cache is prefill else j.key)
                   for f in first) for j in jobs)
    first_prefill = {j.key[0] for j in first if j.cache is prefill}       # prefill and the draft's catch-up
    assert first_prefill == {(2, max(CONFIG.block_buckets().sizes))}, first_prefill
    first_decode = [dict(zip(decode.static_argnames, j.key[1])) for j in first if j.cache is decode]
    assert first_decode and all(not s["greedy"] and s["logprobs"] for s in first_decode), first_decode
    assert len(first) < len(kinds) and rest
    Compiler(2).run(first)
    parked = Parked(None)
    for job in rest:
        assert job.cache.schedule(job.key, parked) is not None
    with CompileThreads() as threads:
        outputs = _serve(engine)
    assert threads.names == [] and parked.hurried == []
    borrowed = sum(s.borrowed for s in engine.runner.graph_stats.values())
    assert borrowed > 0 and engine.runner.graph_stats["decode"].borrowed > 0
    prefill_stats = engine.runner.graph_stats["prefill"]      # every call at batch 2 (3 rows as 2 + 1), none at 4
    calls = prefill_stats.hits + prefill_stats.misses
    assert prefill_stats.padded_totals["batch"] == 2 * calls < 2 * prefill_stats.real_totals["batch"]
    _assert_same(outputs, reference)


@pytest.mark.slow
def test_after_start_warmup_nothing_compiles_on_the_stepping_thread(models, reference):
    engine = Engine(*models, config=CONFIG)
    jobs = engine.warmup_jobs(4, MAX_LEN, logprobs=True)     # what start_warmup compiles (compiles nothing)
    with CompileThreads() as threads:
        compiler = engine.start_warmup(4, MAX_LEN, logprobs=True, workers=1)
        ready = len(threads.names)
        assert compiler.total == len(jobs)
        outputs = _serve(engine)
        assert compiler.wait(timeout=300)
    assert threading.current_thread().name not in threads.names[ready:], threads.names
    assert all(name.startswith("scv-jax-compile") for name in threads.names[ready:])
    assert compiler.stop(timeout=60) and compiler.pending == 0
    _assert_same(outputs, reference)
    with CompileCounter() as compiles:               # everything compiled: nothing borrowed any more
        borrowed = engine.runner.graph_stats["decode"].borrowed
        _assert_same(_serve(engine), outputs)
    assert compiles.count + compiles.loads == 0
    assert engine.runner.graph_stats["decode"].borrowed == borrowed
    assert engine.warmup_jobs(4, MAX_LEN, logprobs=True) == []


def test_stopping_the_background_compiler_leaves_a_working_engine(models, reference, caplog):
    """Shutdown while compiling: stop() returns once the compile in progress ends, no compile thread is
    left, and the buckets it dropped compile where they are first needed (logged), with the same tokens."""
    engine = Engine(*models, config=CONFIG)
    compiler = engine.start_warmup(4, MAX_LEN, logprobs=True, workers=1)
    assert compiler.stop(timeout=120)
    assert not any(t.name.startswith("scv-jax-compile") for t in threading.enumerate())
    assert engine.runner.decode_executable.scheduled == engine.runner.prefill_executable.scheduled == 0
    with caplog.at_level(logging.WARNING):
        _assert_same(_serve(engine, 1), {"r0": reference["r0"]})
    assert any("on the calling thread" in r.getMessage() for r in caplog.records)


@pytest.fixture
def own_cache_dir(tmp_path):
    """A fresh persistent compilation cache for the test (the run's restored after it)."""
    from jax.experimental.compilation_cache import compilation_cache
    before = {name: getattr(jax.config, name) for name in (
        "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes", "jax_enable_compilation_cache")}
    enable_persistent_cache(str(tmp_path / "cache"))
    yield tmp_path / "cache"
    for name, value in before.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()


def _warm(models, config, **engine_args) -> tuple[int, int]:
    """(XLA compiles, persistent-cache loads) of a new engine's warm-up, as in a new process."""
    jax.clear_caches()
    engine = Engine(*models, config=config, **engine_args)
    with CompileCounter() as compiles:
        engine.warmup(2, 16, temperatures=0.0)
    return compiles.compiled, compiles.loads


@pytest.mark.slow
def test_the_persistent_cache_holds_unless_a_shape_changes(models, own_cache_dir):
    config = dataclasses.replace(CONFIG, batch_buckets=(2,), k=2)
    compiled, loaded = _warm(models, config)
    assert compiled > 0 and loaded == 0
    # settings that change no step's shapes (the token budget, eos, the seed): every executable loaded
    assert _warm(models, dataclasses.replace(config, max_num_batched_tokens=48), eos_token_id=3, seed=7) == (0, compiled)
    assert _warm(models, dataclasses.replace(config, num_blocks=80))[0] > 0    # the KV pool's shape
