"""The decoder's default persistent compilation cache directory."""

import os

import jax
import pytest

from scv_jax.graph.persistent_cache import default_cache_dir, use_default_cache


def test_default_is_the_user_cache_directory():
    assert default_cache_dir({}, None) == os.path.join(os.path.expanduser("~"), ".cache", "scv_jax")
    assert default_cache_dir({"XDG_CACHE_HOME": "/x/cache"}, "") == "/x/cache/scv_jax"


@pytest.mark.parametrize("value", ["", "0", "off", "OFF", " no "])
def test_environment_turns_it_off(value):
    assert default_cache_dir({"SCV_JAX_CACHE_DIR": value, "XDG_CACHE_HOME": "/x"}, None) is None


def test_environment_moves_it_and_a_users_jax_directory_wins():
    assert default_cache_dir({"SCV_JAX_CACHE_DIR": "/data/jit"}, None) == "/data/jit"
    assert default_cache_dir({"SCV_JAX_CACHE_DIR": "/data/jit"}, "/mine") is None
    assert default_cache_dir({}, "/mine") is None


def test_use_default_cache_leaves_a_users_jax_directory(monkeypatch, tmp_path):
    previous = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
        monkeypatch.setenv("SCV_JAX_CACHE_DIR", str(tmp_path / "ours"))
        assert use_default_cache() is None
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")
    finally:
        jax.config.update("jax_compilation_cache_dir", previous)


def test_use_default_cache_turns_on_jax_cache_in_the_directory(monkeypatch, tmp_path):
    from jax.experimental.compilation_cache import compilation_cache
    previous = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        monkeypatch.setenv("SCV_JAX_CACHE_DIR", str(tmp_path / "ours"))
        assert use_default_cache() == str(tmp_path / "ours")
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "ours")
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
    finally:
        jax.config.update("jax_compilation_cache_dir", previous)
        compilation_cache.reset_cache()
