"""Mosaic GPU kernels: the recovered token of each request that rejected a draft.

Only a request's first rejected slot emits a sample of norm(max(p - q, 0)), so after the accept scan
(``accept_scan``) has found it, the race runs on that one row per request: B rows of p and q are read
instead of T (k times less at k drafts per request), and requests that accepted every draft read
nothing. Grid (B, S): CTA (b, s) streams split s of request b's rejected row
(``vocab_tiles.stream_best``) with race scores w_v / E_v (``sampling_math``); a second, tiny kernel
combines the S split winners and writes the token into the scan's output in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.platform import interpret_params
from pallas_kernels.ragged_batch import request_span
from pallas_kernels.sampling_math import race_scores, race_weights
from pallas_kernels.vocab_tiles import SplitPlan, combine_splits, pad_vocab, plan_splits, stream_best


def _rejected_row(cu_ref, num_accepted_ref, b, num_slots: int, max_spec_len: int):
    """(request b rejected a draft?, the slot of its first rejection, clamped into [0, T))."""
    start, count = request_span(cu_ref[b], cu_ref[b + 1], num_slots, max_spec_len)
    accepted = num_accepted_ref[b]
    return accepted < count, jnp.minimum(start + accepted, num_slots - 1), accepted


def _race_body(plan: SplitPlan, num_slots: int, max_spec_len: int, has_draft_probs: bool,
               cu_ref, num_accepted_ref, seed_ref, draft_ref, target_ref, *refs):
    *draft_probs_ref, score_ref, index_ref = refs
    b = lax.axis_index("b")
    s = lax.axis_index("s")
    rejected, row, _ = _rejected_row(cu_ref, num_accepted_ref, b, num_slots, max_spec_len)
    seed = seed_ref[row]
    draft = draft_ref[row]

    def scores(load_start, token_ids):
        p = target_ref[row, pl.ds(load_start, plan.tile)]
        if has_draft_probs:
            q = draft_probs_ref[0][row, pl.ds(load_start, plan.tile)]
        else:
            q = (token_ids == draft).astype(jnp.float32)
        return race_scores(race_weights(p, q), seed, token_ids)

    best, index = stream_best(scores, plan, s, rejected)
    score_ref[b, s] = best
    index_ref[b, s] = index


def _place_body(num_slots: int, max_spec_len: int, num_splits: int, cu_ref, num_accepted_ref,
                score_ref, index_ref, tokens_ref):
    b = lax.axis_index("b")
    rejected, _, accepted = _rejected_row(cu_ref, num_accepted_ref, b, num_slots, max_spec_len)

    @pl.when(rejected)
    def _():
        _, token = combine_splits(lambda s: score_ref[b, s], lambda s: index_ref[b, s], num_splits)
        tokens_ref[b, accepted] = token


def recover_rejected_tokens(tokens: jax.Array, num_accepted: jax.Array, cu: jax.Array,
                            draft_token_ids: jax.Array, draft_probs: jax.Array | None,
                            target_probs: jax.Array, seeds: jax.Array, *, max_spec_len: int,
                            num_splits: int | None = None, interpret: bool = False) -> jax.Array:
    """Writes each rejecting request's recovered token at ``tokens[b, num_accepted[b]]``.

    Args:
      tokens: int32[B, max_spec_len + 1] from the sampling accept scan; num_accepted: int32[B].
      cu: int32[B + 1]; draft_token_ids: int32[T]; seeds: uint32[T] per-slot race seeds.
      draft_probs: float[T, V] or None (q = one-hot(draft)); target_probs: float[T, V].
      num_splits: vocabulary splits per request (default: fill the GPU); results do not depend on it.
    Returns:
      ``tokens`` with the recovered tokens written (requests without a rejection are unchanged).
    """
    num_requests = num_accepted.shape[0]
    num_slots, vocab_size = target_probs.shape
    plan = plan_splits(num_requests, vocab_size, num_splits)
    target_probs, draft_probs = pad_vocab(target_probs, plan), pad_vocab(draft_probs, plan)
    body = functools.partial(_race_body, plan, num_slots, max_spec_len, draft_probs is not None)
    inputs = (cu, num_accepted, seeds, draft_token_ids, target_probs)
    inputs += () if draft_probs is None else (draft_probs,)
    out_type = (jax.ShapeDtypeStruct((num_requests, plan.num_splits), jnp.float32),
                jax.ShapeDtypeStruct((num_requests, plan.num_splits), jnp.int32))
    scores, indices = plgpu.kernel(body, out_type=out_type, grid=(num_requests, plan.num_splits),
                                   grid_names=("b", "s"), interpret=interpret_params(interpret))(*inputs)
    tokens_ref = jax.new_ref(tokens)
    place = functools.partial(_place_body, num_slots, max_spec_len, plan.num_splits)
    plgpu.kernel(place, out_type=(), grid=(num_requests,), grid_names=("b",),
                 interpret=interpret_params(interpret))(cu, num_accepted, scores, indices, tokens_ref)
    return jax.freeze(tokens_ref)
