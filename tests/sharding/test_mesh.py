"""The decoder mesh: construction and its errors, cache shardings (one device; several-device runs are
in tests/decoding/test_mesh.py)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, PartitionSpec as P

import scv_jax
from scv_jax.sharding.mesh import active_mesh, cache_specs, check_mesh, replicated_heads, tracing_on


def test_decoder_mesh_and_its_errors():
    mesh = scv_jax.decoder_mesh()
    assert mesh.axis_names == ("data", "model") and mesh.devices.size == len(jax.devices())
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    with pytest.raises(ValueError, match=r"decoder_mesh: data \* model = 2 \* 3 = 6 devices, but only 1 are available"):
        scv_jax.decoder_mesh(2, 3, devices=jax.devices()[:1])
    with pytest.raises(ValueError, match="decoder_mesh: model must be an int >= 1, got 0"):
        scv_jax.decoder_mesh(1, 0)


def test_check_mesh_names_the_argument():
    devices = np.array(jax.devices()[:1]).reshape(1, 1)
    with pytest.raises(ValueError, match=r"mesh must have the axes \('data', 'model'\) \(in that order\), "
                                         r"got \('x', 'y'\)"):
        check_mesh(Mesh(devices, ("x", "y")))
    with pytest.raises(ValueError, match=r"got \('model', 'data'\)"):
        check_mesh(Mesh(devices, ("model", "data")))
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh .* got tuple"):
        check_mesh((2, 4))
    explicit = Mesh(devices, ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Explicit))
    assert check_mesh(explicit).axis_types == (AxisType.Auto, AxisType.Auto)


def test_cache_specs_split_blocks_over_data_and_heads_over_model():
    nhd = scv_jax.PagedKVCache.create(2, 8, 4, 2, 16, dtype="fp8", scale_mode="token_head")
    specs = cache_specs(nhd)
    assert specs.k_pages == specs.v_pages == P(None, "data", None, "model", None)
    assert specs.k_scale == P(None, "data", None, "model")
    hnd = scv_jax.PagedKVCache.create(2, 8, 4, 2, 16, dtype="fp8", layout="HND", scale_mode="head")
    assert cache_specs(hnd).k_pages == P(None, "data", "model", None, None) and cache_specs(hnd).k_scale == P("model")
    replicated = cache_specs(replicated_heads(nhd))
    assert replicated.k_pages == P(None, "data", None, None, None) and replicated.k_scale == P(None, "data", None, None)
    assert type(jax.jit(lambda cache: cache)(replicated_heads(nhd))).__name__ == "ReplicatedHeadsCache"


def test_seams_are_plain_ops_outside_a_mesh_trace():
    assert active_mesh() is None
    mesh = scv_jax.decoder_mesh()
    with tracing_on(mesh):
        assert active_mesh() is mesh
        with tracing_on(None):
            assert active_mesh() is None
    assert active_mesh() is None
