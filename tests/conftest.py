"""Shared pytest settings: CPU unless JAX_PLATFORMS says otherwise (benchmarks/gpu_suite.py runs the
kernel tests on a GPU), hypothesis profiles sized for CI's 2 cores ("ci") and for the GPU suite ("gpu"),
one persistent compilation cache for the whole run, LLVM's optimisation passes off on CPU (compile time), and
the fast tier ordered before the slow one.

The run's cache: many tests build decoders of the same shapes, and the decoder's executables are made
per decoder; JAX's persistent compilation cache (in a temporary directory shared by the xdist workers
and the subprocesses the tests start, removed at the end) loads what an earlier test compiled instead of
compiling it again. Tests that need a real compile take the ``no_persistent_cache`` fixture; counts of
"nothing compiled" also count loads (``CompileCounter.loads``)."""

import gc
import os
import pathlib
import shutil
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("SCV_JAX_CACHE_DIR", "off")   # tests write no user cache (scv_jax.graph.persistent_cache)
os.environ.setdefault("HF_HUB_OFFLINE", "1")         # a Hub id never reaches the network (tests/models/hub_cache.py)
TESTS = pathlib.Path(__file__).parent
_RUN_CACHE = "SCV_JAX_TEST_RUN_CACHE"                # set by the process that made the run's cache directory
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:    # the first pytest process (the xdist controller)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ[_RUN_CACHE] = tempfile.mkdtemp(prefix="scv_jax_tests_")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.1"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
if os.environ["JAX_PLATFORMS"] == "cpu" and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    # The tests' programs are tiny and most of their time is compiling: LLVM without its optimisation passes
    # compiles them ~25% faster, with the same IEEE arithmetic (no fast-math either way).
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
                               " --xla_llvm_disable_expensive_passes=true").strip()

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("ci", max_examples=25, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", max_examples=300, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("gpu", max_examples=8, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The fast tier first, then the tests marked ``slow`` (docs/contributing.md, "Two tiers"): a failure in
    the fast tier shows within its ~10 minutes, and both tiers share the run's compilation cache. In the slow
    tier the top-level modules go first (the benchmarks' and the GPU suite's dry runs, the commands, the docs'
    pages: its longest single tests), so that the run ends on the packages' shorter tests and one xdist worker
    does not sit idle while the other finishes a long one."""
    def order(item: pytest.Item) -> tuple[bool, bool]:
        slow = item.get_closest_marker("slow") is not None
        return slow, slow and item.path.parent != TESTS

    items.sort(key=order)


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


@pytest.fixture
def no_persistent_cache():
    """The test compiles for real: JAX's persistent compilation cache off while it runs."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_enable_compilation_cache", True)
    compilation_cache.reset_cache()


def pytest_sessionfinish(session):
    """The process that made the run's cache directory removes it."""
    if "PYTEST_XDIST_WORKER" not in os.environ and os.environ.get(_RUN_CACHE):
        shutil.rmtree(os.environ[_RUN_CACHE], ignore_errors=True)
