"""The decoder's device mesh, the shardings of its paged caches, and the per-shard seams.

A decoder on a ``Mesh`` with axes ("data", "model") traces its step functions inside
``tracing_on(mesh)``. The ops that touch a paged cache (paged attention, the K/V commit, the verify
step) then run per shard under ``jax.shard_map``: requests and their cache blocks split over "data"
(block ids in a block table are local to the request's data shard), K/V heads over "model". All
other work is left to XLA's SPMD partitioner, which follows the parameters' shardings. Outside
``tracing_on`` (every single-device use) the seams run the plain ops.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, Iterator, Sequence

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from scv_jax.arguments import require_int
from scv_jax.ops.commit.kv_cache import PagedKVCache

DATA, MODEL = "data", "model"
MESH_AXES = (DATA, MODEL)
REQUESTS = P(DATA)          # [B, ...] per-request arrays (and [T, ...] per-slot arrays): rows over "data"
REPLICATED = P()

_ACTIVE: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("scv_jax_mesh", default=None)


def decoder_mesh(data: int = 1, model: int | None = None, *, devices: Sequence[Any] | None = None) -> Mesh:
    """A ``Mesh`` of ``data * model`` devices with axes ("data", "model").

    ``model`` defaults to all devices over ``data``; ``devices`` to ``jax.devices()`` (every process's
    devices after ``jax.distributed.initialize``, process by process). ``jax.make_mesh`` keeps that
    order on GPUs (TPU slices are laid out by topology), so "model", the last axis, groups one
    process's devices when it is at most their number, and "data" spans the processes.
    """
    devices = list(jax.devices() if devices is None else devices)
    require_int("decoder_mesh", "data", data, minimum=1)
    model = max(len(devices) // data, 1) if model is None else model
    require_int("decoder_mesh", "model", model, minimum=1)
    if data * model > len(devices):
        raise ValueError(f"decoder_mesh: data * model = {data} * {model} = {data * model} devices, but only "
                         f"{len(devices)} are available")
    return jax.make_mesh((data, model), MESH_AXES, axis_types=(AxisType.Auto, AxisType.Auto),
                         devices=devices[:data * model])


def check_mesh(mesh: Any, argument: str = "mesh") -> Mesh:
    """``mesh`` with automatic axes (the decoder leaves everything but its seams to GSPMD); raises
    naming ``argument`` unless it is a ``Mesh`` with exactly the axes ("data", "model")."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{argument} must be a jax.sharding.Mesh with axes {MESH_AXES} (e.g. "
                        f"scv_jax.decoder_mesh(data, model)), got {type(mesh).__name__}")
    if tuple(mesh.axis_names) != MESH_AXES:
        raise ValueError(f"{argument} must have the axes {MESH_AXES} (in that order), got {tuple(mesh.axis_names)}")
    if any(t != AxisType.Auto for t in mesh.axis_types):
        mesh = Mesh(mesh.devices, MESH_AXES, axis_types=(AxisType.Auto, AxisType.Auto))
    return mesh


@contextlib.contextmanager
def tracing_on(mesh: Mesh | None) -> Iterator[None]:
    """Within this context (while a step function is traced) the seams run per shard of ``mesh``;
    ``None`` turns them back into the plain ops (inside a shard)."""
    token = _ACTIVE.set(mesh)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_mesh() -> Mesh | None:
    """The mesh the seams shard over in the current trace, or None."""
    return _ACTIVE.get()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ReplicatedHeadsCache(PagedKVCache):
    """A ``PagedKVCache`` that every "model" shard holds whole (the cache of a draft replicated over
    "model"): its seams split it over "data" only. Same fields and layout as ``PagedKVCache``."""


def replicated_heads(cache: PagedKVCache) -> ReplicatedHeadsCache:
    return ReplicatedHeadsCache(**{f.name: getattr(cache, f.name) for f in dataclasses.fields(cache)})


def heads_axis(cache: PagedKVCache) -> str | None:
    """The mesh axis a cache's K/V heads (and its model's attention heads) are split over."""
    return None if isinstance(cache, ReplicatedHeadsCache) else MODEL


def cache_specs(cache: PagedKVCache) -> PagedKVCache:
    """``PartitionSpec``s of the cache's arrays, in the cache's own pytree structure: blocks over
    "data", K/V heads over ``heads_axis(cache)``."""
    heads = heads_axis(cache)
    pages = P(None, DATA, None, heads, None) if cache.layout == "NHD" else P(None, DATA, heads, None, None)
    scale = {None: None, "tensor": P(), "head": P(heads), "token_head": P(None, DATA, None, heads)}[cache.scale_mode]
    return type(cache)(pages, pages, scale, scale, cache.layout, cache.scale_mode)


def cache_shardings(cache: PagedKVCache, mesh: Mesh) -> PagedKVCache:
    """``cache_specs`` as ``NamedSharding``s on ``mesh``."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), cache_specs(cache))


def token_spec(heads: str | None) -> P:
    """[B, T, heads, head_dim] activations (and [layers, B * T, ...] K/V rows: see ``rows_spec``)."""
    return P(DATA, None, heads, None)


def rows_spec(heads: str | None) -> P:
    """[layers, rows, kv_heads, head_dim] K/V rows of the batch (rows of request b contiguous)."""
    return P(None, DATA, heads, None)


def per_shard(fn: Callable[..., Any], *, in_specs: Any, out_specs: Any) -> Callable[..., Any]:
    """``fn`` under ``jax.shard_map`` on the active mesh, with the seams inside running the plain ops.

    ``check_vma`` is off: the Pallas kernels inside carry no varying-axes rules, and the specs say
    what each output is (acceptance results are computed identically on every "model" shard).
    """
    mesh = active_mesh()

    def local(*args):
        with tracing_on(None):
            return fn(*args)

    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
