"""Device side of the decoding loop: the prefill and decode-step functions, pure functions of the
models' ``nnx.split`` states that graph mode compiles per shape bucket.

A decode step with k drafts (k may be 0) is one straight sequence of stages; ``positions`` says where
each request's tokens are:

1. ``propose``: the draft runs its lag tokens (one catch-up forward), then k - 1 one-token forwards,
   reading its cache plus a staging buffer of the step's earlier tokens; it writes no cache.
2. ``score``: the target runs [pending, d_1 .. d_k] over its cache, causally among them.
3. ``accept_and_commit``: greedy match or lossless rejection sampling, and the commit of the target's
   K/V for the pending token and the accepted drafts (``verify_step``, query layout).
4. ``commit_draft``: the draft's staged K/V up to the last accepted draft.
No cache receives a rejected token's K/V. The host then fetches the step's ``StepSummary`` and adapts k.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.sampling_math import argmax_ignoring_nan
from scv_jax.decoding.positions import MAX_CATCH_UP, draft_rows_committed
from scv_jax.models.protocol import PagedForwardOutput, StagedKV
from scv_jax.ops.commit.api import slots_from_block_table
from scv_jax.ops.commit.kv_cache import PagedKVCache
from scv_jax.ops.commit.sharded import sharded_commit_draft_kv
from scv_jax.verify.sharded import sharded_verify_step

# fold_in tags of a request's per-step key
_ACCEPT, _BONUS, _DRAFT = 0, 1, 2


def request_keys(base_key: jax.Array, request_ids: jax.Array, positions: jax.Array) -> jax.Array:
    """[B] typed keys: ``fold_in(fold_in(key, request id), position)``; independent of the batch."""
    base = jax.random.wrap_key_data(base_key)
    return jax.vmap(lambda r, p: jax.random.fold_in(jax.random.fold_in(base, r), p))(
        request_ids.astype(jnp.uint32), positions.astype(jnp.uint32))


def _tagged(keys: jax.Array, tag: int) -> jax.Array:
    return jax.vmap(lambda key: jax.random.fold_in(key, tag))(keys)


def choose_tokens(logits: jax.Array, keys: jax.Array, temperature: jax.Array, greedy: bool):
    """Next tokens from float[B, V] logits: the argmax (probs None; the first index of the maximum, NaN
    never winning, as in the fused greedy acceptance) or a sample with its probs [B, V]."""
    if greedy:
        return argmax_ignoring_nan(logits), None
    scaled = logits / temperature
    tokens = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
    return tokens, jax.nn.softmax(scaled, axis=-1)


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


def make_prefill_step(target_graphdef, draft_graphdef, block_size: int):
    """``prefill_step(...)``: runs a chunk of prompt tokens through both models and commits it."""

    def prefill_step(target_state, draft_state, target_cache, draft_cache, block_tables, tokens, start,
                     count, request_mask=None, *, backend: str = "auto"):
        """tokens int32[B, C] at positions start[b] + t; rows t < count[b] of masked-in requests commit."""
        if request_mask is not None:
            count = jnp.where(request_mask, count, 0)
        models = [(target_graphdef, target_state, target_cache)]
        if draft_state is not None:
            models.append((draft_graphdef, draft_state, draft_cache))
        caches = []
        for graphdef, state, cache in models:
            out = nnx.merge(graphdef, state).forward_paged(tokens, cache, block_tables, start, backend=backend)
            caches.append(commit_positions(cache, out.keys, out.values, block_tables, start, count,
                                           block_size, backend, after=out.logits))
        return caches[0], (caches[1] if draft_state is not None else draft_cache)

    return prefill_step


class Proposal(NamedTuple):
    """What the draft proposes in one step.

    Attributes:
      tokens: int32[B, k] drafts (k = 0: none).
      probs: float32[B, k, V] their probabilities (None when greedy or without a draft model).
      staged: the draft's staged K/V, ``[layers, B, max(k + 1, MAX_CATCH_UP), kv_heads, head_dim]``:
        entry s is position ``draft_lens + s`` (None without a draft model).
    """

    tokens: jax.Array
    probs: jax.Array | None
    staged: StagedKV | None


def propose(draft, draft_cache: PagedKVCache | None, block_tables: jax.Array, lag_tokens: jax.Array,
            lag: jax.Array, draft_lens: jax.Array, keys: jax.Array, temperature: jax.Array, *, k: int,
            greedy: bool, backend: str) -> Proposal:
    """Stage 1: the catch-up forward over the lag tokens, then k - 1 one-token draft forwards (a scan)."""
    batch = lag_tokens.shape[0]
    if draft is None:
        return Proposal(jnp.zeros((batch, 0), jnp.int32), None, None)
    out = draft.forward_paged(lag_tokens, draft_cache, block_tables, draft_lens, backend=backend)
    stage_shape = (out.keys.shape[0], batch, max(k + 1, MAX_CATCH_UP), *out.keys.shape[3:])
    stage_k = jnp.zeros(stage_shape, out.keys.dtype).at[:, :, :MAX_CATCH_UP].set(out.keys)
    stage_v = jnp.zeros(stage_shape, out.values.dtype).at[:, :, :MAX_CATCH_UP].set(out.values)
    if k == 0:
        return Proposal(jnp.zeros((batch, 0), jnp.int32), None, StagedKV(stage_k, stage_v, lag))
    logits = jnp.take_along_axis(out.logits, (lag - 1)[:, None, None], axis=1)[:, 0]
    first, first_probs = choose_tokens(logits, _tagged(keys, _DRAFT), temperature, greedy)
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
        nxt, probs = choose_tokens(o.logits[:, 0], _tagged(keys, _DRAFT + j), temperature, greedy)
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


def accept_and_commit(target_cache: PagedKVCache, scored: PagedForwardOutput, proposal: Proposal,
                      keys: jax.Array, temperature: jax.Array, block_tables: jax.Array,
                      context_lens: jax.Array, request_mask: jax.Array, *, block_size: int, greedy: bool,
                      backend: str):
    """Stage 3: acceptance of the drafts against the target, then the commit of the target's K/V for
    the pending token and the accepted drafts. Returns (target_cache, ``VerifyStepOutput``)."""
    batch, k = proposal.tokens.shape
    positions = context_lens[:, None] + jnp.arange(k + 1, dtype=jnp.int32)
    slots = slots_from_block_table(block_tables, positions, block_size).reshape(-1)
    bonus, _ = choose_tokens(scored.logits[:, k], _tagged(keys, _BONUS), temperature, greedy)
    # the commit writes the cache as it is after every read (the bonus token comes from the last
    # logits): with k = 0 the acceptance does not depend on them, and XLA:CPU would copy the donated
    # cache instead of updating it in place (tests/decoding: test_decode_steps_update_the_caches_in_place)
    target_cache, _ = jax.lax.optimization_barrier((target_cache, bonus))
    vocab = scored.logits.shape[-1]
    if greedy:
        acceptance = dict(target_logits=scored.logits[:, :k].reshape(batch * k, vocab))
    else:
        target_probs = jax.nn.softmax(scored.logits[:, :k] / temperature, axis=-1)
        acceptance = dict(target_probs=target_probs.reshape(batch * k, vocab),
                          draft_probs=None if proposal.probs is None else proposal.probs.reshape(batch * k, vocab),
                          key=_tagged(keys, _ACCEPT))
    return sharded_verify_step(target_cache, _flatten_rows(scored.keys), _flatten_rows(scored.values), slots,
                               proposal.tokens.reshape(-1), jnp.arange(batch + 1, dtype=jnp.int32) * k, bonus,
                               request_mask=request_mask, max_spec_len=k, kv_layout="query", backend=backend,
                               **acceptance)


def commit_draft(draft_cache: PagedKVCache, proposal: Proposal, block_tables: jax.Array,
                 draft_lens: jax.Array, lag: jax.Array, num_accepted: jax.Array, request_mask: jax.Array, *,
                 block_size: int, backend: str, after: jax.Array) -> PagedKVCache:
    """Stage 4: the draft's staged K/V of its lag tokens and its accepted drafts (``positions``)."""
    rows = jnp.where(request_mask, draft_rows_committed(lag, num_accepted, proposal.tokens.shape[1]), 0)
    return commit_positions(draft_cache, proposal.staged.keys, proposal.staged.values, block_tables, draft_lens,
                            rows, block_size, backend, after=after)


def make_decode_step(target_graphdef, draft_graphdef, block_size: int):
    """``decode_step(...)``: one speculative step (plain autoregressive decoding without a draft)."""

    def decode_step(target_state, draft_state, target_cache, draft_cache, block_tables, lag_tokens, lag,
                    context_lens, request_ids, base_key, temperature, request_mask=None, *, k: int,
                    greedy: bool, backend: str = "auto"):
        """One decoding step of B requests (see ``scv_jax.decoding.positions``).

        Args:
          block_tables: int32[B, max_blocks] (-1 = none); shared by both caches.
          lag_tokens: int32[B, MAX_CATCH_UP] the tokens the draft cache lacks (``lag`` of them,
            left-aligned); the pending token is ``lag_tokens[b, lag[b] - 1]``.
          lag: int32[B] in [1, MAX_CATCH_UP]; context_lens: int32[B] positions in the target cache.
          request_ids: int32[B] ids seeding each request's random stream; base_key: uint32[2] key data.
          temperature: float32 scalar (unused when greedy); request_mask: bool[B], False = padding.
          k: drafts per request (static); greedy: argmax decoding (static).
        Returns:
          (target_cache, draft_cache, ``StepSummary``).
        """
        if draft_state is None and k:
            raise ValueError("decode_step: k > 0 needs a draft model")
        if request_mask is None:
            request_mask = jnp.ones((lag.shape[0],), jnp.bool_)
        keys = request_keys(base_key, request_ids, context_lens)
        draft = None if draft_state is None else nnx.merge(draft_graphdef, draft_state)
        draft_lens = context_lens + 1 - lag
        proposal = propose(draft, draft_cache, block_tables, lag_tokens, lag, draft_lens, keys, temperature,
                           k=k, greedy=greedy, backend=backend)
        pending = jnp.take_along_axis(lag_tokens, (lag - 1)[:, None], axis=1)[:, 0]
        scored = score(nnx.merge(target_graphdef, target_state), target_cache, block_tables, pending,
                       proposal.tokens, context_lens, backend=backend)
        target_cache, result = accept_and_commit(target_cache, scored, proposal, keys, temperature, block_tables,
                                                 context_lens, request_mask, block_size=block_size,
                                                 greedy=greedy, backend=backend)
        if draft is not None:
            draft_cache = commit_draft(draft_cache, proposal, block_tables, draft_lens, lag, result.num_accepted,
                                       request_mask, block_size=block_size, backend=backend,
                                       after=result.summary.packed)
        return target_cache, draft_cache, result.summary

    return decode_step
