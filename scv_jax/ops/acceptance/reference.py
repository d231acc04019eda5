"""Pure-JAX references of the acceptance ops (also the ``backend="xla"`` implementation)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from scv_jax.ops.acceptance.result import AcceptResult
from pallas_kernels.ragged_batch import request_spans, slot_owner
from pallas_kernels.sampling_math import accepts_draft, argmax_ignoring_nan, race_scores, race_weights


def _per_request(values: jax.Array, starts: jax.Array, max_spec_len: int) -> jax.Array:
    """Gathers a [T] slot array into [B, max_spec_len] (clamped indices; mask separately)."""
    if values.shape[0] == 0:
        return jnp.zeros((starts.shape[0], max_spec_len), values.dtype)
    idx = starts[:, None] + jnp.arange(max_spec_len, dtype=jnp.int32)[None, :]
    return values[jnp.clip(idx, 0, values.shape[0] - 1)]


def accepted_prefix(accepted: jax.Array, cu: jax.Array, num_slots: int,
                    max_spec_len: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """int32[B] starts, counts and accepted drafts (the length of each request's prefix of slots
    with ``accepted`` True), from bool[T] per-slot decisions and int32[B + 1] offsets."""
    starts, counts = request_spans(cu, num_slots, max_spec_len)
    position = jnp.arange(max_spec_len, dtype=jnp.int32)[None, :]
    passes = _per_request(accepted, starts, max_spec_len) & (position < counts[:, None])
    return starts, counts, jnp.sum(jnp.cumprod(passes.astype(jnp.int32), axis=1), axis=1)


def assemble_result(accepted: jax.Array, emit_if_accepted: jax.Array, emit_if_rejected: jax.Array,
                    bonus_token_ids: jax.Array, cu: jax.Array, num_slots: int,
                    max_spec_len: int) -> AcceptResult:
    """Turns per-slot decisions into an ``AcceptResult``.

    Args:
      accepted: bool[T]; whether each draft passes its own test (ignoring earlier drafts).
      emit_if_accepted: int32[T]; the token emitted when the slot's draft is accepted.
      emit_if_rejected: int32[T]; the token emitted when it is the first rejected draft.
      bonus_token_ids: int32[B]; emitted after a request's drafts when all were accepted.
      cu: int32[B + 1] offsets.
    """
    k = max_spec_len
    starts, counts, num_accepted = accepted_prefix(accepted, cu, num_slots, k)
    position = jnp.arange(k, dtype=jnp.int32)[None, :]
    in_request = position < counts[:, None]                                        # [B, K]
    on_accept = _per_request(emit_if_accepted, starts, k)
    on_reject = _per_request(emit_if_rejected, starts, k)
    tokens = jnp.where(position < num_accepted[:, None], on_accept, on_reject)
    tokens = jnp.where(position <= num_accepted[:, None], tokens, -1)
    tokens = jnp.where(in_request, tokens, -1)
    tokens = jnp.concatenate([tokens, jnp.full((tokens.shape[0], 1), -1, jnp.int32)], axis=1)
    all_accepted = num_accepted == counts
    rows = jnp.arange(tokens.shape[0])
    tokens = tokens.at[rows, counts].set(jnp.where(all_accepted, bonus_token_ids, tokens[rows, counts]))

    owner, slot_pos = slot_owner(cu, num_slots)
    slot_ids = jnp.arange(num_slots, dtype=jnp.int32)
    owned = (slot_ids >= starts[owner]) & (slot_pos < counts[owner])
    accept_mask = owned & (slot_pos < num_accepted[owner])
    return AcceptResult(tokens.astype(jnp.int32), num_accepted.astype(jnp.int32), accept_mask)


def accept_greedy_reference(draft_token_ids: jax.Array, cu: jax.Array, target_token_ids: jax.Array,
                            bonus_token_ids: jax.Array, *, max_spec_len: int) -> AcceptResult:
    """Greedy acceptance: emit target tokens up to and including the first mismatch."""
    matches = draft_token_ids == target_token_ids
    return assemble_result(matches, target_token_ids, target_token_ids, bonus_token_ids, cu,
                           draft_token_ids.shape[0], max_spec_len)


def accept_greedy_from_logits_reference(draft_token_ids: jax.Array, cu: jax.Array, target_logits: jax.Array,
                                        bonus_token_ids: jax.Array, *, max_spec_len: int) -> AcceptResult:
    """Greedy acceptance against the argmax of ``target_logits`` float[T, V]: the first index of the
    row maximum, NaN never winning (``argmax_ignoring_nan``)."""
    return accept_greedy_reference(draft_token_ids, cu, argmax_ignoring_nan(target_logits), bonus_token_ids,
                                   max_spec_len=max_spec_len)


def draft_prob_rows(draft_probs: jax.Array | None, draft_token_ids: jax.Array,
                    vocab_size: int) -> jax.Array:
    """q as float32[T, V]; a draft without a distribution proposes its token with probability 1."""
    if draft_probs is None:
        return jax.nn.one_hot(draft_token_ids, vocab_size, dtype=jnp.float32)
    return draft_probs.astype(jnp.float32)


def recovered_tokens_reference(draft_token_ids: jax.Array, draft_probs: jax.Array | None,
                               target_probs: jax.Array, seeds: jax.Array) -> jax.Array:
    """int32[R]: for each row, a sample from norm(max(p - q, 0)) drawn with its seed (uint32[R]): the
    winner of the exponential race (``argmax_ignoring_nan`` of the race scores)."""
    vocab_size = target_probs.shape[1]
    weights = race_weights(target_probs, draft_prob_rows(draft_probs, draft_token_ids, vocab_size))
    token_ids = jnp.arange(vocab_size, dtype=jnp.int32)[None, :]
    return argmax_ignoring_nan(race_scores(weights, seeds[:, None], token_ids))


def draft_acceptance(draft_token_ids: jax.Array, draft_probs: jax.Array | None,
                     target_probs: jax.Array, uniforms: jax.Array) -> jax.Array:
    """bool[T]: whether each draft passes u < p(x) / q(x) on its own."""
    vocab_size = target_probs.shape[1]
    in_vocab = (draft_token_ids >= 0) & (draft_token_ids < vocab_size)
    safe_ids = jnp.clip(draft_token_ids, 0, vocab_size - 1)[:, None]
    p_draft = jnp.take_along_axis(target_probs, safe_ids, axis=1)[:, 0]
    q_draft = (jnp.ones_like(p_draft) if draft_probs is None
               else jnp.take_along_axis(draft_probs, safe_ids, axis=1)[:, 0])
    return accepts_draft(uniforms, p_draft, q_draft, in_vocab)


def rejection_sample_reference(draft_token_ids: jax.Array, cu: jax.Array,
                               draft_probs: jax.Array | None, target_probs: jax.Array,
                               bonus_token_ids: jax.Array, uniforms: jax.Array, seeds: jax.Array,
                               *, max_spec_len: int) -> AcceptResult:
    """Lossless rejection sampling given per-slot uniforms (float32[T]) and seeds (uint32[T]).

    The recovered token is computed only at each request's first rejected slot (the only one
    emitted): B rows of p and q are read instead of T when B < T.
    """
    num_slots = draft_token_ids.shape[0]
    accepted = draft_acceptance(draft_token_ids, draft_probs, target_probs, uniforms)
    if bonus_token_ids.shape[0] >= num_slots:
        recovered = recovered_tokens_reference(draft_token_ids, draft_probs, target_probs, seeds)
    else:
        starts, counts, num_accepted = accepted_prefix(accepted, cu, num_slots, max_spec_len)
        rows = jnp.minimum(starts + num_accepted, num_slots - 1)
        row_tokens = recovered_tokens_reference(draft_token_ids[rows],
                                                None if draft_probs is None else draft_probs[rows],
                                                target_probs[rows], seeds[rows])
        rejected_rows = jnp.where(num_accepted < counts, rows, num_slots)
        recovered = jnp.zeros((num_slots,), jnp.int32).at[rejected_rows].set(row_tokens, mode="drop")
    return assemble_result(accepted, draft_token_ids, recovered, bonus_token_ids, cu, num_slots, max_spec_len)
