"""The chain verifier of the decode step (a ``verifiers.Verifier``) over the step's ``StepInputs`` (B
requests, static k).

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

No cache receives a rejected token's K/V.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_batch import slot_owner
from scv_jax.decoding.device_step import (ACCEPT_TAG, BONUS_TAG, DRAFT_TAG, LogitControls, SplitModel, StepInputs,
                                          choose_tokens, commit_positions, controlled, drafts_previous, drafts_seen,
                                          flatten_rows, make_prefill_step, sampling_filters, tagged_keys)
from scv_jax.decoding.positions import draft_rows_committed
from scv_jax.decoding.verifiers import Verifier, row_at
from scv_jax.models.protocol import PackedTokens, PagedForwardOutput, StagedKV
from scv_jax.ops.commit.api import slots_from_block_table
from scv_jax.ops.commit.kv_cache import PagedKVCache
from scv_jax.ops.sampling.api import filtered_probs
from scv_jax.sharding.mesh import DATA, active_mesh
from scv_jax.verify.sharded import sharded_verify_step
from scv_jax.verify.summary import StepSummary


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


def swap_layers_and_batch(staged: Any) -> Any:
    """K/V ``[layers, B, ...]`` (a ``StagedKV``, or any record of ``keys`` and ``values``) as ``[B, layers,
    ...]`` and back (None stays None)."""
    if staged is None:
        return None
    return staged._replace(keys=jnp.swapaxes(staged.keys, 0, 1), values=jnp.swapaxes(staged.values, 0, 1))


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


def draft_chain(catch_up: PagedForwardOutput, first_logits: jax.Array, lag: jax.Array, forward, carry,
                keys: jax.Array, sampling: jax.Array, *, k: int, greedy: bool,
                controls: LogitControls | None = None) -> ChainProposal:
    """k > 0 drafts per request after a catch-up forward over each request's ``lag`` missing tokens (its
    K/V [layers, B, W, kv_heads, head_dim] staged first, request b's first ``lag[b]`` rows valid): the
    first from ``first_logits`` [B, V] (the catch-up's at row lag - 1), each next from ``forward(token int32[B], staged,
    carry) -> (logits [B, V], keys, values [layers, B, 1, ...], carry)`` over the staged K/V (a scan);
    ``carry`` is the drafter's own running value (an EAGLE head's hidden state; None for a draft model).
    The drafts' logits take the requests' ``controls`` as the target's do (draft j's history holds the
    drafts before it), and with ``controls.automaton`` each request's drafting automaton, moved along its
    drafts. The staged K/V come back ``[layers, B, W + k - 1, kv_heads, head_dim]``."""
    batch, width = lag.shape[0], catch_up.keys.shape[2]
    stage_shape = (catch_up.keys.shape[0], batch, width + k - 1, *catch_up.keys.shape[3:])
    stage_k = jnp.zeros(stage_shape, catch_up.keys.dtype).at[:, :, :width].set(catch_up.keys)
    stage_v = jnp.zeros(stage_shape, catch_up.values.dtype).at[:, :, :width].set(catch_up.values)
    automaton = None if controls is None else controls.automaton
    logits = controlled(controls, first_logits)
    if automaton is not None:
        logits = automaton.mask(logits, automaton.states)
    first, first_probs = choose_tokens(logits, tagged_keys(keys, DRAFT_TAG), sampling, greedy)
    states = None if automaton is None else automaton.advance(automaton.states, first)
    slots = jnp.arange(stage_shape[2], dtype=jnp.int32)
    # the drafts so far (-1: none yet), and the last output tokens with them
    seen = None if controls is None else jnp.full((batch, max(k - 1, 1)), -1, jnp.int32)
    previous = None if controls is None else controls.recent

    def one_draft(state, j):
        stage_k, stage_v, lengths, token, seen, previous, states, carry = state
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
        if automaton is not None:
            logits = automaton.mask(logits, states)
        nxt, probs = choose_tokens(logits, tagged_keys(keys, DRAFT_TAG + j), sampling, greedy)
        if automaton is not None:
            states = automaton.advance(states, nxt)
        return (stage_k, stage_v, lengths + 1, nxt, seen, previous, states, carry), (nxt, probs)

    (stage_k, stage_v, lengths, *_), (rest, rest_probs) = jax.lax.scan(
        one_draft, (stage_k, stage_v, lag, first, seen, previous, states, carry), jnp.arange(1, k))
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


def greedy_ids(logits: jax.Array) -> jax.Array:
    """int32[...] the argmax of float[..., V] ``logits`` (the first of tied maxima)."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


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
        target_ids = lambda: compact_drafts(greedy_ids(scored.logits[:, :k]), source)  # noqa: E731
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
        target_ids = lambda: greedy_ids(scored.logits)[token_of_slot]  # noqa: E731
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
    if greedy:        # the target's argmax at each draft slot (the argmax before the slots are gathered: ids, not logits)
        acceptance = dict(target_token_ids=target_ids() if k else jnp.zeros((0,), jnp.int32))
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


class DraftModelVerifier:
    """What the verifiers of host drafts or a draft model's (not an EAGLE head's) share: their prefill
    (``make_prefill_step``) and their k = 0 steps (a ``ChainVerifier``'s, with no drafts)."""

    every_step = False

    def stages(self, k: int) -> "Verifier":
        return self if k else ChainVerifier()

    def prefill_step(self, target: SplitModel, draft: SplitModel | None, block_size: int):
        return make_prefill_step(target, draft, block_size)


@dataclasses.dataclass(frozen=True)
class ChainVerifier(DraftModelVerifier):
    """Chains of drafts: host drafts int32[B, k] or a draft model's (``propose``), see the module docstring."""

    name = "chain"

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

    def passed(self, proposal: ChainProposal) -> ChainProposal:
        """The staged K/V batch-major, ``[B, layers, W, kv_heads, head_dim]`` (every leaf's axis 0 the batch:
        the proposal passes between a split step's calls padded as one argument)."""
        return proposal._replace(staged=swap_layers_and_batch(proposal.staged))

    def received(self, passed: ChainProposal, draft) -> ChainProposal:
        return passed._replace(staged=swap_layers_and_batch(passed.staged))

    def commit_draft(self, draft_cache, proposal, scored, result, block_tables, inputs, *, block_size, backend
                     ) -> PagedKVCache:
        if proposal.staged is None:
            return draft_cache
        return commit_draft(draft_cache, proposal, block_tables, inputs.draft_lens, inputs.lag, result.num_accepted,
                            inputs.request_mask, block_size=block_size, backend=backend, after=result.summary.packed)
