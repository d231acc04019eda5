"""Counting XLA backend compilations through ``jax.monitoring`` events."""

from __future__ import annotations

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """Context manager counting backend compilations (and their seconds) while it is open."""

    def __init__(self):
        self.count, self.seconds = 0, 0.0

    def _listener(self, event: str, duration: float, **_) -> None:
        if event == BACKEND_COMPILE_EVENT:
            self.count += 1
            self.seconds += duration

    def __enter__(self) -> "CompileCounter":
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listener)
