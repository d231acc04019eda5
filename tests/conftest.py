"""Shared pytest settings: CPU unless JAX_PLATFORMS says otherwise (benchmarks/gpu_suite.py runs the
kernel tests on a GPU), hypothesis profiles sized for CI's 2 cores ("ci") and for the GPU suite ("gpu")."""

import gc
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("SCV_JAX_CACHE_DIR", "off")   # tests write no user cache (scv_jax.graph.persistent_cache)

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("ci", max_examples=25, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", max_examples=300, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("gpu", max_examples=8, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
    """After each test module: drop jax's jit caches and collect the executables nothing holds. XLA:CPU
    keeps each executable's code mapped, and a long-lived xdist worker that compiled a whole suite's
    worth of executables can reach vm.max_map_count (65,530), where XLA aborts mid-compile."""
    yield
    if "jax" in sys.modules:
        import jax
        jax.clear_caches()
        gc.collect()
