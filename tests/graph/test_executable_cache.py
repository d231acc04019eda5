"""Graph mode (ExecutableCache): buckets, warm-up without recompiles, host-side keys, fallback,
donation check and the persistent compilation cache (in subprocesses)."""

import functools
import json
import logging
import os
import re
import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
from jax.experimental import io_callback
from jax.experimental import pallas as pl
import numpy as np
import pytest

import scv_jax
from scv_jax import Buckets, CompileCounter, ExecutableCache, Pad
from scv_jax.graph.buckets import pad_leaf
from scv_jax.graph.executable_cache import DonatedRunError
from scv_jax.ops.registry import cuda_available

KV_SIZE = 64


def toy_step(kv, ids, cu, weights, *, k, backend="auto"):
    """A decode-step-shaped function: a donated cache, ragged slots, per-request outputs.

    kv: f32[S]; ids: int32[T] slots to bump (negative = padding); cu: int32[B + 1]; weights: f32[B].
    """
    kv = kv.at[jnp.where(ids < 0, KV_SIZE, ids)].add(1.0, mode="drop")
    counts = jnp.minimum(cu[1:] - cu[:-1], k)
    return kv, counts.astype(jnp.float32) * weights


def picky_step(kv, ids, cu, weights, *, k, backend="auto"):
    """``toy_step`` whose fast path cannot be built for 4 requests (like a kernel without support)."""
    if backend != "xla" and cu.shape[0] - 1 == 4:
        raise NotImplementedError("no kernel for 4 requests")
    return toy_step(kv, ids, cu, weights, k=k)


def masked_step(kv, ids, cu, weights, mask=None, *, k, backend="auto"):
    """``toy_step`` whose per-request outputs are zeroed outside ``mask`` (bool[B])."""
    kv, out = toy_step(kv, ids, cu, weights, k=k)
    return kv, jnp.where(mask, out, 0.0)


TOY_PADS = {"ids": Pad("tokens", fill=-1), "cu": Pad("batch", fill="edge", extra=1),
            "weights": Pad("batch", fill=0.0)}


def make_cache(step=toy_step, **overrides):
    options = dict(dims={"batch": [1, 2, 4], "tokens": lambda b: b["batch"] * b["k"]}, pads=TOY_PADS,
                   bucketed_statics={"k": [2, 4]}, static_argnames=("backend",),
                   donate_argnames=("kv",), fallback=functools.partial(step, backend="xla"))
    options.update(overrides)
    return ExecutableCache(step, **options)


def random_batch(rng, num_requests, max_drafts):
    counts = rng.integers(0, max_drafts + 1, num_requests)
    cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    ids = rng.integers(0, KV_SIZE, cu[-1]).astype(np.int32)
    return ids, cu, rng.random(num_requests).astype(np.float32)


def test_pow2_then_linear_buckets():
    assert Buckets.pow2_then_linear(256).sizes == (1, 2, 4, 8, 16, 32, 64, 128, 192, 256)
    assert Buckets.pow2_then_linear(8).sizes == (1, 2, 4, 8)
    assert Buckets.pow2_then_linear(100, linear_step=24, min_size=2).sizes == (2, 4, 8, 16, 24, 48, 72,
                                                                                 96, 100)
    b = Buckets((1, 4, 16))
    assert [b.bucket(n) for n in (0, 1, 2, 4, 5, 16, 17)] == [1, 1, 4, 4, 16, 16, None]
    with pytest.raises(ValueError, match="ascending"):
        Buckets((4, 2))


def test_warmup_then_no_recompiles_and_padding_is_invisible():
    cache = make_cache(chex.assert_max_traces(toy_step, n=6))   # one trace per bucket, at warm-up
    kv = jnp.zeros(KV_SIZE, jnp.float32)
    rng = np.random.default_rng(0)
    report = cache.warmup(kv, *random_batch(rng, 3, 2), k=2, max_workers=2, progress=False)
    assert report.buckets == report.compiled == 6 and report.failed == 0
    expected_kv = np.zeros(KV_SIZE, np.float32)
    real_batches = padded_batches = 0
    with CompileCounter() as compiles:
        for step in range(40):
            k = int(rng.choice([1, 2, 3, 4]))
            ids, cu, weights = random_batch(rng, int(rng.integers(0, 5)), k)
            kv, out = cache(kv, ids, cu, weights, k=k)
            real_batches += len(cu) - 1
            padded_batches += cache.bucket("batch", len(cu) - 1)
            np.add.at(expected_kv, ids, 1.0)
            counts = np.diff(cu)
            np.testing.assert_allclose(np.asarray(out)[:len(counts)], counts * weights, rtol=1e-6)
            assert not np.any(np.asarray(out)[len(counts):])
    assert (compiles.traces, compiles.count, compiles.loads) == (0, 0, 0)
    np.testing.assert_array_equal(np.asarray(kv), expected_kv)
    assert cache.stats.hits == 40 and cache.stats.misses == 0 and cache.stats.compiles == 6
    assert cache.stats.padding_ratio("batch") == padded_batches / real_batches
    assert cache.stats.unaliased_donations == 0 and not cache.last_call_compiled


def test_miss_compiles_lazily_once():
    cache = make_cache()
    kv = jnp.zeros(KV_SIZE, jnp.float32)
    rng = np.random.default_rng(1)
    compiled, first_runs = [], []
    for _ in range(3):
        kv, _ = cache(kv, *random_batch(rng, 3, 4), k=4)
        compiled.append(cache.last_call_compiled)
        first_runs.append(cache.last_call_first_run)
    assert (cache.stats.misses, cache.stats.hits, cache.stats.compiles) == (1, 2, 1)
    assert compiled == [True, False, False] and first_runs == [True, False, False]


def test_the_first_run_of_a_warmed_executable_is_flagged():
    """An executable compiled ahead of time has not run: its first call is flagged (one-off costs, not
    the shape's time), without a compile; later calls and other shapes' first calls as they come."""
    cache = make_cache()
    kv = jnp.zeros(KV_SIZE, jnp.float32)
    rng = np.random.default_rng(2)
    cache.warmup(kv, *random_batch(rng, 3, 2), k=2, progress=False)
    flags = []
    for batch in (3, 3, 1, 3, 1):
        kv, _ = cache(kv, *random_batch(rng, batch, 2), k=2)
        flags.append((cache.last_call_compiled, cache.last_call_first_run))
    assert flags == [(False, True), (False, False), (False, True), (False, False), (False, False)]


def test_key_computation_makes_no_transfers():
    cache = make_cache()
    kv = jnp.zeros(KV_SIZE, jnp.float32)
    ids, cu, weights = (jnp.asarray(x) for x in random_batch(np.random.default_rng(2), 3, 2))
    with jax.transfer_guard("disallow"):
        plan = cache.plan(kv, ids, cu, weights, k=2)
    assert plan.real == {"batch": 3, "tokens": int(ids.shape[0])}
    assert plan.padded == {"batch": 4, "tokens": 8} and plan.statics == {"k": 2, "backend": "auto"}
    host = random_batch(np.random.default_rng(3), 3, 2)
    cache.warmup(kv, *host, k=2, progress=False)
    with jax.transfer_guard_device_to_host("disallow"):   # the whole hit path: no device->host sync
        kv, out = cache(kv, *host, k=2)
    assert cache.stats.hits == 1


def test_device_arrays_are_padded_on_device():
    cache = make_cache()
    kv = jnp.zeros(KV_SIZE, jnp.float32)
    ids, cu, weights = random_batch(np.random.default_rng(4), 3, 2)
    _, out = cache(kv, jnp.asarray(ids), jnp.asarray(cu), jnp.asarray(weights), k=2)
    assert cache.stats.device_pads == 3 and out.shape == (4,)


def test_failed_compile_serves_the_fallback_and_logs_once(caplog):
    cache = make_cache(picky_step)
    kv = jnp.zeros(KV_SIZE, jnp.float32)
    rng = np.random.default_rng(5)
    with caplog.at_level(logging.WARNING, logger="scv_jax.graph.executable_cache"):
        report = cache.warmup(kv, *random_batch(rng, 1, 2), k=2, progress=False)
        assert report.failed == 2 and report.compiled == 6   # batch=4 buckets (k=2, 4) fall back
        for num_requests in (3, 4, 2, 3):
            ids, cu, weights = random_batch(rng, num_requests, 2)
            kv, out = cache(kv, ids, cu, weights, k=2)
            np.testing.assert_allclose(np.asarray(out)[:num_requests], np.diff(cu) * weights, rtol=1e-6)
    assert cache.stats.fallbacks == 3 and cache.stats.failed_buckets == 2
    assert len(cache.failed) == 2 and all("no kernel" in why for why in cache.failed.values())
    # the reason starts with the executable's name and names the function that refused (raised while tracing)
    assert all(why.startswith("picky_step: compile failed in picky_step (graph/test_executable_cache.py:")
               and why.endswith("NotImplementedError: no kernel for 4 requests") for why in cache.failed.values())
    assert sum("falls back" in r.message for r in caplog.records) == 2   # once per bucket


def doubling_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2


def pallas_step(kv, ids, cu, weights, *, k, backend="auto"):
    """``toy_step`` whose fast path runs a Pallas kernel natively (not interpreted): on CPU its lowering fails."""
    kv, out = toy_step(kv, ids, cu, weights, k=k)
    if backend != "xla":
        out = pl.pallas_call(doubling_kernel, out_shape=jax.ShapeDtypeStruct(out.shape, out.dtype),
                             name="doubling_kernel")(out) / 2
    return kv, out


@pytest.mark.skipif(cuda_available(), reason="needs a kernel that cannot compile here")
def test_the_fallback_reason_names_the_op_whose_compile_failed():
    """A kernel that fails to lower: the reason names the executable, the Pallas call (its name) and where
    it was called, then the error's first line; ``last_call_fallback`` reports it for the call it served."""
    cache = make_cache(pallas_step)
    ids, cu, weights = random_batch(np.random.default_rng(8), 2, 2)
    kv, out = cache(jnp.zeros(KV_SIZE, jnp.float32), ids, cu, weights, k=2)
    np.testing.assert_allclose(np.asarray(out)[:2], np.minimum(np.diff(cu), 2) * weights, rtol=1e-6)
    (why,) = cache.failed.values()
    assert re.fullmatch(r"pallas_step: compile failed in \S+ 'doubling_kernel' from pallas_step "
                        r"\(graph/test_executable_cache\.py:\d+\): ValueError: .*", why), why
    assert cache.last_call_fallback == why


def test_failed_compile_without_fallback_raises():
    cache = make_cache(picky_step, fallback=None)
    ids, cu, weights = random_batch(np.random.default_rng(6), 4, 2)
    with pytest.raises(NotImplementedError, match="no kernel"):
        cache(jnp.zeros(KV_SIZE), ids, cu, weights, k=2)


def exploding_step(kv, ids, cu, weights, *, k, backend="auto"):
    """``toy_step`` whose fast path fails at run time (as a kernel raising through a callback would)."""
    kv, out = toy_step(kv, ids, cu, weights, k=k)
    if backend != "xla":
        def explode(x):
            raise RuntimeError("kernel exploded")
        out = out + io_callback(explode, jax.ShapeDtypeStruct(out.shape, out.dtype), out)
    return kv, out


def test_run_failure_after_donation_raises_clearly_and_the_cache_stays_usable():
    cache = make_cache(exploding_step)
    rng = np.random.default_rng(11)
    ids, cu, weights = random_batch(rng, 2, 2)
    kv = jnp.zeros(KV_SIZE, jnp.float32)
    with pytest.raises(DonatedRunError, match="donated arguments \\['kv'\\] were consumed"):
        cache(kv, ids, cu, weights, k=2)
    assert kv.is_deleted() and len(cache.failed) == 1
    fresh = jnp.zeros(KV_SIZE, jnp.float32)           # the next call of that bucket runs the fallback
    fresh, out = cache(fresh, ids, cu, weights, k=2)
    np.testing.assert_allclose(np.asarray(out)[:2], np.diff(cu) * weights, rtol=1e-6)
    assert cache.stats.fallbacks == 1


def test_run_failure_without_donation_is_retried_on_the_fallback():
    cache = make_cache(exploding_step, donate_argnames=())
    ids, cu, weights = random_batch(np.random.default_rng(12), 2, 2)
    kv, out = cache(jnp.zeros(KV_SIZE, jnp.float32), ids, cu, weights, k=2)
    np.testing.assert_allclose(np.asarray(out)[:2], np.diff(cu) * weights, rtol=1e-6)
    (why,) = cache.failed.values()
    assert why.startswith("exploding_step: run failed") and "kernel exploded" in why, why


def test_device_call_under_a_transfer_guard_builds_its_mask_on_the_device():
    cache = make_cache(masked_step, masks={"mask": "batch"})
    host = random_batch(np.random.default_rng(13), 3, 2)
    cache.warmup(jnp.zeros(KV_SIZE), *host, k=2, progress=False)
    on_device = [jnp.asarray(x) for x in random_batch(np.random.default_rng(14), 3, 2)]
    on_device = [jax.device_put(np.pad(x, (0, n)), x.devices().pop())
                 for x, n in zip(on_device, (8 - on_device[0].shape[0], 1, 1))]
    kv = jnp.zeros(KV_SIZE, jnp.float32)
    cache(kv, *on_device, k=2)                       # first call: builds and caches the device mask
    kv = jnp.zeros(KV_SIZE, jnp.float32)
    with jax.transfer_guard("disallow"):
        kv, out = cache(kv, *on_device, k=2)
    assert not cache.failed and np.asarray(out)[3] == 0   # the padded request is masked out


def test_a_callers_transfer_error_never_marks_the_bucket_failed():
    cache = make_cache()
    ids, cu, weights = random_batch(np.random.default_rng(15), 2, 2)
    kv = jnp.zeros(KV_SIZE, jnp.float32)
    kv, _ = cache(kv, ids, cu, weights, k=2)
    with jax.transfer_guard("disallow"), pytest.raises(jax.errors.JaxRuntimeError, match="Disallowed"):
        cache(kv, ids, cu, weights, k=2)             # host inputs under the guard: the caller's error
    assert not cache.failed and not kv.is_deleted()


def test_donation_is_checked():
    cache = make_cache()
    kv = jnp.zeros(KV_SIZE, jnp.float32)
    ids, cu, weights = random_batch(np.random.default_rng(7), 2, 2)
    kv, _ = cache(kv, ids, cu, weights, k=2)
    analysis = cache.executable(cache.plan(kv, ids, cu, weights, k=2).key).memory_analysis()
    assert analysis.alias_size_in_bytes >= KV_SIZE * 4 and cache.stats.unaliased_donations == 0

    def drops_cache(kv, ids, cu, weights, *, k, backend="auto"):   # nothing to alias the cache with
        return toy_step(kv, ids, cu, weights, k=k)[1]
    copying = make_cache(drops_cache)
    copying(jnp.zeros(KV_SIZE), ids, cu, weights, k=2)
    assert copying.stats.unaliased_donations == 1

    def keeps_the_old_cache(kv, ids, cu, weights, *, k, backend="auto"):   # both versions live: a copy
        new_kv, out = toy_step(kv, ids, cu, weights, k=k)
        return new_kv, out + kv[:out.shape[0]] * kv[-1]
    copying = make_cache(keeps_the_old_cache, dims={"batch": [2], "tokens": lambda b: b["batch"] * b["k"]})
    copying(jnp.zeros(4096), ids, cu, weights, k=2)
    assert copying.stats.unaliased_donations == 0 and copying.stats.copied_donations == 1
    assert cache.stats.copied_donations == 0


def test_oversize_runs_unpadded():
    cache = make_cache()
    ids, cu, weights = random_batch(np.random.default_rng(8), 6, 2)
    assert cache.plan(jnp.zeros(KV_SIZE), ids, cu, weights, k=2).key is None
    _, out = cache(jnp.zeros(KV_SIZE), ids, cu, weights, k=2)
    assert out.shape == (6,) and cache.stats.oversize == 1


def test_clear_errors():
    with pytest.raises(ValueError, match="not a parameter"):
        make_cache(pads={"nope": Pad("batch")})
    with pytest.raises(ValueError, match="not one of dims"):
        make_cache(pads={"ids": Pad("seq")})
    cache = make_cache()
    ids, cu, weights = random_batch(np.random.default_rng(9), 3, 2)
    with pytest.raises(ValueError, match="'weights' says batch=2 but 'cu' says batch=3"):
        cache.plan(jnp.zeros(KV_SIZE), ids, cu, weights[:2], k=2)


def test_call_planned_is_a_call_without_planning_or_padding():
    """A caller that builds its arguments at bucket size plans the shape once (plan_sizes) and gets
    exactly what the padded call returns, with the same counters and its mask built from the plan."""
    rng = np.random.default_rng(3)
    padded, planned = (make_cache(masked_step, masks={"mask": "batch"}) for _ in range(2))
    for i, num_requests in enumerate((3, 3, 2)):                # buckets 4, 4, 2
        ids, cu, weights = random_batch(rng, num_requests, 2)
        want_kv, want = padded(jnp.zeros(KV_SIZE), ids, cu, weights, k=2)
        plan = planned.plan_sizes({"batch": num_requests, "tokens": ids.shape[0]}, ("kv", "ids", "cu", "weights"),
                                  k=2, backend="auto")
        assert plan.key == padded.plan(jnp.zeros(KV_SIZE), ids, cu, weights, k=2).key
        at_bucket = [pad_leaf(x, TOY_PADS[name], plan.padded[TOY_PADS[name].dim])[0]
                     for name, x in (("ids", ids), ("cu", cu), ("weights", weights))]
        got_kv, got = planned.call_planned(plan, [jnp.zeros(KV_SIZE), *at_bucket, None])
        np.testing.assert_array_equal(np.asarray(got_kv), np.asarray(want_kv))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert planned.last_call_compiled == (i != 1)
    assert planned.dynamic_argnames == ("kv", "ids", "cu", "weights", "mask")
    assert (planned.stats.hits, planned.stats.misses) == (padded.stats.hits, padded.stats.misses) == (1, 2)
    assert planned.stats.padding_ratio("batch") == padded.stats.padding_ratio("batch")
    with pytest.raises(ValueError, match="plan_sizes needs a size for every dim, missing \\['tokens'\\]"):
        planned.plan_sizes({"batch": 2}, ("kv",), k=2)
    with pytest.raises(ValueError, match="\\['nope'\\] are not dynamic arguments"):
        planned.plan_sizes({"batch": 2, "tokens": 4}, ("nope",), k=2)
    with pytest.raises(TypeError, match="call_planned takes 5 dynamic arguments"):
        planned.call_planned(plan, [jnp.zeros(KV_SIZE)])


PERSISTENT_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from scv_jax import ExecutableCache, Pad
    hits = []
    jax.monitoring.register_event_listener(
        lambda event, **kw: hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None)
    def step(kv, ids, *, k):
        return kv.at[jnp.where(ids < 0, kv.shape[0], ids)].add(1.0 * k, mode="drop")
    cache = ExecutableCache(step, dims={"tokens": [2, 4, 8]}, pads={"ids": Pad("tokens", fill=-1)},
                            bucketed_statics={"k": [1, 2]}, donate_argnames=("kv",),
                            cache_dir=sys.argv[1])
    kv = jnp.zeros(16)
    hits.clear()
    report = cache.warmup(kv, np.zeros(3, np.int32), k=1, progress=False)
    print(json.dumps({"hits": len(hits), "compiled": report.compiled}))
""")


def test_persistent_cache_is_reused_by_a_second_process(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", PERSISTENT_SCRIPT, str(tmp_path / "xla_cache")],
                              capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert runs[0] == {"hits": 0, "compiled": 6}
    assert runs[1] == {"hits": 6, "compiled": 6}
    assert any((tmp_path / "xla_cache").iterdir())


def test_public_names():
    assert scv_jax.ExecutableCache is ExecutableCache
    assert {"Buckets", "Pad", "GraphModeStats", "enable_persistent_cache"} <= set(dir(scv_jax))
