"""Graph mode's compiled buckets: one ahead-of-time compiled executable per bucket (``CompiledBuckets``),
the fallback's where the bucket's own fails to compile, each checked to update its donated arguments in
place."""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from typing import Any, Callable, Mapping

import jax

from scv_jax.graph.bucket_plan import BucketKey, BucketPlanner
from scv_jax.graph.compile_errors import error_lines, failing_op
from scv_jax.graph.hlo_facts import copied_arrays, hlo_type, local_shape, nbytes
from scv_jax.graph.persistent_cache import enable_persistent_cache
from scv_jax.graph.stats import GraphModeStats

logger = logging.getLogger("scv_jax.graph.executable_cache")   # the cache's one logger

_COPY_CHECK_BYTES = 1 << 12   # donated arrays smaller than this are not checked for copies


@dataclasses.dataclass
class Entry:
    """A bucket's compiled executable."""

    executable: Any          # jax.stages.Compiled, taking the dynamic arguments positionally
    is_fallback: bool
    ran: bool = False        # called at least once


def _positional(fn: Callable, dynamic: tuple[str, ...], name: str, fixed: frozenset[str] = frozenset()) -> Callable:
    """``fn`` taking its dynamic arguments positionally (in ``dynamic``'s order) and its static ones by
    keyword, called ``name`` (jit names its compilations ``jit(name)``); arguments in ``fixed`` (bound
    by a fallback's ``functools.partial``) are dropped."""
    def call(*values, **statics):
        named = {**dict(zip(dynamic, values)), **statics}
        return fn(**{a: v for a, v in named.items() if a not in fixed})
    call.__name__ = name
    return call


class CompiledBuckets(BucketPlanner):
    """A ``BucketPlanner`` with each bucket's executable, compiled on demand (``fallback``, ``cache_dir``
    and the planner's arguments are ``ExecutableCache``'s)."""

    def __init__(self, fn: Callable, *, fallback: Callable | Mapping[str, Any] | None = None,
                 cache_dir: str | None = None, **planning: Any):
        super().__init__(fn, **planning)
        jit_options = dict(static_argnames=self.static_argnames,
                           donate_argnums=tuple(i for i, a in enumerate(self._dynamic) if a in self.donate_argnames))
        self._jitted = jax.jit(_positional(fn, self._dynamic, self.name), **jit_options)
        if isinstance(fallback, Mapping):
            fallback = functools.partial(fn, **fallback)
        self._fallback_jitted = None
        if fallback is not None:
            fixed = frozenset(getattr(fallback, "keywords", None) or ())
            self._fallback_jitted = jax.jit(_positional(fallback, self._dynamic, self.name, fixed), **jit_options)
        if cache_dir is not None:
            enable_persistent_cache(cache_dir)
        self.stats = GraphModeStats()
        self.failed: dict[BucketKey, str] = {}   # bucket -> why its executable is not used
        self._entries: dict[BucketKey, Entry] = {}
        self._lock = threading.Lock()

    @property
    def jit_name(self) -> str:
        """The name XLA compilations of this cache's executables carry (``CompileCounter.names``)."""
        return f"jit({self.name})"

    # ---------------------------------------------------------------------------------- compiling
    def _compile_one(self, key: BucketKey, trace_args: dict[str, Any], *,
                     fallback_only: bool = False) -> tuple[Entry, int]:
        """Compiles ``key``'s executable (the fallback's if it fails); returns it and #compiles."""
        compiles = 0
        for is_fallback, jitted in ((False, self._jitted), (True, self._fallback_jitted)):
            if jitted is None:
                break
            if not is_fallback and (key in self.failed or fallback_only):
                continue
            start = time.perf_counter()
            statics = {a: trace_args[a] for a in self.static_argnames if a in trace_args}
            try:
                compiled = jitted.trace(*self._dynamic_values(trace_args), **statics).lower().compile()
            except Exception as error:  # noqa: BLE001 - any capture failure falls back
                if is_fallback or self._fallback_jitted is None:
                    raise
                self._mark_failed(key, self._reason("compile failed", error))
                continue
            finally:
                with self._lock:
                    self.stats.compile_seconds += time.perf_counter() - start
            compiles += 1
            with self._lock:
                self.stats.compiles += 1
            self._check_donation(key, compiled, trace_args)
            return Entry(compiled, is_fallback), compiles
        raise RuntimeError(f"{self.name}: bucket ({self.describe(key)}) has no executable: "
                           f"{self.failed.get(key)}")

    def _reason(self, what: str, error: BaseException) -> str:
        """Why a bucket moves to the fallback: this executable's name, what failed, the op whose
        lowering raised (when JAX's frames show it) and the error's first (and last) line, e.g.
        "decode_step: compile failed in mpmd_map from commit_kv_kernel (pallas_kernels/commit_kv.py:204):
        ValueError: Only interpret mode is supported on CPU backend"."""
        op = failing_op(error)
        return f"{self.name}: {what}{f' in {op}' if op else ''}: {error_lines(error)}"

    def _mark_failed(self, key: BucketKey, reason: str) -> None:
        with self._lock:
            if key in self.failed:
                return
            self.failed[key] = reason
            self.stats.failed_buckets += 1
        logger.warning("%s; bucket (%s) falls back to the reference path", reason, self.describe(key))

    def _check_donation(self, key: BucketKey, compiled: Any, trace_args: dict[str, Any]) -> None:
        donated = sum(nbytes(leaf) for arg in self.donate_argnames
                      for leaf in jax.tree.leaves(trace_args.get(arg)))
        if not donated:
            return
        aliased = getattr(compiled.memory_analysis(), "alias_size_in_bytes", None)
        if aliased is not None and aliased < donated:
            with self._lock:
                self.stats.unaliased_donations += 1
            logger.warning("%s: bucket (%s) aliases %d of %d donated bytes: the donated arguments %s "
                           "are copied, not updated in place", self.name, self.describe(key),
                           aliased, donated, self.donate_argnames)
            return
        # element type and shape: a step's [B, V] random bits (u32) are not its [S, V] control state (f32)
        donated_arrays = {(hlo_type(leaf.dtype), local_shape(leaf)) for arg in self.donate_argnames
                          for leaf in jax.tree.leaves(trace_args.get(arg)) if nbytes(leaf) >= _COPY_CHECK_BYTES}
        copied = [shape for kind, shape in copied_arrays(compiled.as_text()) if (kind, shape) in donated_arrays]
        if copied:
            with self._lock:
                self.stats.copied_donations += 1
            logger.warning("%s: bucket (%s) copies arrays of the donated arguments' shapes %s inside the "
                           "executable: the donated arguments %s are not updated in place",
                           self.name, self.describe(key), sorted(set(copied)), self.donate_argnames)

    @property
    def compiled_keys(self) -> list[BucketKey]:
        """The keys of the buckets compiled so far (``executable(key)`` of each is not None)."""
        return list(self._entries)

    def executable(self, key: BucketKey) -> Any | None:
        """The compiled executable serving ``key`` (``jax.stages.Compiled``), or None."""
        entry = self._entries.get(key)
        return entry.executable if entry else None
