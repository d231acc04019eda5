"""Device side of the decoding loop: the building blocks the steps share (the per-request row
``StepRow`` and sampling columns ``SamplingColumn``, ``SplitModel``, the per-request random keys,
``choose_tokens``, ``commit_positions``) and the prefill step; pure functions of the models' parameter
leaves that graph mode compiles per shape bucket. The decode step is ``step_fn.make_decode_step``, its
verifiers (chains, trees) ``verifiers``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.sampling_math import argmax_ignoring_nan
from scv_jax.decoding.plan import MAX_CATCH_UP, SamplingColumn, StepRow
from scv_jax.ops.commit.api import slots_from_block_table
from scv_jax.ops.commit.kv_cache import PagedKVCache
from scv_jax.ops.commit.sharded import sharded_commit_draft_kv
from scv_jax.ops.sampling.api import filtered_probs

# fold_in tags of a request's per-step key
ACCEPT_TAG, BONUS_TAG, DRAFT_TAG = 0, 1, 2


def sampling_filters(sampling: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """float32[B, SamplingColumn.WIDTH] -> ``filtered_probs``' (temperature, top_k, top_p, min_p)."""
    return (sampling[:, SamplingColumn.TEMPERATURE], sampling[:, SamplingColumn.TOP_K].astype(jnp.int32),
            sampling[:, SamplingColumn.TOP_P], sampling[:, SamplingColumn.MIN_P])


class SplitModel(NamedTuple):
    """A model split once on the host into its static structure and its parameter leaves' tree, so a
    step call passes a flat list of arrays (cheap to dispatch) and the step merges it back."""

    graphdef: Any
    treedef: Any

    @classmethod
    def split(cls, model) -> tuple["SplitModel", list[jax.Array]]:
        """(the structure, the parameter leaves) of an ``nnx.Module``."""
        return cls.of(*nnx.split(model))

    @classmethod
    def of(cls, graphdef, state) -> tuple["SplitModel", list[jax.Array]]:
        """(the structure, the parameter leaves) of an ``nnx.split`` model (its state placed anywhere);
        a model with ``per_layer`` (``Transformer``) as that, each layer's weights separate inputs."""
        model = nnx.merge(graphdef, state)
        if hasattr(model, "per_layer"):
            graphdef, state = nnx.split(model.per_layer())
        leaves, treedef = jax.tree.flatten(state)
        return cls(graphdef, treedef), leaves

    def state(self, leaves: list[jax.Array]):
        """The ``nnx.State`` of these parameter leaves."""
        return jax.tree.unflatten(self.treedef, leaves)

    def merge(self, leaves: list[jax.Array]):
        return nnx.merge(self.graphdef, self.state(leaves))


def request_keys(key_data: jax.Array, positions: jax.Array) -> jax.Array:
    """[B] typed keys ``fold_in(request key, position)`` from int32[B, 2] key data (uint32 bits): a
    request's random numbers depend on its own stream and position only, never on its batch."""
    data = jax.lax.bitcast_convert_type(key_data, jnp.uint32)
    return jax.vmap(lambda d, p: jax.random.fold_in(jax.random.wrap_key_data(d, impl="threefry2x32"), p))(
        data, positions.astype(jnp.uint32))


class StepInputs(NamedTuple):
    """A decode step's ``rows`` unpacked (B requests).

    Attributes:
      lag: int32[B] tokens the draft cache lacks, in [1, MAX_CATCH_UP] (0 on padding rows).
      context_lens: int32[B] positions in the target cache (the pending token's position).
      num_drafts: int32[B] a chain's drafts to verify, in [0, k]; a tree's depth cap.
      tail: int32[B, MAX_CATCH_UP] the request's last tokens, the pending one last.
      lag_tokens: int32[B, MAX_CATCH_UP] the lag tokens, left-aligned (the draft's catch-up forward).
      keys: [B] typed keys, each request's stream folded with its context length (``request_keys``).
      draft_lens: int32[B] positions in the draft cache (``context_lens + 1 - lag``).
      request_mask: bool[B], False = padding.
      stop_ids: int32[B, MAX_STOP_IDS] the token ids that end each request (-1 = none).
    """

    lag: jax.Array
    context_lens: jax.Array
    num_drafts: jax.Array
    tail: jax.Array
    lag_tokens: jax.Array
    keys: jax.Array
    draft_lens: jax.Array
    request_mask: jax.Array
    stop_ids: jax.Array

    @property
    def pending(self) -> jax.Array:
        """int32[B] the token the target scores first (its K/V not yet cached)."""
        return self.tail[:, -1]


def step_inputs(rows: jax.Array, request_mask: jax.Array | None) -> StepInputs:
    """``StepInputs`` of int32[B, StepRow.WIDTH] rows (``request_mask`` None: every row a request)."""
    lag, context_lens, num_drafts = rows[:, StepRow.LAG], rows[:, StepRow.CONTEXT], rows[:, StepRow.NUM_DRAFTS]
    tail = rows[:, StepRow.TOKENS:]
    catch_up = jnp.arange(MAX_CATCH_UP, dtype=jnp.int32)[None, :] + MAX_CATCH_UP - lag[:, None]
    lag_tokens = jnp.take_along_axis(tail, jnp.clip(catch_up, 0, MAX_CATCH_UP - 1), axis=1)  # left-aligned
    if request_mask is None:
        request_mask = jnp.ones((rows.shape[0],), jnp.bool_)
    keys = request_keys(rows[:, StepRow.KEY:StepRow.KEY + 2], context_lens)
    return StepInputs(lag, context_lens, num_drafts, tail, lag_tokens, keys, context_lens + 1 - lag, request_mask,
                      rows[:, StepRow.STOP:StepRow.TOKENS])


def tagged_keys(keys: jax.Array, tag: int) -> jax.Array:
    return jax.vmap(lambda key: jax.random.fold_in(key, tag))(keys)


def choose_tokens(logits: jax.Array, keys: jax.Array, sampling: jax.Array, greedy: bool):
    """Next tokens from float[B, V] logits: with ``greedy`` (every request greedy) the argmax (probs
    None; the first index of the maximum, NaN never winning, as in the fused greedy acceptance), else
    a sample of each request's filtered distribution (``filtered_probs``; a greedy request's is the
    one-hot of its argmax) with its probs [B, V]."""
    if greedy:
        return argmax_ignoring_nan(logits), None
    probs = filtered_probs(logits, *sampling_filters(sampling), backend="xla")
    tokens = jax.vmap(jax.random.categorical)(keys, jnp.log(probs)).astype(jnp.int32)
    return tokens, probs


def flatten_rows(x: jax.Array) -> jax.Array:
    """[layers, B, T, ...] -> [layers, B * T, ...]."""
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def commit_positions(cache: PagedKVCache, keys: jax.Array, values: jax.Array, block_tables: jax.Array,
                     first_position: jax.Array, num_rows: jax.Array, block_size: int, backend: str, *,
                     after: jax.Array) -> PagedKVCache:
    """Commits rows t < num_rows[b] of [layers, B, T, kv_heads, head_dim] K/V at positions
    first_position[b] + t.

    ``after`` (e.g. the logits) orders the write after every read of the cache: without that data
    dependence XLA copies the donated cache instead of updating it in place.
    """
    num_rows, _ = jax.lax.optimization_barrier((num_rows, after))
    t = jnp.arange(keys.shape[2], dtype=jnp.int32)
    slots = slots_from_block_table(block_tables, first_position[:, None] + t, block_size).reshape(-1)
    mask = (t[None, :] < num_rows[:, None]).reshape(-1)
    return sharded_commit_draft_kv(cache, flatten_rows(keys), flatten_rows(values), slots, mask,
                                   backend=backend)


def make_prefill_step(target: SplitModel, draft: SplitModel | None, block_size: int):
    """``prefill_step(...)``: runs a chunk of prompt tokens through the given models and commits it."""

    def prefill_step(target_params, draft_params, target_cache, draft_cache, block_tables, tokens, start,
                     count, request_mask=None, *, backend: str = "auto"):
        """tokens int32[B, C] at positions start[b] + t; rows t < count[b] of masked-in requests commit.

        A model whose params are None is skipped and its cache returned as is (``draft_params`` alone:
        the draft's catch-up after k = 0 steps, see ``positions``).
        """
        if request_mask is not None:
            count = jnp.where(request_mask, count, 0)
        caches = []
        for split, params, cache in ((target, target_params, target_cache), (draft, draft_params, draft_cache)):
            if params is None:
                caches.append(cache)
                continue
            out = split.merge(params).forward_paged(tokens, cache, block_tables, start, backend=backend)
            caches.append(commit_positions(cache, out.keys, out.values, block_tables, start, count,
                                           block_size, backend, after=out.logits))
        return caches[0], caches[1]

    return prefill_step
