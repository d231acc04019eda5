"""JAX's persistent compilation cache, on by default for the decoder: a user's second process loads
the decoding steps' executables from disk instead of compiling them.

Where: ``$SCV_JAX_CACHE_DIR`` when set (``off``, ``0`` or empty turns the cache off), else
``$XDG_CACHE_HOME/scv_jax`` (default ``~/.cache/scv_jax``). A user's own ``jax_compilation_cache_dir``
(``JAX_COMPILATION_CACHE_DIR`` or ``jax.config.update``) always wins: then nothing is changed.
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


def use_default_cache() -> str | None:
    """Turns on JAX's persistent compilation cache in ``default_cache_dir`` (process-wide; every
    executable, however fast it compiled); returns the directory, or None when it changes nothing."""
    import jax

    from scv_jax.graph.executable_cache import enable_persistent_cache

    cache_dir = default_cache_dir(os.environ, jax.config.jax_compilation_cache_dir)
    if cache_dir is not None:
        enable_persistent_cache(cache_dir)
    return cache_dir
