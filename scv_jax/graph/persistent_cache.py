"""JAX's persistent compilation cache (``enable_persistent_cache``), on by default for the decoder
(``use_default_cache``): a user's second process loads the decoding steps' executables from disk instead
of compiling them.

Where: ``$SCV_JAX_CACHE_DIR`` when set (``off``, ``0`` or empty turns the cache off), else
``$XDG_CACHE_HOME/scv_jax`` (default ``~/.cache/scv_jax``). A user's own ``jax_compilation_cache_dir``
(``JAX_COMPILATION_CACHE_DIR`` or ``jax.config.update``) always wins: then nothing is changed. Off in a
job of several processes on CPU devices, the user's JAX cache too (an executable loaded from the cache
there, another process's, hangs in its first collective across processes).
"""

from __future__ import annotations

import os
from typing import Mapping

ENV = "SCV_JAX_CACHE_DIR"
OFF = ("", "0", "off", "false", "no")


def default_cache_dir(env: Mapping[str, str], jax_cache_dir: str | None) -> str | None:
    """The directory the decoder caches executables in, or None (off, or the user's own JAX cache
    directory ``jax_cache_dir`` is set and used as it is)."""
    if jax_cache_dir:
        return None
    if ENV in env:
        value = env[ENV].strip()
        return None if value.lower() in OFF else os.path.expanduser(value)
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "scv_jax")


def enable_persistent_cache(cache_dir: str, *, min_compile_time_secs: float = 0.0,
                            min_entry_size_bytes: int = 0) -> None:
    """Turns on JAX's persistent compilation cache in ``cache_dir`` (process-wide JAX config)."""
    import jax

    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_time_secs)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", min_entry_size_bytes)
    if jax.config.jax_compilation_cache_dir != cache_dir:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        from jax.experimental.compilation_cache import compilation_cache
        compilation_cache.reset_cache()  # JAX decides once per process whether the cache is used


def use_default_cache() -> str | None:
    """Turns on JAX's persistent compilation cache in ``default_cache_dir`` (process-wide; every
    executable, however fast it compiled); returns the directory, or None when it changes nothing."""
    import jax

    if jax.process_count() > 1 and jax.default_backend() == "cpu":
        # an executable one process of a job of several CPU processes loads from the cache (the other's,
        # written a moment before) never ends its first collective across them (gloo, jax 0.12.1): such
        # jobs compile, even with the user's own JAX cache directory
        if jax.config.jax_enable_compilation_cache:
            jax.config.update("jax_enable_compilation_cache", False)
            from jax.experimental.compilation_cache import compilation_cache
            compilation_cache.reset_cache()
        return None
    cache_dir = default_cache_dir(os.environ, jax.config.jax_compilation_cache_dir)
    if cache_dir is not None:
        enable_persistent_cache(cache_dir)
    return cache_dir
