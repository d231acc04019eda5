"""Device side of the decoding loop: the prefill and decode-step functions, pure functions of the
models' parameter leaves that graph mode compiles per shape bucket.

A decode step with static k drafts per request (k may be 0) and per-request ``num_drafts <= k`` is
one straight sequence of stages; ``positions`` says where each request's tokens are:

1. ``propose``: the drafts come from one of two sources. Given drafts (an n-gram drafter on the host)
   are used as they are; a draft model runs its lag tokens (one catch-up forward), then k - 1
   one-token forwards, reading its cache plus a staging buffer of the step's earlier tokens (it
   writes no cache). With k = 0 nothing runs.
2. ``score``: the target runs [pending, d_1 .. d_k] over its cache, causally among them; in a
   packed step (``packed_k`` > 0, a target with ``forward_packed``) only each request's pending token
   and its first ``num_drafts`` drafts, B * (packed_k + 1) tokens in one row (``score_packed``).
3. ``accept_and_commit``: request b verifies its first ``num_drafts[b]`` drafts (the ragged slots are
   compacted, ``cu = cumsum(num_drafts)``; its bonus token comes from the target's logits after its
   last verified draft): greedy match or lossless rejection sampling, and the commit of the target's
   K/V for the pending token and the accepted drafts (``verify_step``, grid layout; per shard on a
   mesh).
4. ``commit_draft``: the draft's staged K/V up to the last accepted draft.
No cache receives a rejected token's K/V. The host then fetches the step's ``StepSummary`` and adapts k.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.ragged_batch import slot_owner
from pallas_kernels.sampling_math import argmax_ignoring_nan
from scv_jax.decoding.plan import SamplingColumn, StepRow
from scv_jax.decoding.positions import MAX_CATCH_UP, draft_rows_committed
from scv_jax.models.protocol import PackedTokens, PagedForwardOutput, StagedKV
from scv_jax.ops.commit.api import slots_from_block_table
from scv_jax.ops.commit.kv_cache import PagedKVCache
from scv_jax.ops.commit.sharded import sharded_commit_draft_kv
from scv_jax.ops.sampling.api import filtered_probs, token_logprobs
from scv_jax.sampling_params import MAX_LOGPROBS
from scv_jax.sharding.mesh import DATA, active_mesh
from scv_jax.verify.sharded import sharded_verify_step

# fold_in tags of a request's per-step key
_ACCEPT, _BONUS, _DRAFT = 0, 1, 2


def _filters(sampling: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
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


def _tagged(keys: jax.Array, tag: int) -> jax.Array:
    return jax.vmap(lambda key: jax.random.fold_in(key, tag))(keys)


def choose_tokens(logits: jax.Array, keys: jax.Array, sampling: jax.Array, greedy: bool):
    """Next tokens from float[B, V] logits: with ``greedy`` (every request greedy) the argmax (probs
    None; the first index of the maximum, NaN never winning, as in the fused greedy acceptance), else
    a sample of each request's filtered distribution (``filtered_probs``; a greedy request's is the
    one-hot of its argmax) with its probs [B, V]."""
    if greedy:
        return argmax_ignoring_nan(logits), None
    probs = filtered_probs(logits, *_filters(sampling), backend="xla")
    tokens = jax.vmap(jax.random.categorical)(keys, jnp.log(probs)).astype(jnp.int32)
    return tokens, probs


def drafts_before_stop(drafts: jax.Array, num_drafts: jax.Array, stop_ids: jax.Array) -> jax.Array:
    """int32[B]: ``num_drafts`` cut after each request's first draft that is one of its ``stop_ids``
    (int32[B, S], -1 = none): the drafts after a stop token are never verified, so never committed."""
    is_stop = jnp.any((drafts[:, :, None] == stop_ids[:, None, :]) & (stop_ids[:, None, :] >= 0), axis=2)
    first = jnp.argmax(is_stop, axis=1).astype(jnp.int32)
    return jnp.where(jnp.any(is_stop, axis=1), jnp.minimum(num_drafts, first + 1), num_drafts)


def _flatten_rows(x: jax.Array) -> jax.Array:
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
    return sharded_commit_draft_kv(cache, _flatten_rows(keys), _flatten_rows(values), slots, mask,
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


class Proposal(NamedTuple):
    """The drafts of one step.

    Attributes:
      tokens: int32[B, k] drafts (k = 0: none).
      probs: float32[B, k, V] their probabilities (None when greedy or without a draft model).
      staged: the draft model's staged K/V, ``[layers, B, max(k + 1, MAX_CATCH_UP), kv_heads,
        head_dim]``: entry s is position ``draft_lens + s`` (None without a draft model).
    """

    tokens: jax.Array
    probs: jax.Array | None
    staged: StagedKV | None


def propose(draft, drafts: jax.Array | None, draft_cache: PagedKVCache | None, block_tables: jax.Array,
            lag_tokens: jax.Array, lag: jax.Array, draft_lens: jax.Array, keys: jax.Array,
            sampling: jax.Array, *, k: int, greedy: bool, backend: str) -> Proposal:
    """Stage 1: given ``drafts`` int32[B, k] as they are; else the draft model's catch-up forward over
    the lag tokens, then k - 1 one-token forwards (a scan); with k = 0 (or neither source) no drafts."""
    batch = lag_tokens.shape[0]
    if drafts is not None:
        return Proposal(drafts.astype(jnp.int32), None, None)
    if draft is None or k == 0:
        return Proposal(jnp.zeros((batch, 0), jnp.int32), None, None)
    out = draft.forward_paged(lag_tokens, draft_cache, block_tables, draft_lens, backend=backend)
    stage_shape = (out.keys.shape[0], batch, max(k + 1, MAX_CATCH_UP), *out.keys.shape[3:])
    stage_k = jnp.zeros(stage_shape, out.keys.dtype).at[:, :, :MAX_CATCH_UP].set(out.keys)
    stage_v = jnp.zeros(stage_shape, out.values.dtype).at[:, :, :MAX_CATCH_UP].set(out.values)
    logits = jnp.take_along_axis(out.logits, (lag - 1)[:, None, None], axis=1)[:, 0]
    first, first_probs = choose_tokens(logits, _tagged(keys, _DRAFT), sampling, greedy)
    slots = jnp.arange(stage_shape[2], dtype=jnp.int32)

    def one_draft(carry, j):
        stage_k, stage_v, lengths, token = carry
        o = draft.forward_paged(token[:, None], draft_cache, block_tables, draft_lens,
                                StagedKV(stage_k, stage_v, lengths), backend=backend)
        # row b's new K/V into its slot lengths[b]: elementwise (no scatter), so a batch split over
        # devices stays local
        at_length = (slots[None, :] == lengths[:, None])[None, :, :, None, None]
        stage_k = jnp.where(at_length, o.keys, stage_k)
        stage_v = jnp.where(at_length, o.values, stage_v)
        nxt, probs = choose_tokens(o.logits[:, 0], _tagged(keys, _DRAFT + j), sampling, greedy)
        return (stage_k, stage_v, lengths + 1, nxt), (nxt, probs)

    (stage_k, stage_v, lengths, _), (rest, rest_probs) = jax.lax.scan(
        one_draft, (stage_k, stage_v, lag, first), jnp.arange(1, k))
    tokens = jnp.concatenate([first[:, None], rest.T], axis=1)
    probs = None if greedy else jnp.concatenate([first_probs[:, None], jnp.swapaxes(rest_probs, 0, 1)], axis=1)
    return Proposal(tokens, probs, StagedKV(stage_k, stage_v, lengths))


def score(target, target_cache: PagedKVCache, block_tables: jax.Array, pending: jax.Array,
          drafts: jax.Array, context_lens: jax.Array, *, backend: str) -> PagedForwardOutput:
    """Stage 2: the target's forward over [pending, drafts] (``[B, k + 1]``) at its context lengths."""
    return target.forward_paged(jnp.concatenate([pending[:, None], drafts], axis=1), target_cache,
                                block_tables, context_lens, backend=backend)


def packed_layout(num_drafts: jax.Array, num_tokens: int, width: int) -> PackedTokens:
    """The packed layout of a step's target tokens: request b's pending token and its first
    ``num_drafts[b]`` drafts (offsets 0 .. num_drafts[b]) at tokens ``cu[b] + b ...`` (``cu =
    cumsum(num_drafts)``, the order ``verify_step``'s "query" K/V layout expects); tokens past the last
    request's are padding (offset ``width``). ``num_drafts`` must fit: ``sum(num_drafts + 1) <= num_tokens``."""
    cu_tokens = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(num_drafts + 1, dtype=jnp.int32)])
    rows, offsets = slot_owner(cu_tokens, num_tokens)
    return PackedTokens(rows, jnp.where(jnp.arange(num_tokens) < cu_tokens[-1], offsets, width), width)


def fitting_drafts(num_drafts: jax.Array, capacity: int) -> jax.Array:
    """``num_drafts`` int32[B] cut, from the last requests on, to sum to at most ``capacity`` (a packed
    step's draft slots: bad host data never overflows them)."""
    before = jnp.cumsum(num_drafts) - num_drafts
    return jnp.clip(jnp.minimum(num_drafts, capacity - before), 0, None).astype(jnp.int32)


def score_packed(target, target_cache: PagedKVCache, block_tables: jax.Array, pending: jax.Array,
                 drafts: jax.Array, packed: PackedTokens, context_lens: jax.Array, *,
                 backend: str) -> PagedForwardOutput:
    """Stage 2, packed: the target's ``forward_packed`` over each request's [pending, its drafts] laid out
    by ``packed``; logits [N, V], K/V [layers, N, kv_heads, head_dim]."""
    grid = jnp.concatenate([pending[:, None], drafts], axis=1)
    tokens = grid[packed.rows, jnp.minimum(packed.offsets, grid.shape[1] - 1)]
    return target.forward_packed(tokens, packed, target_cache, block_tables, context_lens, backend=backend)


def ragged_slots(num_drafts: jax.Array, k: int, shards: int = 1,
                 num_slots: int | None = None) -> tuple[jax.Array, jax.Array]:
    """The compaction of a ragged batch: int32[B + 1] offsets ``cu = cumsum(num_drafts)`` and
    int32[shards, num_slots / shards]: for each compacted slot of a part, the index of its draft in the
    part's row-major [B / shards, k] grid (``num_slots`` defaults to B * k).

    The batch's ``shards`` equal parts (a mesh's data shards, which verify their requests alone) are
    compacted each within its own B * k / shards slots: part s's drafts fill the start of slots
    [s * B * k / shards, ...) (``cu``'s differences locate them there too), padding slots after them
    point at some valid index.
    """
    batch = num_drafts.shape[0]
    cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(num_drafts, dtype=jnp.int32)])
    rows = batch // shards
    local = jnp.concatenate([jnp.zeros((shards, 1), jnp.int32),
                             jnp.cumsum(num_drafts.reshape(shards, rows), axis=1, dtype=jnp.int32)], axis=1)
    part_slots = rows * k if num_slots is None else num_slots // shards
    owner, position = jax.vmap(slot_owner, (0, None))(local, part_slots)             # [shards, part_slots]
    return cu, jnp.clip(owner * k + position, 0, max(rows * k - 1, 0))


def compact_drafts(x: jax.Array, source: jax.Array) -> jax.Array:
    """[B, k, ...] per-draft values -> [T, ...] in ``ragged_slots`` order (``source``: int32[shards,
    T / shards]); each part gathers within itself, so a batch split over "data" stays local."""
    shards, slots = source.shape
    parts = x.reshape(shards, -1, *x.shape[2:])
    gathered = jnp.take_along_axis(parts, source.reshape(shards, slots, *(1,) * (x.ndim - 2)), axis=1)
    return gathered.reshape(shards * slots, *x.shape[2:])


def accept_and_commit(target_cache: PagedKVCache, scored: PagedForwardOutput, proposal: Proposal,
                      num_drafts: jax.Array, keys: jax.Array, sampling: jax.Array, block_tables: jax.Array,
                      context_lens: jax.Array, request_mask: jax.Array, *, block_size: int, greedy: bool,
                      backend: str, packed: PackedTokens | None = None):
    """Stage 3: acceptance of each request's first ``num_drafts`` drafts against the target, then the
    commit of the target's K/V for the pending token and the accepted drafts. ``scored`` is the dense
    [B, k + 1] forward, or with ``packed`` the packed one (``score_packed``; its N - B draft slots hold
    every request's drafts). Sampled steps verify against each request's filtered target distribution
    (``filtered_probs``; a greedy request's is one-hot, so its acceptance is the greedy one). Returns
    (target_cache, ``VerifyStepOutput``)."""
    batch, k = proposal.tokens.shape
    num_drafts = jnp.clip(num_drafts, 0, k).astype(jnp.int32)
    positions = context_lens[:, None] + jnp.arange(k + 1, dtype=jnp.int32)
    slots = slots_from_block_table(block_tables, positions, block_size)           # [B, k + 1]
    if packed is None:
        mesh = active_mesh()
        cu, source = ragged_slots(num_drafts, k, 1 if mesh is None else mesh.shape[DATA])
        draft_logits = lambda: compact_drafts(scored.logits[:, :k], source)  # noqa: E731
        target_probs = lambda: compact_drafts(  # noqa: E731
            filtered_probs(scored.logits[:, :k], *_filters(sampling), backend="xla"), source)
        after_last = jnp.take_along_axis(scored.logits, num_drafts[:, None, None], axis=1)[:, 0]
        new_keys, new_values, slots, kv_layout = (_flatten_rows(scored.keys), _flatten_rows(scored.values),
                                                  slots.reshape(-1), "grid")
    else:   # draft slot s of request b is token s + b (after b requests' pending tokens)
        num_tokens = packed.rows.shape[0]
        cu, source = ragged_slots(num_drafts, k, num_slots=num_tokens - batch)
        token_of_slot = jnp.minimum(jnp.arange(num_tokens - batch, dtype=jnp.int32) + source[0] // k,
                                    num_tokens - 1)
        draft_logits = lambda: scored.logits[token_of_slot]  # noqa: E731
        target_probs = lambda: filtered_probs(  # noqa: E731
            draft_logits(), *_filters(sampling), rows=packed.rows[token_of_slot], backend="xla")
        after_last = scored.logits[cu[1:] + jnp.arange(batch, dtype=jnp.int32)]
        new_keys, new_values, kv_layout = scored.keys, scored.values, "query"
        slots = slots[packed.rows, jnp.minimum(packed.offsets, k)]
    compact = lambda x: compact_drafts(x, source)  # noqa: E731  [B, k, ...] -> [T, ...]
    bonus, _ = choose_tokens(after_last, _tagged(keys, _BONUS), sampling, greedy)
    # the commit writes the cache as it is after every read (the bonus token comes from the last
    # logits): with k = 0 the acceptance does not depend on them, and XLA:CPU would copy the donated
    # cache instead of updating it in place (tests/decoding: test_decode_steps_update_the_caches_in_place)
    target_cache, _ = jax.lax.optimization_barrier((target_cache, bonus))
    if greedy:        # the argmax is fused into the acceptance (with no draft slot there is none to take)
        acceptance = (dict(target_logits=draft_logits()) if k
                      else dict(target_token_ids=jnp.zeros((0,), jnp.int32)))
    else:
        acceptance = dict(target_probs=target_probs(),
                          draft_probs=None if proposal.probs is None else compact(proposal.probs),
                          key=_tagged(keys, _ACCEPT))
    return sharded_verify_step(target_cache, new_keys, new_values, slots, compact(proposal.tokens), cu, bonus,
                               request_mask=request_mask, max_spec_len=k, kv_layout=kv_layout, backend=backend,
                               **acceptance)


def commit_draft(draft_cache: PagedKVCache, proposal: Proposal, block_tables: jax.Array,
                 draft_lens: jax.Array, lag: jax.Array, num_accepted: jax.Array, request_mask: jax.Array, *,
                 block_size: int, backend: str, after: jax.Array) -> PagedKVCache:
    """Stage 4: the draft's staged K/V of its lag tokens and its accepted drafts (``positions``)."""
    rows = jnp.where(request_mask, draft_rows_committed(lag, num_accepted, proposal.tokens.shape[1]), 0)
    return commit_positions(draft_cache, proposal.staged.keys, proposal.staged.values, block_tables, draft_lens,
                            rows, block_size, backend, after=after)


def make_decode_step(target: SplitModel, draft: SplitModel | None, block_size: int):
    """``decode_step(...)``: one speculative step (plain autoregressive decoding at k = 0)."""

    def decode_step(target_params, draft_params, target_cache, draft_cache, block_tables, rows, sampling,
                    drafts=None, request_mask=None, *, k: int, greedy: bool, logprobs: bool = False,
                    backend: str = "auto", packed_k: int = 0):
        """One decoding step of B requests (see ``scv_jax.decoding.positions``).

        Args:
          target_params, draft_params: the models' parameter leaves (``SplitModel.split``);
            draft_params None: no draft model runs (k = 0, or given ``drafts``).
          block_tables: int32[B, max_blocks] (-1 = none); shared by both caches.
          rows: int32[B, StepRow.WIDTH] per request: its draft lag, target context length, number of
            drafts to verify (the first ones, in [0, k]; cut after a draft that is a stop id), random
            stream, stop ids and last MAX_CATCH_UP tokens (``StepRow``).
          sampling: float32[B, SamplingColumn.WIDTH] each request's temperature (0 = greedy), top-k,
            top-p and min-p (unused when ``greedy``).
          drafts: int32[B, k] drafts proposed on the host (n-gram), or None (the draft model's).
          request_mask: bool[B], False = padding.
          k: drafts computed per request (static); greedy: every request greedy (static: the argmax
            fused into the acceptance; False verifies each request against its filtered distribution).
          logprobs: also return the log-probabilities of the emitted tokens and the top MAX_LOGPROBS
            (at most V; static; dense steps only).
          packed_k: 0 (a dense [B, k + 1] target forward) or in [1, k): the target scores B *
            (packed_k + 1) tokens packed (``score_packed``), at most B * packed_k drafts in all (static;
            the last requests' ``num_drafts`` are cut to fit).
        Returns:
          (target_cache, draft_cache, ``StepSummary``), with ``logprobs`` then ``TokenLogprobs`` of the
          [B, k + 1] emitted tokens (-inf past each request's last).
        """
        if k and drafts is None and draft_params is None:
            raise ValueError("decode_step: k > 0 needs draft_params (a draft model) or drafts")
        if drafts is not None and (draft_params is not None or drafts.shape[1] != k):
            raise ValueError(f"decode_step: drafts must be int32[B, k={k}] and come without draft_params, "
                             f"got shape {drafts.shape}")
        if packed_k and not 0 < packed_k < k:
            raise ValueError(f"decode_step: packed_k must be 0 or in [1, k={k}), got {packed_k}")
        if packed_k and logprobs:
            raise ValueError("decode_step: logprobs needs a dense step (packed_k 0)")
        lag, context_lens, num_drafts = rows[:, StepRow.LAG], rows[:, StepRow.CONTEXT], rows[:, StepRow.NUM_DRAFTS]
        tail = rows[:, StepRow.TOKENS:]
        catch_up = jnp.arange(MAX_CATCH_UP, dtype=jnp.int32)[None, :] + MAX_CATCH_UP - lag[:, None]
        lag_tokens = jnp.take_along_axis(tail, jnp.clip(catch_up, 0, MAX_CATCH_UP - 1), axis=1)  # left-aligned
        if request_mask is None:
            request_mask = jnp.ones((rows.shape[0],), jnp.bool_)
        keys = request_keys(rows[:, StepRow.KEY:StepRow.KEY + 2], context_lens)
        draft_model = None if draft_params is None or k == 0 else draft.merge(draft_params)
        draft_lens = context_lens + 1 - lag
        proposal = propose(draft_model, drafts, draft_cache, block_tables, lag_tokens, lag, draft_lens, keys,
                           sampling, k=k, greedy=greedy, backend=backend)
        if k:
            num_drafts = drafts_before_stop(proposal.tokens, num_drafts, rows[:, StepRow.STOP:StepRow.TOKENS])
        pending, target_model, packed = tail[:, -1], target.merge(target_params), None
        if packed_k:
            num_drafts = fitting_drafts(jnp.clip(num_drafts, 0, k), rows.shape[0] * packed_k)
            packed = packed_layout(num_drafts, rows.shape[0] * (packed_k + 1), k + 1)
            scored = score_packed(target_model, target_cache, block_tables, pending, proposal.tokens, packed,
                                  context_lens, backend=backend)
        else:
            scored = score(target_model, target_cache, block_tables, pending, proposal.tokens, context_lens,
                           backend=backend)
        target_cache, result = accept_and_commit(target_cache, scored, proposal, num_drafts, keys, sampling,
                                                 block_tables, context_lens, request_mask, block_size=block_size,
                                                 greedy=greedy, backend=backend, packed=packed)
        if proposal.staged is not None:
            draft_cache = commit_draft(draft_cache, proposal, block_tables, draft_lens, lag, result.num_accepted,
                                       request_mask, block_size=block_size, backend=backend,
                                       after=result.summary.packed)
        if logprobs:
            emitted = result.summary.packed[:, :k + 1]
            num_top = min(MAX_LOGPROBS, scored.logits.shape[-1])
            return target_cache, draft_cache, result.summary, token_logprobs(scored.logits, emitted, num_top)
        return target_cache, draft_cache, result.summary

    return decode_step
