"""Where a ``SpeculativeDecoder``'s weights, caches and batch rows live: on one device
(``SingleDevice``) or on a mesh with axes ("data", "model") (``OnMesh``).

On a mesh:
  * the target is tensor-parallel over "model" (``scv_jax.sharding.params``); the draft too with
    ``ShardingConfig(draft="model")``, else (the default) it is replicated: every "model" shard runs
    the whole draft, which needs no communication in its k sequential forwards. An EAGLE head is
    replicated (``place_head``: all but the target's embedding it shares, split like the target's);
  * both paged caches split their blocks over "data" (one ``BlockPool`` per data shard, block ids
    local to it) and their K/V heads over "model" (a replicated draft's cache: over "data" only; an
    EAGLE head's ``HeadCache``: its K/V as a replicated draft's, its features and tokens over "data");
  * a batch's requests are assigned to data shards when they arrive (their blocks stay there) and
    each step lays the batch out shard by shard (``BatchRows``); everything is replicated over
    "model" but the heads;
  * the logit controls' state (``ControlState``: penalties, biases, bad words; 8 bytes per request row
    and vocabulary entry) and structured output's drafting automata are replicated on every device;
  * the step functions are traced on the mesh (``scv_jax.sharding.mesh.tracing_on``), return their
    caches with the shardings they came with and the step summary replicated, so the host fetches
    it with one transfer from one device.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from scv_jax.decoding.block_pool import BlockPool
from scv_jax.decoding.caches import HeadCache, single_device_cache
from scv_jax.decoding.config import DecoderConfig
from scv_jax.graph.executable_cache import ExecutableCache
from scv_jax.models.eagle3 import Eagle3Head
from scv_jax.models.transformer import Transformer
from scv_jax.ops.commit.kv_cache import PagedKVCache
from scv_jax.ops.sampling.api import TokenLogprobs
from scv_jax.sharding.mesh import DATA, MODEL, cache_shardings, check_mesh, replicated_heads, tracing_on
from scv_jax.sharding.params import place_head, place_transformer, tensor_parallel_config
from scv_jax.sharding.processes import lower_alike, spans_processes
from scv_jax.verify.summary import HostStepResult, StepSummary

DRAFT_PLACEMENTS = ("replicated", "model")


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    """How ``SpeculativeDecoder(..., mesh=...)`` places the models.

    Attributes:
      draft: "replicated" (default: every "model" shard holds and runs the whole draft and its cache;
        no communication while drafting) or "model" (tensor-parallel like the target: 1/model of its
        weights and cache per device, two all-reduces per layer and draft token).
      vocab_parallel: split the embedding and LM head over "model" by vocabulary (default; replicated
        when the vocabulary does not divide) instead of replicating them.
    """

    draft: str = "replicated"
    vocab_parallel: bool = True

    def __post_init__(self):
        if self.draft not in DRAFT_PLACEMENTS:
            raise ValueError(f"ShardingConfig.draft must be one of {DRAFT_PLACEMENTS}, got {self.draft!r}")
        if not isinstance(self.vocab_parallel, bool):
            raise ValueError(f"ShardingConfig.vocab_parallel must be a bool, got {self.vocab_parallel!r}")


class PlacedModel(NamedTuple):
    """A model split for the step functions: graph definition, placed state, its cache's
    (num_layers, kv_heads, head_dim)."""

    graphdef: Any
    state: Any
    cache_dims: tuple[int, int, int]


class ShardedBlockPool:
    """One ``BlockPool`` per data shard: shard s owns cache blocks ``[s * n, (s + 1) * n)`` (n =
    num_blocks / shards), numbered 0 .. n - 1 in its block tables."""

    def __init__(self, num_blocks: int, num_shards: int):
        self.shards = [BlockPool(num_blocks // num_shards) for _ in range(num_shards)]

    @property
    def num_blocks(self) -> int:
        return sum(pool.num_blocks for pool in self.shards)

    @property
    def num_free(self) -> int:
        return sum(pool.num_free for pool in self.shards)

    def pick(self, need: Sequence[int], load: Sequence[int], growth: Sequence[int], per_shard: int) -> int | None:
        """The data shard to run a new request on that needs ``need[s]`` free blocks on shard s (fewer where
        its prefix is cached): of the shards running fewer than ``per_shard`` requests (``load[s]``) with
        ``need[s]`` blocks free beside the ``growth[s]`` their running requests need for their next step,
        the one running the fewest, then the one needing the fewest, then the one with the most room;
        None when none can take it now."""
        room = [pool.num_free - grow for pool, grow in zip(self.shards, growth)]
        fits = [s for s in range(len(self.shards)) if load[s] < per_shard and room[s] >= need[s]]
        return min(fits, key=lambda s: (load[s], need[s], -room[s]), default=None)


def _batch_fill(executable: ExecutableCache, name: str) -> Any:
    """The value ``executable`` pads argument ``name`` with along its batch axis."""
    return next(pad.fill for pad in executable.pads[name] if pad.dim == "batch")


class BatchRows(NamedTuple):
    """Where each request's row sits in the batch passed to an executable.

    Attributes:
      rows: int[n] the row of each request (in request order).
      size: rows passed (on a mesh a batch bucket, shard s owning rows [s * size / D, ...)).
      computed: rows the executable computes (``size`` padded to its bucket).
      scattered: rows are laid out by shard, with padding rows between (masked out explicitly).
    """

    rows: np.ndarray
    size: int
    computed: int
    scattered: bool

    def arrange(self, executable: ExecutableCache, **arrays: np.ndarray) -> dict[str, np.ndarray]:
        """The per-request ``arrays`` (leading axis n) at their rows, padding rows filled as
        ``executable`` pads, plus ``request_mask`` when scattered."""
        if not self.scattered:
            return arrays
        out = {}
        for name, array in arrays.items():
            out[name] = np.full((self.size, *array.shape[1:]), _batch_fill(executable, name), array.dtype)
            out[name][self.rows] = array
        out["request_mask"] = np.zeros(self.size, np.bool_)
        out["request_mask"][self.rows] = True
        return out

    def fetch(self, summary: StepSummary, logprobs: TokenLogprobs | None = None
              ) -> tuple[HostStepResult, TokenLogprobs | None]:
        """The step's one device-to-host transfer (its summary and, when the step computed them, its
        log-probabilities), as the requests' rows in request order."""
        packed, logprobs = jax.device_get((summary.packed, logprobs))
        rows = self.rows if self.scattered else slice(len(self.rows))
        host = StepSummary.unpack(packed[rows])
        return host, None if logprobs is None else TokenLogprobs(*(field[rows] for field in logprobs))


class SingleDevice:
    """Everything on the default device: the decoder as it runs without a mesh."""

    # a prefill call's rows may be split over calls of a smaller compiled bucket (``ExecutableCache.split_dims``)
    prefill_split_dims: tuple[str, ...] = ("batch",)

    def __init__(self, config: DecoderConfig):
        self.pool = ShardedBlockPool(config.num_blocks, 1)

    def warmup_args(self) -> dict[str, np.ndarray]:
        """Arguments a warm-up example adds (those every call passes)."""
        return {}

    def split(self, model: Any, role: str) -> PlacedModel:
        """``nnx.split`` of ``model`` (None: no model) as it runs here."""
        if model is None:
            return PlacedModel(None, None, None)
        graphdef, state = nnx.split(model)
        return PlacedModel(graphdef, state, (model.config.num_layers, model.config.num_kv_heads,
                                             model.config.head_dim))

    def new_cache(self, role: str, num_layers: int, num_blocks: int, block_size: int, kv_heads: int,
                  head_dim: int, dtype: str, features: tuple[int, Any] | None = None) -> PagedKVCache | HeadCache:
        """A zero cache (``caches.CacheFactory``; with ``features``, an EAGLE head's (d_model, dtype), a
        ``HeadCache``)."""
        cache = single_device_cache(role, num_layers, num_blocks, block_size, kv_heads, head_dim, dtype)
        return cache if features is None else HeadCache.wrap(cache, num_blocks, block_size, *features)

    def batch_buckets(self, sizes: Sequence[int]) -> tuple[int, ...]:
        return tuple(sorted(set(sizes)))

    def replicated(self, array: np.ndarray) -> jax.Array:
        """``array`` on the device (on a mesh: a copy on every device)."""
        return jax.device_put(array)

    def create_replicated(self, create: Callable[[], Any]) -> Any:
        """The arrays ``create()`` makes, made in place on the device (on a mesh: a copy on every device)."""
        return jax.jit(create)()

    def step(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` (a step function returning ``(target_cache, draft_cache, *outputs)``) as it runs here."""
        return fn

    def rows(self, shards: Sequence[int], executable: ExecutableCache) -> BatchRows:
        """The batch layout of requests on these data shards, in request order."""
        n = len(shards)
        return BatchRows(np.arange(n), n, executable.bucket("batch", n) or n, False)


class OnMesh(SingleDevice):
    """The decoder on ``mesh`` (axes "data", "model"): see the module docstring."""

    prefill_split_dims = ()     # a batch is laid out per data shard: its prefill calls pad instead

    def __init__(self, mesh: Any, config: DecoderConfig, sharding: ShardingConfig | None):
        self.mesh = check_mesh(mesh)
        if spans_processes(self.mesh):
            lower_alike()
        self.sharding = sharding or ShardingConfig()
        if not isinstance(self.sharding, ShardingConfig):
            raise TypeError(f"SpeculativeDecoder: sharding must be a ShardingConfig, got {type(sharding).__name__}")
        self.data, self.model = self.mesh.shape[DATA], self.mesh.shape[MODEL]
        if config.num_blocks % self.data:
            raise ValueError(f"DecoderConfig.num_blocks ({config.num_blocks}) must be a multiple of the mesh's data "
                             f"axis ({self.data}): each data shard holds num_blocks / {self.data} blocks")
        self.pool = ShardedBlockPool(config.num_blocks, self.data)

    def warmup_args(self) -> dict[str, np.ndarray]:
        return {"request_mask": np.ones(1, np.bool_)}

    def _tensor_parallel(self, role: str) -> bool:
        return role == "target" or self.sharding.draft == "model"

    def split(self, model: Any, role: str) -> PlacedModel:
        """The model's parameters placed on the mesh (tensor-parallel or replicated)."""
        if model is None:
            return PlacedModel(None, None, None)
        if role == "draft" and isinstance(model, Eagle3Head):
            if self.sharding.draft != "replicated":
                raise ValueError(f"SpeculativeDecoder: an EAGLE-3 head runs replicated over the mesh's model axis: "
                                 f"ShardingConfig.draft must be 'replicated', got {self.sharding.draft!r}")
            graphdef, state = place_head(model, self.mesh, vocab_parallel=self.sharding.vocab_parallel)
            return PlacedModel(graphdef, state, (1, model.config.num_kv_heads, model.config.head_dim))
        if not isinstance(model, Transformer):
            raise TypeError(f"SpeculativeDecoder: on a mesh the {role} must be a scv_jax.models.Transformer "
                            f"{'or an Eagle3Head ' if role == 'draft' else ''}(its attention runs per shard), "
                            f"got {type(model).__name__}")
        split = self._tensor_parallel(role)
        who = f"SpeculativeDecoder: the {role} on the mesh"
        graphdef, state = place_transformer(model, self.mesh, tensor_parallel=split,
                                            vocab_parallel=self.sharding.vocab_parallel, who=who)
        config = tensor_parallel_config(model.config, self.model if split else 1, who)
        return PlacedModel(graphdef, state, (config.num_layers, config.num_kv_heads, config.head_dim))

    def new_cache(self, role: str, num_layers: int, num_blocks: int, block_size: int, kv_heads: int,
                  head_dim: int, dtype: str, features: tuple[int, Any] | None = None) -> PagedKVCache | HeadCache:
        """A zero cache created in place on the mesh: blocks over "data", heads over "model" (a
        replicated draft's cache: a ``ReplicatedHeadsCache``, over "data" only; with ``features`` a
        ``HeadCache`` of one, its features and tokens over "data")."""
        def create() -> PagedKVCache | HeadCache:
            cache = single_device_cache(role, num_layers, num_blocks, block_size, kv_heads, head_dim, dtype)
            cache = cache if self._tensor_parallel(role) else replicated_heads(cache)
            return cache if features is None else HeadCache.wrap(cache, num_blocks, block_size, *features)

        return jax.jit(create, out_shardings=any_cache_shardings(jax.eval_shape(create), self.mesh))()

    def replicated(self, array: np.ndarray) -> jax.Array:
        # (from every process's own copy: a mesh may span processes)
        return jax.make_array_from_callback(array.shape, NamedSharding(self.mesh, P()), lambda index: array[index])

    def create_replicated(self, create: Callable[[], Any]) -> Any:
        return jax.jit(create, out_shardings=NamedSharding(self.mesh, P()))()

    def batch_buckets(self, sizes: Sequence[int]) -> tuple[int, ...]:
        """Batch sizes rounded up to multiples of the data axis (every data shard gets the same rows)."""
        return tuple(sorted({-(-size // self.data) * self.data for size in sizes}))

    def step(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        mesh = self.mesh

        @functools.wraps(fn)
        def on_mesh(*args, **kwargs):
            with tracing_on(mesh):
                target_cache, draft_cache, *outputs = fn(*args, **kwargs)
            caches = [None if cache is None
                      else jax.lax.with_sharding_constraint(cache, any_cache_shardings(cache, mesh))
                      for cache in (target_cache, draft_cache)]
            return (*caches, *jax.lax.with_sharding_constraint(outputs, NamedSharding(mesh, P())))

        return on_mesh

    def rows(self, shards: Sequence[int], executable: ExecutableCache) -> BatchRows:
        return shard_major_rows(shards, self.data, lambda size: executable.bucket("batch", size))


def any_cache_shardings(cache: PagedKVCache | HeadCache, mesh: Any) -> PagedKVCache | HeadCache:
    """``cache_shardings`` of a paged cache or of a ``HeadCache`` (its pages' leading axis, the blocks,
    over "data")."""
    if not isinstance(cache, HeadCache):
        return cache_shardings(cache, mesh)
    blocks = NamedSharding(mesh, P(DATA))
    return HeadCache(cache_shardings(cache.kv, mesh), blocks, blocks)


def shard_major_rows(shards: Sequence[int], num_shards: int, bucket: Callable[[int], int | None]) -> BatchRows:
    """Rows of requests on data shards ``shards``: shard s's requests (in request order) in rows
    ``[s * size / num_shards, ...)``, ``size`` the smallest bucket (a multiple of ``num_shards``) that
    gives every shard the rows its busiest one needs (that many, with no bucket large enough)."""
    busiest = max(list(shards).count(s) for s in range(num_shards)) * num_shards
    size = bucket(busiest) or busiest
    rows, taken = np.empty(len(shards), np.int64), [0] * num_shards
    for i, s in enumerate(shards):
        rows[i], taken[s] = s * (size // num_shards) + taken[s], taken[s] + 1
    return BatchRows(rows, size, size, True)
