"""Counting JAX traces, XLA backend compilations and persistent-cache loads through ``jax.monitoring``
events."""

from __future__ import annotations

import threading

import jax

TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_LOAD_EVENT = "/jax/compilation_cache/cache_retrieval_time_sec"   # recorded on a persistent-cache hit


class CompileCounter:
    """Context manager counting traces, backend compilations (with their seconds) and executables
    loaded from JAX's persistent compilation cache while open.

    Attributes:
      count: backend compile calls; seconds: their summed duration. jax 0.12 records one around a
        persistent-cache hit too, so ``count`` includes ``loads``; ``compiled`` excludes them (XLA really
        compiled).
      names: what each compilation compiled, in order (e.g. ``"jit(decode_step)"``).
      loads: executables loaded from the persistent cache instead of compiled (a jit cache miss
        that the persistent cache served).
      traces: jaxpr traces (a jit cache miss traces before it compiles or loads).
    """

    def __init__(self):
        self.count, self.seconds, self.traces, self.loads, self.compiled = 0, 0.0, 0, 0, 0
        self.names: list[str] = []
        self._loading = threading.local()     # a load was recorded on this thread; its compile event follows

    def _listener(self, event: str, duration: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT:
            self.count += 1
            self.seconds += duration
            self.names.append(str(kwargs.get("fun_name", "?")))
            if getattr(self._loading, "pending", False):
                self._loading.pending = False
            else:
                self.compiled += 1
        elif event == CACHE_LOAD_EVENT:
            self.loads += 1
            self._loading.pending = True
        elif event == TRACE_EVENT:
            self.traces += 1

    def __enter__(self) -> "CompileCounter":
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listener)
