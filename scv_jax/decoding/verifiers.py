"""The verifiers of the decode step (``step_fn.make_decode_step``): what a step proposes and how it
verifies it. Both supply the same four stages over the step's ``StepInputs`` (B requests, static k):

``ChainVerifier``: each request verifies a chain of drafts, its first ``num_drafts[b] <= k``.

1. ``propose``: host drafts (an n-gram drafter) int32[B, k] as they are; or a draft model's catch-up
   forward over its lag tokens, then k - 1 one-token forwards reading its cache plus a staging buffer of
   the step's earlier tokens (``ChainProposal``: the drafts, their probs [B, k, V] when sampled, the
   staged K/V ``[layers, B, max(k + 1, MAX_CATCH_UP), kv_heads, head_dim]``).
2. ``score``: ``num_drafts`` cut after a draft that is a stop id; the target runs [pending, d_1 .. d_k]
   (``[B, k + 1]``) over its cache, causally among them; in a packed step (``packed_k`` > 0, a target
   with ``forward_packed``) only each request's pending token and its first ``num_drafts`` drafts,
   B * (packed_k + 1) tokens in one row (``score_packed``).
3. ``accept``: the ragged slots compacted (``cu = cumsum(num_drafts)``), greedy match or lossless
   rejection sampling, the bonus token from the target's logits after the last verified draft, and the
   commit of the target's K/V for the pending token and the accepted drafts: one ``verify_step``
   (``accept_and_commit``; grid layout, per shard on a mesh; "query" layout when packed).
4. ``commit_draft``: the draft's staged K/V up to the last accepted draft.

``TreeVerifier(tree)``: each request verifies a token tree of k = N nodes; ``num_drafts`` is its depth
cap (the most nodes it may accept, at most ``TreeConfig.max_depth``). No logprobs, no packed step.

1. ``propose``: a draft model's EAGLE-2 tree (``draft_tree``) or a host tree int32[B, 2, N] (node tokens,
   then parents; an n-gram trie, ``scv_jax.decoding.ngram_trie``), as a ``TreeProposal``.
2. ``score``: the target over ``[pending, node 0 .. node N - 1]`` (``[B, N + 1]``) with tree attention
   (pending = root; ``tree_inputs``).
3. ``accept``: ``accept_tree_greedy`` (an all-greedy step) or ``tree_rejection_sample`` on each request's
   filtered target distribution (a greedy request's is its one-hot); nodes deeper than the request's cap
   or below one of its stop tokens are never accepted; then the commit of the target K/V of the pending
   token and the accepted path (``accepted_path_slots``). The summary has ``max_depth + 1`` token columns.
4. ``commit_draft``: the draft's catch-up tokens and the accepted nodes it ran (every accepted node but
   the last: the draft's lag after a step is then 1, or 2 after an accepted node: ``proposers.draft_model.DraftModelTree``).

No cache receives a rejected token's K/V.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_batch import slot_owner
from pallas_kernels.sampling_math import argmax_ignoring_nan
from pallas_kernels.tree_mask import ancestor_mask, depths
from scv_jax.decoding.device_step import (ACCEPT_TAG, BONUS_TAG, DRAFT_TAG, LogitControls, SplitModel, StepInputs,
                                          choose_tokens, commit_positions, controlled, drafts_previous, drafts_seen,
                                          flatten_rows, make_prefill_step, sampling_filters, tagged_keys)
from scv_jax.decoding.positions import MAX_CATCH_UP, draft_rows_committed
from scv_jax.decoding.tree_config import TreeConfig
from scv_jax.models.protocol import PackedTokens, PagedForwardOutput, StagedKV
from scv_jax.ops.commit.api import slots_from_block_table
from scv_jax.ops.commit.kv_cache import PagedKVCache
from scv_jax.ops.commit.sharded import sharded_commit_draft_kv
from scv_jax.ops.sampling.api import filtered_probs
from scv_jax.ops.tree.api import accept_tree_greedy, tree_rejection_sample
from scv_jax.ops.tree.commit_path import accepted_path_slots
from scv_jax.ops.tree.result import TreeAcceptResult
from scv_jax.sharding.mesh import DATA, active_mesh
from scv_jax.verify.sharded import sharded_verify_step
from scv_jax.verify.summary import StepSummary



class Verifier(Protocol):
    """The stages of a decode step (``step_fn.make_decode_step``); the models are merged ones, ``inputs``
    the step's ``StepInputs``, ``k`` > 0 (a k = 0 step is always ``ChainVerifier``'s)."""

    name: str
    every_step: bool      # its drafter runs in every step, k = 0 included (an EAGLE head: ``head_step``)

    def stages(self, k: int) -> "Verifier":
        """The verifier whose stages a step at ``k`` runs (k = 0: plain decoding's, the chain verifier's)."""

    def drafts_shape(self, k: int) -> tuple[int, ...]:
        """The shape of host drafts past the batch axis."""

    def check(self, *, k: int, logprobs: bool, packed_k: int) -> None:
        """Raises ValueError (one line naming the argument) for what the verifier does not support."""

    def propose(self, draft, drafts: jax.Array | None, draft_cache: PagedKVCache, block_tables: jax.Array,
                inputs: StepInputs, sampling: jax.Array, *, k: int, greedy: bool, backend: str) -> Any:
        """Stage 1: the step's proposal, from the draft model (``drafts`` None) or from host ``drafts``."""

    def score(self, target, target_cache: PagedKVCache, block_tables: jax.Array, inputs: StepInputs, proposal,
              *, k: int, packed_k: int, backend: str) -> Any:
        """Stage 2: the target's forward over the pending token and the proposal (``.output``)."""

    def accept(self, target_cache: PagedKVCache, scored, proposal, inputs: StepInputs, sampling: jax.Array,
               block_tables: jax.Array, *, block_size: int, greedy: bool, backend: str
               ) -> tuple[PagedKVCache, StepSummary, Any]:
        """Stage 3: the acceptance and the commit of the target's K/V: (target_cache, summary, result)."""

    def commit_draft(self, draft_cache: PagedKVCache, proposal, scored, result, block_tables: jax.Array,
                     inputs: StepInputs, *, block_size: int, backend: str) -> PagedKVCache:
        """Stage 4: the draft's K/V the step ran and kept (the cache as it is without a draft model)."""

    def prefill_step(self, target: SplitModel, draft: SplitModel | None, block_size: int):
        """The prefill step that fills what this verifier's steps read (``device_step.make_prefill_step``)."""


# ---------------------------------------------------------------------------------------------- chain

def drafts_before_stop(drafts: jax.Array, num_drafts: jax.Array, stop_ids: jax.Array) -> jax.Array:
    """int32[B]: ``num_drafts`` cut after each request's first draft that is one of its ``stop_ids``
    (int32[B, S], -1 = none): the drafts after a stop token are never verified, so never committed."""
    is_stop = jnp.any((drafts[:, :, None] == stop_ids[:, None, :]) & (stop_ids[:, None, :] >= 0), axis=2)
    first = jnp.argmax(is_stop, axis=1).astype(jnp.int32)
    return jnp.where(jnp.any(is_stop, axis=1), jnp.minimum(num_drafts, first + 1), num_drafts)


class ChainProposal(NamedTuple):
    """A chain step's drafts.

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
            sampling: jax.Array, *, k: int, greedy: bool, backend: str,
            controls: LogitControls | None = None) -> ChainProposal:
    """Stage 1: given ``drafts`` int32[B, k] as they are; else the draft model's catch-up forward over
    the lag tokens, then k - 1 one-token forwards (``draft_chain``); with k = 0 (or neither source) no
    drafts."""
    batch = lag_tokens.shape[0]
    if drafts is not None:
        return ChainProposal(drafts.astype(jnp.int32), None, None)
    if draft is None or k == 0:
        return ChainProposal(jnp.zeros((batch, 0), jnp.int32), None, None)
    out = draft.forward_paged(lag_tokens, draft_cache, block_tables, draft_lens, backend=backend)

    def forward(token, staged, carry):
        o = draft.forward_paged(token[:, None], draft_cache, block_tables, draft_lens, staged, backend=backend)
        return o.logits[:, 0], o.keys, o.values, carry

    return draft_chain(out, row_at(out.logits, lag - 1), lag, forward, None, keys, sampling, k=k, greedy=greedy,
                       controls=controls)


def row_at(values: jax.Array, rows: jax.Array) -> jax.Array:
    """[B, ...] request b's row ``rows[b]`` (int32[B]) of ``values`` [B, W, ...]."""
    return jnp.take_along_axis(values, rows.reshape(-1, *(1,) * (values.ndim - 1)), axis=1)[:, 0]


def draft_chain(catch_up: PagedForwardOutput, first_logits: jax.Array, lag: jax.Array, forward, carry,
                keys: jax.Array, sampling: jax.Array, *, k: int, greedy: bool,
                controls: LogitControls | None = None) -> ChainProposal:
    """k > 0 drafts per request after a catch-up forward over each request's ``lag`` missing tokens (its
    K/V [layers, B, W, kv_heads, head_dim] staged first, request b's first ``lag[b]`` rows valid): the
    first from ``first_logits`` [B, V] (the catch-up's at row lag - 1), each next from ``forward(token int32[B], staged,
    carry) -> (logits [B, V], keys, values [layers, B, 1, ...], carry)`` over the staged K/V (a scan);
    ``carry`` is the drafter's own running value (an EAGLE head's hidden state; None for a draft model).
    The drafts' logits take the requests' ``controls`` as the target's do (draft j's history holds the
    drafts before it). The staged K/V come back ``[layers, B, W + k - 1, kv_heads, head_dim]``."""
    batch, width = lag.shape[0], catch_up.keys.shape[2]
    stage_shape = (catch_up.keys.shape[0], batch, width + k - 1, *catch_up.keys.shape[3:])
    stage_k = jnp.zeros(stage_shape, catch_up.keys.dtype).at[:, :, :width].set(catch_up.keys)
    stage_v = jnp.zeros(stage_shape, catch_up.values.dtype).at[:, :, :width].set(catch_up.values)
    logits = controlled(controls, first_logits)
    first, first_probs = choose_tokens(logits, tagged_keys(keys, DRAFT_TAG), sampling, greedy)
    slots = jnp.arange(stage_shape[2], dtype=jnp.int32)
    # the drafts so far (-1: none yet), and the last output tokens with them
    seen = None if controls is None else jnp.full((batch, max(k - 1, 1)), -1, jnp.int32)
    previous = None if controls is None else controls.recent

    def one_draft(state, j):
        stage_k, stage_v, lengths, token, seen, previous, carry = state
        logits, new_keys, new_values, carry = forward(token, StagedKV(stage_k, stage_v, lengths), carry)
        # row b's new K/V into its slot lengths[b]: elementwise (no scatter), so a batch split over
        # devices stays local
        at_length = (slots[None, :] == lengths[:, None])[None, :, :, None, None]
        stage_k = jnp.where(at_length, new_keys, stage_k)
        stage_v = jnp.where(at_length, new_values, stage_v)
        if controls is not None:
            seen = seen.at[:, j - 1].set(token)
            previous = jnp.concatenate([previous[:, 1:], token[:, None]], axis=1)
            logits = controls.apply(logits, seen=seen, offsets=jnp.full((batch,), j, jnp.int32), previous=previous)
        nxt, probs = choose_tokens(logits, tagged_keys(keys, DRAFT_TAG + j), sampling, greedy)
        return (stage_k, stage_v, lengths + 1, nxt, seen, previous, carry), (nxt, probs)

    (stage_k, stage_v, lengths, *_), (rest, rest_probs) = jax.lax.scan(
        one_draft, (stage_k, stage_v, lag, first, seen, previous, carry), jnp.arange(1, k))
    tokens = jnp.concatenate([first[:, None], rest.T], axis=1)
    probs = None if greedy else jnp.concatenate([first_probs[:, None], jnp.swapaxes(rest_probs, 0, 1)], axis=1)
    return ChainProposal(tokens, probs, StagedKV(stage_k, stage_v, lengths))


def score(target, target_cache: PagedKVCache, block_tables: jax.Array, pending: jax.Array,
          drafts: jax.Array, context_lens: jax.Array, *, backend: str,
          aux_layers: tuple[int, ...] | None = None) -> PagedForwardOutput:
    """Stage 2: the target's forward over [pending, drafts] (``[B, k + 1]``) at its context lengths (with
    the taps of ``aux_layers``, when given, for an EAGLE head)."""
    taps = {} if aux_layers is None else dict(aux_layers=aux_layers)
    return target.forward_paged(jnp.concatenate([pending[:, None], drafts], axis=1), target_cache,
                                block_tables, context_lens, backend=backend, **taps)


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
                 backend: str, aux_layers: tuple[int, ...] | None = None) -> PagedForwardOutput:
    """Stage 2, packed: the target's ``forward_packed`` over each request's [pending, its drafts] laid out
    by ``packed``; logits [N, V], K/V [layers, N, kv_heads, head_dim] (with the taps [N, ...] of
    ``aux_layers``, when given, for an EAGLE head)."""
    grid = jnp.concatenate([pending[:, None], drafts], axis=1)
    tokens = grid[packed.rows, jnp.minimum(packed.offsets, grid.shape[1] - 1)]
    taps = {} if aux_layers is None else dict(aux_layers=aux_layers)
    return target.forward_packed(tokens, packed, target_cache, block_tables, context_lens, backend=backend, **taps)


def packed_grid(x: jax.Array, num_drafts: jax.Array, width: int) -> jax.Array:
    """[N, ...] values of a packed step's tokens (``packed_layout(num_drafts, N, width)``) -> [B, width, ...]:
    request b's at offset t (its last token's, offset ``num_drafts[b]``, past its drafts)."""
    start = jnp.cumsum(num_drafts + 1, dtype=jnp.int32) - (num_drafts + 1)
    t = jnp.arange(width, dtype=jnp.int32)[None, :]
    return x[start[:, None] + jnp.minimum(t, num_drafts[:, None])]


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


def accept_and_commit(target_cache: PagedKVCache, scored: PagedForwardOutput, proposal: ChainProposal,
                      num_drafts: jax.Array, keys: jax.Array, sampling: jax.Array, block_tables: jax.Array,
                      context_lens: jax.Array, request_mask: jax.Array, *, block_size: int, greedy: bool,
                      backend: str, packed: PackedTokens | None = None, controls: LogitControls | None = None):
    """Stage 3: acceptance of each request's first ``num_drafts`` drafts against the target, then the
    commit of the target's K/V for the pending token and the accepted drafts. ``scored`` is the dense
    [B, k + 1] forward, or with ``packed`` the packed one (``score_packed``; its N - B draft slots hold
    every request's drafts). Sampled steps verify against each request's filtered target distribution
    (``filtered_probs``; a greedy request's is one-hot, so its acceptance is the greedy one). With
    ``controls`` the target's logits at position t take them with the drafts before t in the history:
    the distribution autoregressive decoding would sample from there. Returns (target_cache,
    ``VerifyStepOutput``)."""
    batch, k = proposal.tokens.shape
    num_drafts = jnp.clip(num_drafts, 0, k).astype(jnp.int32)
    if controls is not None:
        seen = drafts_seen(proposal.tokens)                                              # [B, k + 1, k]
        previous = drafts_previous(controls.recent, proposal.tokens)                     # [B, k + 1, W]
        if packed is None:
            at = dict(seen=seen, offsets=jnp.broadcast_to(jnp.arange(k + 1, dtype=jnp.int32), (batch, k + 1)),
                      previous=previous)
        else:
            rows, offsets = jnp.clip(packed.rows, 0, batch - 1), jnp.minimum(packed.offsets, k)
            at = dict(rows=rows, seen=seen[rows, offsets], offsets=offsets, previous=previous[rows, offsets])
        scored = scored._replace(logits=controls.apply(scored.logits, **at))
    positions = context_lens[:, None] + jnp.arange(k + 1, dtype=jnp.int32)
    slots = slots_from_block_table(block_tables, positions, block_size)           # [B, k + 1]
    if packed is None:
        mesh = active_mesh()
        cu, source = ragged_slots(num_drafts, k, 1 if mesh is None else mesh.shape[DATA])
        draft_logits = lambda: compact_drafts(scored.logits[:, :k], source)  # noqa: E731
        target_probs = lambda: compact_drafts(  # noqa: E731
            filtered_probs(scored.logits[:, :k], *sampling_filters(sampling), backend="xla"), source)
        after_last = row_at(scored.logits, num_drafts)
        new_keys, new_values, slots, kv_layout = (flatten_rows(scored.keys), flatten_rows(scored.values),
                                                  slots.reshape(-1), "grid")
    else:   # draft slot s of request b is token s + b (after b requests' pending tokens)
        num_tokens = packed.rows.shape[0]
        cu, source = ragged_slots(num_drafts, k, num_slots=num_tokens - batch)
        token_of_slot = jnp.minimum(jnp.arange(num_tokens - batch, dtype=jnp.int32) + source[0] // k,
                                    num_tokens - 1)
        draft_logits = lambda: scored.logits[token_of_slot]  # noqa: E731
        target_probs = lambda: filtered_probs(  # noqa: E731
            draft_logits(), *sampling_filters(sampling), rows=packed.rows[token_of_slot], backend="xla")
        after_last = scored.logits[cu[1:] + jnp.arange(batch, dtype=jnp.int32)]
        new_keys, new_values, kv_layout = scored.keys, scored.values, "query"
        slots = slots[packed.rows, jnp.minimum(packed.offsets, k)]
    compact = lambda x: compact_drafts(x, source)  # noqa: E731  [B, k, ...] -> [T, ...]
    bonus, _ = choose_tokens(after_last, tagged_keys(keys, BONUS_TAG), sampling, greedy)
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
                          key=tagged_keys(keys, ACCEPT_TAG))
    return sharded_verify_step(target_cache, new_keys, new_values, slots, compact(proposal.tokens), cu, bonus,
                               request_mask=request_mask, max_spec_len=k, kv_layout=kv_layout, backend=backend,
                               **acceptance)


def commit_draft(draft_cache: PagedKVCache, proposal: ChainProposal, block_tables: jax.Array,
                 draft_lens: jax.Array, lag: jax.Array, num_accepted: jax.Array, request_mask: jax.Array, *,
                 block_size: int, backend: str, after: jax.Array) -> PagedKVCache:
    """Stage 4: the draft's staged K/V of its lag tokens and its accepted drafts (``positions``)."""
    rows = jnp.where(request_mask, draft_rows_committed(lag, num_accepted, proposal.tokens.shape[1]), 0)
    return commit_positions(draft_cache, proposal.staged.keys, proposal.staged.values, block_tables, draft_lens,
                            rows, block_size, backend, after=after)


class ChainScored(NamedTuple):
    """A chain step's target forward (dense [B, k + 1] or packed, ``packed`` its layout) and each request's
    drafts to verify (cut after a stop id, and to fit a packed step)."""

    output: PagedForwardOutput
    num_drafts: jax.Array
    packed: PackedTokens | None

    def grid(self, x: jax.Array) -> jax.Array:
        """[B, k + 1, ...] per-token values of ``output`` (its [B, k + 1, ...] as they are; a packed step's
        [N, ...] by request and offset, ``packed_grid``)."""
        return x if self.packed is None else packed_grid(x, self.num_drafts, self.packed.width)


def score_chain(target, target_cache: PagedKVCache, block_tables: jax.Array, inputs: StepInputs, drafts: jax.Array,
                num_drafts: jax.Array, *, k: int, packed_k: int, backend: str,
                aux_layers: tuple[int, ...] | None = None) -> ChainScored:
    """Stage 2 of a chain step: ``num_drafts`` int32[B] cut after a stop id (and, packed, to fit), then the
    target over [pending, ``drafts``] dense (``score``) or, with ``packed_k``, packed (``score_packed``);
    with the taps of ``aux_layers`` when given."""
    packed, batch = None, num_drafts.shape[0]
    if k:
        num_drafts = drafts_before_stop(drafts, num_drafts, inputs.stop_ids)
    if packed_k:
        num_drafts = fitting_drafts(jnp.clip(num_drafts, 0, k), batch * packed_k)
        packed = packed_layout(num_drafts, batch * (packed_k + 1), k + 1)
        out = score_packed(target, target_cache, block_tables, inputs.pending, drafts, packed, inputs.context_lens,
                           backend=backend, aux_layers=aux_layers)
    else:
        out = score(target, target_cache, block_tables, inputs.pending, drafts, inputs.context_lens,
                    backend=backend, aux_layers=aux_layers)
    return ChainScored(out, num_drafts, packed)


@dataclasses.dataclass(frozen=True)
class ChainVerifier:
    """Chains of drafts: host drafts int32[B, k] or a draft model's (``propose``), see the module docstring."""

    name = "chain"
    every_step = False

    def stages(self, k: int) -> "Verifier":
        return self if k else ChainVerifier()

    def prefill_step(self, target: SplitModel, draft: SplitModel | None, block_size: int):
        return make_prefill_step(target, draft, block_size)

    def drafts_shape(self, k: int) -> tuple[int, ...]:
        return (k,)

    def check(self, *, k: int, logprobs: bool, packed_k: int) -> None:
        if packed_k and not 0 < packed_k < k:
            raise ValueError(f"decode_step: packed_k must be 0 or in [1, k={k}), got {packed_k}")
        if packed_k and logprobs:
            raise ValueError("decode_step: logprobs needs a dense step (packed_k 0)")

    def propose(self, draft, drafts, draft_cache, block_tables, inputs, sampling, *, k, greedy, backend
                ) -> ChainProposal:
        return propose(draft, drafts, draft_cache, block_tables, inputs.lag_tokens, inputs.lag, inputs.draft_lens,
                       inputs.keys, sampling, k=k, greedy=greedy, backend=backend, controls=inputs.controls)

    def score(self, target, target_cache, block_tables, inputs, proposal, *, k, packed_k, backend) -> ChainScored:
        return score_chain(target, target_cache, block_tables, inputs, proposal.tokens, inputs.num_drafts, k=k,
                           packed_k=packed_k, backend=backend)

    def accept(self, target_cache, scored, proposal, inputs, sampling, block_tables, *, block_size, greedy,
               backend) -> tuple[PagedKVCache, StepSummary, Any]:
        target_cache, result = accept_and_commit(
            target_cache, scored.output, proposal, scored.num_drafts, inputs.keys, sampling, block_tables,
            inputs.context_lens, inputs.request_mask, block_size=block_size, greedy=greedy, backend=backend,
            packed=scored.packed, controls=inputs.controls)
        return target_cache, result.summary, result

    def commit_draft(self, draft_cache, proposal, scored, result, block_tables, inputs, *, block_size, backend
                     ) -> PagedKVCache:
        if proposal.staged is None:
            return draft_cache
        return commit_draft(draft_cache, proposal, block_tables, inputs.draft_lens, inputs.lag, result.num_accepted,
                            inputs.request_mask, block_size=block_size, backend=backend, after=result.summary.packed)


# ----------------------------------------------------------------------------------------------- tree


class TreeProposal(NamedTuple):
    """A tree step's tree and, from a draft model, what its commit needs.

    Attributes:
      tokens, parents: int32[B, N] the nodes (rank order: parents before children; parent -1 = the root).
      expanded: int32[B, E] the node of each token of the last expansion forward (-1: not in the tree).
      catch_up: the draft's catch-up forward (its K/V: ``[layers, B, MAX_CATCH_UP, kv_heads, head_dim]``).
      last: the last expansion forward's K/V ``[layers, B, E, ...]`` (E = (max_depth - 1) * branching), or None.
      A host tree has tokens and parents only (the rest None: no draft cache to commit).
    """

    tokens: jax.Array
    parents: jax.Array
    expanded: jax.Array | None = None
    catch_up: PagedForwardOutput | None = None
    last: PagedForwardOutput | None = None


def _top_children(logits: jax.Array, scores: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
    """The top ``width`` tokens of float[B, M, V] logits and their cumulative log-probabilities (``scores``
    float32[B, M] plus their own): int32[B, M, width], float32[B, M, width]."""
    logp, tokens = jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), width)
    return tokens.astype(jnp.int32), scores[:, :, None] + logp


def draft_tree(draft, draft_cache: PagedKVCache, block_tables: jax.Array, lag_tokens: jax.Array, lag: jax.Array,
               draft_lens: jax.Array, *, tree: TreeConfig, backend: str,
               controls: LogitControls | None = None) -> TreeProposal:
    """A draft model's EAGLE-2 tree (``grow_tree``) after its catch-up forward over the lag tokens."""
    out = draft.forward_paged(lag_tokens, draft_cache, block_tables, draft_lens, backend=backend)
    staged = StagedKV(out.keys, out.values, lag)

    def expand(tokens, parents, carry):
        last = draft.forward_paged(tokens, draft_cache, block_tables, draft_lens, staged, tree_parents=parents,
                                   backend=backend)
        return last.logits, carry, last

    return grow_tree(out, row_at(out.logits, lag - 1), lag, expand, None, tree=tree, controls=controls)


def grow_tree(catch_up, root_logits: jax.Array, lag: jax.Array, expand, root_carry, *, tree: TreeConfig,
              controls: LogitControls | None = None) -> TreeProposal:
    """EAGLE-2's dynamic tree: after the catch-up forward (``root_logits`` [B, V]: its logits at request
    b's root, row lag[b] - 1) the root's top ``branching`` children; then per level the ``branching``
    frontier nodes with the best cumulative draft log-probability expand their top ``branching`` children
    (``expand(tokens int32[B, E], tree_parents int32[B, E], carry) -> (logits [B, E, V], carry_out, out)``:
    one draft forward of every expanded node so far, tree attention, over the staged catch-up tokens;
    ``carry`` the drafter's own per-node input, each node taking its parent's ``carry_out``: an EAGLE head's
    hidden state, ``root_carry`` [B, ...] the root's; None for a draft model); the ``draft_nodes()`` best
    candidates by cumulative log-probability (ties: the earlier candidate), in rank order. Children are
    the draft's top-k: deterministic. With ``controls`` every node's logits take them over the committed
    history (not the node's path: the target's verification alone decides what is accepted)."""
    width, batch = tree.branching, lag.shape[0]
    root = controlled(controls, root_logits[:, None])                                                # [B, 1, V]
    tokens, scores = _top_children(root, jnp.zeros((batch, 1), jnp.float32), width)
    pool_tokens, pool_scores = [tokens[:, 0]], [scores[:, 0]]
    pool_parents = [jnp.full((batch, width), -1, jnp.int32)]
    frontier = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))   # pool indices
    frontier_tokens, frontier_scores = tokens[:, 0], scores[:, 0]
    frontier_carry = jax.tree.map(lambda c: jnp.repeat(c[:, None], width, axis=1), root_carry)
    expanded, expanded_tokens, expanded_parents, expanded_carry, last = [], [], [], [], None
    rows = jnp.arange(batch)[:, None]
    parents = jnp.full((batch, width), -1, jnp.int32)      # the frontier's parents among the expanded nodes
    for level in range(1, tree.max_depth):
        expanded.append(frontier)
        expanded_tokens.append(frontier_tokens)
        expanded_parents.append(parents)
        expanded_carry.append(frontier_carry)
        logits, carry_out, last = expand(jnp.concatenate(expanded_tokens, axis=1),
                                         jnp.concatenate(expanded_parents, axis=1),
                                         jax.tree.map(lambda *c: jnp.concatenate(c, axis=1), *expanded_carry))
        tokens, scores = _top_children(controlled(controls, logits[:, -width:]), frontier_scores, width)
        offset = sum(t.shape[1] for t in pool_tokens)
        pool_tokens.append(tokens.reshape(batch, -1))
        pool_scores.append(scores.reshape(batch, -1))
        pool_parents.append(jnp.repeat(frontier, width, axis=1))
        frontier_scores, chosen = jax.lax.top_k(scores.reshape(batch, -1), width)      # ties: lower index
        frontier, frontier_tokens = offset + chosen, tokens.reshape(batch, -1)[rows, chosen]
        parents = (level - 1) * width + chosen // width       # the expanding frontier slot's place
        frontier_carry = jax.tree.map(lambda c: jnp.take_along_axis(
            c, parents.reshape(batch, width, *(1,) * (c.ndim - 2)), axis=1), carry_out)
    all_tokens, all_scores, all_parents = (jnp.concatenate(x, axis=1) for x in (pool_tokens, pool_scores, pool_parents))
    _, picked = jax.lax.top_k(all_scores, tree.draft_nodes())      # rank order; a parent ranks before its child
    parent_pool = all_parents[rows, picked]
    is_parent = parent_pool[:, :, None] == picked[:, None, :]     # [B, N, N]
    node_parents = jnp.where(jnp.any(is_parent, axis=2), jnp.argmax(is_parent, axis=2), -1).astype(jnp.int32)
    if expanded:
        pool_of = jnp.concatenate(expanded, axis=1)                                    # [B, E]
        match = pool_of[:, :, None] == picked[:, None, :]
        node_of = jnp.where(jnp.any(match, axis=2), jnp.argmax(match, axis=2), -1).astype(jnp.int32)
    else:
        node_of = jnp.zeros((batch, 0), jnp.int32)
    return TreeProposal(all_tokens[rows, picked], node_parents, node_of, catch_up, last)


def tree_inputs(tokens: jax.Array, parents: jax.Array, cap: jax.Array, stop_ids: jax.Array
                ) -> tuple[jax.Array, jax.Array]:
    """(the target forward's ``tree_parents`` int32[B, N + 1] over [pending, nodes]; the acceptance's node
    parents int32[B, N]): nodes whose parent is not in [-1, i) hang off the root in the forward and are
    never accepted, nor are nodes deeper than ``cap`` int32[B] or below a node whose token is one of the
    request's ``stop_ids`` int32[B, S] (-1 = none), nor their descendants."""
    batch, n = tokens.shape
    index = jnp.arange(n, dtype=jnp.int32)[None, :]
    in_range = (parents >= -1) & (parents < index)
    forward_parents = jnp.concatenate([jnp.full((batch, 1), -1, jnp.int32),
                                       jnp.where(in_range, parents + 1, 0).astype(jnp.int32)], axis=1)
    full_mask = ancestor_mask(forward_parents)
    mask = full_mask[:, 1:, 1:]                                              # [B, N, N] node j is i or above i
    is_stop = jnp.any((tokens[:, :, None] == stop_ids[:, None, :]) & (stop_ids[:, None, :] >= 0), axis=2)
    below_stop = jnp.any(mask & ~jnp.eye(n, dtype=jnp.bool_)[None] & is_stop[:, None, :], axis=2)
    bad_above = jnp.any(mask & ~in_range[:, None, :], axis=2)
    too_deep = depths(full_mask)[:, 1:] > cap[:, None]
    keep = ~(below_stop | bad_above | too_deep)
    return forward_parents, jnp.where(keep, parents, index).astype(jnp.int32)   # parent = itself: ignored


def path_previous(recent: jax.Array, tokens: jax.Array, forward_parents: jax.Array, depth: jax.Array) -> jax.Array:
    """int32[B, N + 1, W]: after the pending token (0) and after each node i, the last W output tokens
    of the history: the path down to i (its ancestors and itself, ``depth`` int32[B, N + 1] of them)
    after the committed tokens' last (``recent`` int32[B, W]); ``tokens`` int32[B, N] the nodes',
    ``forward_parents`` int32[B, N + 1] the forward's parents (-1: the pending token's)."""
    width = recent.shape[1]
    tokens = jnp.concatenate([jnp.full((tokens.shape[0], 1), -1, jnp.int32), tokens.astype(jnp.int32)], axis=1)
    node = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    columns = []
    for back in range(width):                   # the latest token first: the node's, its parent's, ...
        committed = jnp.take_along_axis(recent, jnp.clip(width - 1 - (back - depth), 0, width - 1), axis=1)
        columns.append(jnp.where(back < depth, jnp.take_along_axis(tokens, node, axis=1), committed))
        node = jnp.maximum(jnp.take_along_axis(forward_parents, node, axis=1), 0)
    return jnp.stack(columns[::-1], axis=-1)


def accept_tree(logits: jax.Array, tokens: jax.Array, parents: jax.Array, keys: jax.Array, sampling: jax.Array,
                request_mask: jax.Array, *, max_depth: int, greedy: bool, backend: str,
                controls: LogitControls | None = None, forward_parents: jax.Array | None = None) -> TreeAcceptResult:
    """Stage 3: the acceptance of each request's tree against the target's logits float32[B, N + 1, V]
    (padding requests: nothing accepted, tokens -1). With ``controls`` (and the forward's
    ``forward_parents`` int32[B, N + 1]) the logits after node i take them with the path down to i
    (its ancestors and itself) in the history: what autoregressive decoding would see there."""
    batch, n = tokens.shape
    if controls is not None:
        full_mask = ancestor_mask(forward_parents)                                  # [B, N + 1, N + 1]
        # the nodes on each node's path (the pending token is committed): [B, N + 1, N]
        seen = jnp.where(full_mask[:, :, 1:], tokens[:, None, :], -1)
        depth = depths(full_mask)
        logits = controls.apply(logits, seen=seen, offsets=depth,
                                previous=path_previous(controls.recent, tokens, forward_parents, depth),
                                grammar_rows=jnp.broadcast_to(jnp.arange(n + 1, dtype=jnp.int32), (batch, n + 1)))
    num_nodes = jnp.full((batch,), n, jnp.int32)
    if greedy:
        result = accept_tree_greedy(tokens, parents, num_nodes, argmax_ignoring_nan(logits), max_depth=max_depth,
                                    backend=backend)
    else:
        probs = filtered_probs(logits, *sampling_filters(sampling), backend="xla")
        result = tree_rejection_sample(tokens, parents, num_nodes, probs, key=tagged_keys(keys, ACCEPT_TAG),
                                       max_depth=max_depth, backend="xla")
    live = request_mask[:, None]
    return TreeAcceptResult(jnp.where(live, result.output_token_ids, -1),
                            jnp.where(request_mask, result.num_accepted, 0),
                            jnp.where(live, result.accepted_nodes, -1))


def _commit(cache: PagedKVCache, keys: jax.Array, values: jax.Array, slots: jax.Array, mask: jax.Array,
            backend: str) -> PagedKVCache:
    """Commits rows of [layers, B, T, ...] K/V to ``slots`` int32[B, T] where ``mask`` bool[B, T]."""
    return sharded_commit_draft_kv(cache, flatten_rows(keys), flatten_rows(values), slots.reshape(-1),
                                   (mask & (slots >= 0)).reshape(-1), backend=backend)


def commit_draft_tree(draft_cache: PagedKVCache, proposal: TreeProposal, result: TreeAcceptResult,
                      block_tables: jax.Array, draft_lens: jax.Array, lag: jax.Array, request_mask: jax.Array, *,
                      block_size: int, backend: str) -> PagedKVCache:
    """Stage 4: the draft's catch-up tokens (positions ``draft_lens + s``, s < lag) and the accepted nodes at
    depths d < num_accepted - 1 (expanded, so in the last expansion forward) at ``draft_lens + lag + d``."""
    s = jnp.arange(MAX_CATCH_UP, dtype=jnp.int32)[None, :]
    positions = [draft_lens[:, None] + s]
    masks = [s < lag[:, None]]
    keys, values = [proposal.catch_up.keys], [proposal.catch_up.values]
    if proposal.last is not None:
        depth = jnp.arange(result.accepted_nodes.shape[1], dtype=jnp.int32)[None, :]
        node = proposal.expanded[:, :, None]                                   # [B, E, 1]
        on_path = ((node == result.accepted_nodes[:, None, :]) & (node >= 0)
                   & (depth[:, None, :] < (result.num_accepted - 1)[:, None, None]))   # [B, E, depth]
        positions.append(draft_lens[:, None] + lag[:, None] + jnp.argmax(on_path, axis=2).astype(jnp.int32))
        masks.append(jnp.any(on_path, axis=2))
        keys.append(proposal.last.keys)
        values.append(proposal.last.values)
    positions, mask = jnp.concatenate(positions, axis=1), jnp.concatenate(masks, axis=1) & request_mask[:, None]
    slots = slots_from_block_table(block_tables, positions, block_size)
    return _commit(draft_cache, jnp.concatenate(keys, axis=2), jnp.concatenate(values, axis=2), slots, mask, backend)


def score_tree(target, target_cache: PagedKVCache, block_tables: jax.Array, inputs: StepInputs, proposal,
               cap: jax.Array, *, backend: str, aux_layers: tuple[int, ...] | None = None) -> "TreeScored":
    """Stage 2 of a tree step: the target over ``[pending, nodes]`` with tree attention, each request
    accepting at most ``cap`` int32[B] nodes (``tree_inputs``); with the taps of ``aux_layers`` when given."""
    forward_parents, accept_parents = tree_inputs(proposal.tokens, proposal.parents, cap, inputs.stop_ids)
    taps = {} if aux_layers is None else dict(aux_layers=aux_layers)
    out = target.forward_paged(jnp.concatenate([inputs.pending[:, None], proposal.tokens], axis=1), target_cache,
                               block_tables, inputs.context_lens, tree_parents=forward_parents, backend=backend,
                               **taps)
    return TreeScored(out, accept_parents, forward_parents)


class TreeScored(NamedTuple):
    """A tree step's target forward over [pending, nodes] and the acceptance's node parents (a node that
    may not be accepted is its own parent, ``tree_inputs``)."""

    output: PagedForwardOutput
    accept_parents: jax.Array
    forward_parents: jax.Array


@dataclasses.dataclass(frozen=True)
class TreeVerifier:
    """Token trees of ``tree``'s shape: host trees int32[B, 2, N] or a draft model's (``draft_tree``), see
    the module docstring. k is the node count N."""

    tree: TreeConfig
    name = "tree"
    every_step = False

    def stages(self, k: int) -> "Verifier":
        return self if k else ChainVerifier()

    def prefill_step(self, target: SplitModel, draft: SplitModel | None, block_size: int):
        return make_prefill_step(target, draft, block_size)

    def drafts_shape(self, k: int) -> tuple[int, ...]:
        return (2, k)

    def check(self, *, k: int, logprobs: bool, packed_k: int) -> None:
        if logprobs:
            raise ValueError("tree decode_step: logprobs needs a chain step (DecoderConfig.tree=None)")
        if packed_k:
            raise ValueError(f"tree decode_step: packed_k needs a chain step (DecoderConfig.tree=None), got {packed_k}")

    def propose(self, draft, drafts, draft_cache, block_tables, inputs, sampling, *, k, greedy, backend
                ) -> TreeProposal:
        if drafts is None:
            return draft_tree(draft, draft_cache, block_tables, inputs.lag_tokens, inputs.lag, inputs.draft_lens,
                              tree=self.tree, backend=backend, controls=inputs.controls)
        return TreeProposal(drafts[:, 0].astype(jnp.int32), drafts[:, 1].astype(jnp.int32))

    def score(self, target, target_cache, block_tables, inputs, proposal, *, k, packed_k, backend) -> TreeScored:
        return score_tree(target, target_cache, block_tables, inputs, proposal,
                          jnp.minimum(inputs.num_drafts, self.tree.max_depth), backend=backend)

    def accept(self, target_cache, scored, proposal, inputs, sampling, block_tables, *, block_size, greedy,
               backend) -> tuple[PagedKVCache, StepSummary, Any]:
        result = accept_tree(scored.output.logits, proposal.tokens, scored.accept_parents, inputs.keys, sampling,
                             inputs.request_mask, max_depth=self.tree.max_depth, greedy=greedy, backend=backend,
                             controls=inputs.controls, forward_parents=scored.forward_parents)
        slots = accepted_path_slots(result, block_tables, inputs.context_lens, tree_size=proposal.tokens.shape[1],
                                    block_size=block_size)
        target_cache = _commit(target_cache, scored.output.keys, scored.output.values, slots,
                               inputs.request_mask[:, None], backend)
        verified = jnp.where(inputs.request_mask, jnp.clip(inputs.num_drafts, 0, self.tree.max_depth), 0)
        return target_cache, StepSummary.pack(result.output_token_ids, result.num_accepted, verified), result

    def commit_draft(self, draft_cache, proposal, scored, result, block_tables, inputs, *, block_size, backend
                     ) -> PagedKVCache:
        if proposal.catch_up is None:
            return draft_cache
        return commit_draft_tree(draft_cache, proposal, result, block_tables, inputs.draft_lens, inputs.lag,
                                 inputs.request_mask, block_size=block_size, backend=backend)
