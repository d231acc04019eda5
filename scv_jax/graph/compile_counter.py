"""Counting JAX traces, XLA backend compilations and persistent-cache loads through ``jax.monitoring``
events."""

from __future__ import annotations

import jax

TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_LOAD_EVENT = "/jax/compilation_cache/cache_retrieval_time_sec"   # recorded on a persistent-cache hit


class CompileCounter:
    """Context manager counting traces, backend compilations (with their seconds) and executables
    loaded from JAX's persistent compilation cache while open.

    Attributes:
      count: backend compilations; seconds: their summed duration.
      names: what each compilation compiled, in order (e.g. ``"jit(decode_step)"``).
      loads: executables loaded from the persistent cache instead of compiled (a jit cache miss
        that the persistent cache served).
      traces: jaxpr traces (a jit cache miss traces before it compiles or loads).
    """

    def __init__(self):
        self.count, self.seconds, self.traces, self.loads = 0, 0.0, 0, 0
        self.names: list[str] = []

    def _listener(self, event: str, duration: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT:
            self.count += 1
            self.seconds += duration
            self.names.append(str(kwargs.get("fun_name", "?")))
        elif event == CACHE_LOAD_EVENT:
            self.loads += 1
        elif event == TRACE_EVENT:
            self.traces += 1

    def __enter__(self) -> "CompileCounter":
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listener)
