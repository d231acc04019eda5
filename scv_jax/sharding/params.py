"""Megatron-style tensor parallelism of ``scv_jax.models.Transformer`` over the mesh's "model" axis.

q/k/v and gate/up are split by columns (heads, FFN units), o and down by rows, so a layer needs two
all-reduces (after o and after down), which XLA's SPMD partitioner inserts from these shardings;
attention is local to a shard's heads (gpt-oss's sinks split with them). Norms are replicated (Qwen3's q/k norms too: one scale
shared by all heads). The embedding and the LM head are vocabulary-parallel (rows / columns split
over "model", when the vocabulary divides) or replicated. Everything is replicated over "data".
A mixture of experts is expert-parallel: its experts (``experts_*`` [layers, E, ...]) are split over
"model", E / model on each shard, and its router replicated; each shard applies its own experts to the
tokens routed to them and one all-reduce sums the shards' parts (``scv_jax.models.moe``).

KV heads: with at least as many KV heads as shards, each shard holds ``kv_heads / model`` of them;
with fewer, each KV head is replicated ``model / kv_heads`` times (vLLM's rule) so every shard holds
one, and where a KV head's query group does not split evenly over its replicas the group is padded
with query heads whose output projection is zero (they add exactly nothing). The model then runs
with ``tensor_parallel_config``'s head counts; its outputs are those of the original model.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from scv_jax.models.config import TransformerConfig
from scv_jax.models.transformer import Transformer
from scv_jax.sharding.mesh import MODEL

_COLUMNS = P(None, None, MODEL)      # [layers, d_in, d_out] split by output columns
_ROWS = P(None, MODEL, None)         # [layers, d_in, d_out] split by input rows
_LAYER_SPECS = {"attn/q/kernel": _COLUMNS, "attn/k/kernel": _COLUMNS, "attn/v/kernel": _COLUMNS,
                "attn/q/bias": P(None, MODEL), "attn/k/bias": P(None, MODEL), "attn/v/bias": P(None, MODEL),
                "attn/sinks": P(None, MODEL), "attn/o/kernel": _ROWS, "mlp/gate/kernel": _COLUMNS, "mlp/up/kernel": _COLUMNS,
                "mlp/down/kernel": _ROWS,
                **{f"mlp/experts_{name}": P(None, MODEL) for name in ("gate", "up", "down", "gate_bias", "up_bias",
                                                                        "down_bias")}}   # [layers, E, ...] by expert
_VOCAB_SPECS = {"embed/embedding": P(MODEL, None), "lm_head/kernel": P(None, MODEL)}


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """How a model's attention heads are laid out over ``model_size`` shards.

    Each of the ``kv_heads`` KV heads is stored ``replicas`` times (adjacent copies); its query group
    of ``group`` heads is padded to ``padded_group`` (a multiple of ``replicas``) with zero heads.
    """

    kv_heads: int
    group: int
    head_dim: int
    replicas: int
    padded_group: int

    @classmethod
    def split(cls, config: TransformerConfig, model_size: int, who: str) -> "HeadLayout":
        """The layout of ``config`` over ``model_size`` shards; ValueError naming the field otherwise."""
        kv, heads = config.num_kv_heads, config.num_heads
        if kv % model_size == 0:
            replicas = 1
        elif model_size % kv == 0:
            replicas = model_size // kv
        else:
            raise ValueError(f"{who}: num_kv_heads ({kv}) cannot be split over the mesh's model axis "
                             f"({model_size}): KV heads are divided among the shards, or replicated when "
                             "fewer, so one must be a multiple of the other")
        if config.num_experts and config.num_experts % model_size:
            raise ValueError(f"{who}: num_experts ({config.num_experts}) must be a multiple of the mesh's model "
                             f"axis ({model_size}) (the experts are split over it)")
        if not config.num_experts and config.ffn_dim % model_size:
            raise ValueError(f"{who}: ffn_dim ({config.ffn_dim}) must be a multiple of the mesh's model axis "
                             f"({model_size}) (gate/up columns and down rows are split over it)")
        group = heads // kv
        return cls(kv, group, config.head_dim, replicas, -(-group // replicas) * replicas)

    @property
    def num_heads(self) -> int:
        return self.kv_heads * self.padded_group

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads * self.replicas

    def queries(self, x: np.ndarray, axis: int) -> np.ndarray:
        """q columns / o rows (``axis`` holds heads * head_dim): each query group padded with zeros."""
        axis %= x.ndim
        shape = x.shape[:axis] + (self.kv_heads, self.group, self.head_dim) + x.shape[axis + 1:]
        pad = [(0, 0)] * len(shape)
        pad[axis + 1] = (0, self.padded_group - self.group)
        padded = np.pad(x.reshape(shape), pad)
        return padded.reshape(x.shape[:axis] + (self.num_heads * self.head_dim,) + x.shape[axis + 1:])

    def keys_values(self, x: np.ndarray, axis: int) -> np.ndarray:
        """k/v columns (``axis`` holds kv_heads * head_dim): each KV head repeated ``replicas`` times."""
        axis %= x.ndim
        shape = x.shape[:axis] + (self.kv_heads, self.head_dim) + x.shape[axis + 1:]
        repeated = np.repeat(x.reshape(shape), self.replicas, axis=axis)
        return repeated.reshape(x.shape[:axis] + (self.num_kv_heads * self.head_dim,) + x.shape[axis + 1:])

    def transform(self, name: str, x: np.ndarray) -> np.ndarray:
        """Parameter ``name`` (a path such as "blocks/attn/q/kernel") laid out for the shards."""
        if name in ("blocks/attn/q/kernel", "blocks/attn/q/bias"):
            return self.queries(x, -1)
        if name == "blocks/attn/o/kernel":
            return self.queries(x, -2)
        if name == "blocks/attn/sinks":          # [layers, heads]: one value per query head
            return dataclasses.replace(self, head_dim=1).queries(x, -1)
        if name in ("blocks/attn/k/kernel", "blocks/attn/k/bias", "blocks/attn/v/kernel", "blocks/attn/v/bias"):
            return self.keys_values(x, -1)
        return x


def tensor_parallel_config(config: TransformerConfig, model_size: int, who: str) -> TransformerConfig:
    """``config`` with the head counts a model runs with over ``model_size`` shards (``HeadLayout``)."""
    layout = HeadLayout.split(config, model_size, who)
    return dataclasses.replace(config, num_heads=layout.num_heads, num_kv_heads=layout.num_kv_heads)


def parameter_spec(name: str, config: TransformerConfig, model_size: int, *, vocab_parallel: bool) -> P:
    """The ``PartitionSpec`` of parameter ``name`` of a tensor-parallel ``Transformer``."""
    if name.startswith("blocks/") and name[len("blocks/"):] in _LAYER_SPECS:
        return _LAYER_SPECS[name[len("blocks/"):]]
    if name in _VOCAB_SPECS and vocab_parallel and config.vocab_size % model_size == 0:
        return _VOCAB_SPECS[name]
    return P()


def tensor_parallel_split(model: Transformer, model_size: int, who: str) -> tuple[nnx.GraphDef, nnx.State]:
    """``nnx.split`` of ``model`` as it runs over ``model_size`` shards: the head counts of
    ``tensor_parallel_config`` and its parameters laid out by ``HeadLayout``, as host (numpy) arrays."""
    layout = HeadLayout.split(model.config, model_size, who)
    config = tensor_parallel_config(model.config, model_size, who)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: type(model)(config, rngs=nnx.Rngs(0))))
    source = dict(nnx.to_flat_state(nnx.state(model)))
    for path, variable in nnx.to_flat_state(state):
        variable.set_value(layout.transform("/".join(map(str, path)), np.asarray(source[path].get_value())))
    return graphdef, state


def place_transformer(model: Transformer, mesh: Mesh, *, tensor_parallel: bool, vocab_parallel: bool,
                      who: str) -> tuple[nnx.GraphDef, nnx.State]:
    """``nnx.split`` of ``model`` with its parameters on ``mesh``: tensor-parallel over "model"
    (``tensor_parallel_split``, ``parameter_spec``) or replicated, and replicated over "data"
    (``place_state``).
    """
    model_size = mesh.shape[MODEL] if tensor_parallel else 1
    graphdef, state = tensor_parallel_split(model, model_size, who)
    config = tensor_parallel_config(model.config, model_size, who)
    place_state(state, mesh, lambda name: parameter_spec(name, config, model_size, vocab_parallel=vocab_parallel)
                if tensor_parallel else P())
    return graphdef, state


def place_head(head: nnx.Module, mesh: Mesh, *, vocab_parallel: bool) -> tuple[nnx.GraphDef, nnx.State]:
    """``nnx.split`` of an EAGLE head (``scv_jax.models.Eagle3Head``) with its parameters on ``mesh``:
    replicated (every shard runs the whole one-layer head, as a replicated draft model), but for the
    target's embedding it shares, split over "model" by vocabulary as the target's is
    (``parameter_spec``)."""
    graphdef, state = nnx.split(head)
    model_size = mesh.shape[MODEL]

    def spec_of(name: str) -> P:
        return (parameter_spec(name, head.config, model_size, vocab_parallel=vocab_parallel)
                if name == "embed/embedding" else P())

    place_state(state, mesh, spec_of)
    return graphdef, state


def place_state(state: nnx.State, mesh: Mesh, spec_of: Callable[[str], P]) -> None:
    """Puts every variable of ``state`` on ``mesh`` with the ``PartitionSpec`` ``spec_of(path)`` (path:
    "blocks/attn/q/kernel"). Each value is read to the host once and each device receives only its shard
    (``jax.make_array_from_callback``, which also works across processes)."""
    for path, variable in nnx.to_flat_state(state):
        host, sharding = np.asarray(variable.get_value()), NamedSharding(mesh, spec_of("/".join(map(str, path))))
        variable.set_value(jax.make_array_from_callback(host.shape, sharding, lambda index, host=host: host[index]))
