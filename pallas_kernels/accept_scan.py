"""Mosaic GPU kernel: the sequential accept/reject scan over each request's drafts.

One CTA per request walks its drafts in order (at most ``max_spec_len`` scalar steps), stops at the
first rejection, writes the request's row of ``output_token_ids`` and its ``accept_mask`` slots, and
emits the bonus token when every draft was accepted. Slots past the last request (padding) are
cleared by all CTAs in a strided loop. The greedy and the sampling variants differ only in the
per-draft test and in the token emitted on rejection.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.platform import interpret_params
from pallas_kernels.ragged_batch import request_span
from pallas_kernels.sampling_math import accepts_draft

# (slot index, draft id) -> (draft accepted?, token emitted if accepted, token emitted if rejected)
SlotRule = Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array, jax.Array]]


def _scan_body(rule_factory, num_requests: int, num_slots: int, max_spec_len: int,
               cu_ref, draft_ref, bonus_ref, *refs):
    *rule_refs, out_ref, num_accepted_ref, mask_ref = refs
    rule: SlotRule = rule_factory(*rule_refs)
    b = lax.axis_index("b")
    start, count = request_span(cu_ref[b], cu_ref[b + 1], num_slots, max_spec_len)

    def step(i, carry):
        alive, num_accepted = carry
        in_request = i < count
        slot = jnp.minimum(start + i, num_slots - 1)
        accepted, on_accept, on_reject = rule(slot, draft_ref[slot])
        emitting = alive & in_request
        out_ref[b, i] = jnp.where(emitting, jnp.where(accepted, on_accept, on_reject), -1)
        still_alive = emitting & accepted

        @pl.when(in_request)
        def _():
            mask_ref[slot] = still_alive.astype(jnp.int32)

        return still_alive, num_accepted + still_alive.astype(jnp.int32)

    _, num_accepted = lax.fori_loop(0, max_spec_len, step, (jnp.bool_(True), jnp.int32(0)))
    out_ref[b, max_spec_len] = -1

    @pl.when(num_accepted == count)
    def _():
        out_ref[b, count] = bonus_ref[b]

    num_accepted_ref[b] = num_accepted

    padding_start = jnp.clip(cu_ref[num_requests], 0, num_slots)
    num_rounds = -(-num_slots // num_requests)

    def clear_padding(r, _):
        slot = padding_start + r * num_requests + b

        @pl.when(slot < num_slots)
        def _():
            mask_ref[slot] = jnp.int32(0)

    lax.fori_loop(0, num_rounds, clear_padding, None)


def _run_scan(rule_factory, cu, draft_token_ids, bonus_token_ids, rule_inputs, *, max_spec_len: int,
              interpret: bool):
    num_requests = bonus_token_ids.shape[0]
    num_slots = draft_token_ids.shape[0]
    out_type = (jax.ShapeDtypeStruct((num_requests, max_spec_len + 1), jnp.int32),
                jax.ShapeDtypeStruct((num_requests,), jnp.int32),
                jax.ShapeDtypeStruct((num_slots,), jnp.int32))
    body = functools.partial(_scan_body, rule_factory, num_requests, num_slots, max_spec_len)
    tokens, num_accepted, mask = plgpu.kernel(
        body, out_type=out_type, grid=(num_requests,), grid_names=("b",),
        interpret=interpret_params(interpret))(cu, draft_token_ids, bonus_token_ids, *rule_inputs)
    return tokens, num_accepted, mask.astype(jnp.bool_)


def _greedy_rule(target_ref) -> SlotRule:
    def rule(slot, draft):
        target = target_ref[slot]
        return draft == target, target, target
    return rule


def accept_greedy_kernel(draft_token_ids: jax.Array, cu: jax.Array, target_token_ids: jax.Array,
                         bonus_token_ids: jax.Array, *, max_spec_len: int, interpret: bool = False):
    """Greedy acceptance. Inputs int32 [T], [B + 1], [T], [B]; see ``scv_jax.accept_greedy``."""
    return _run_scan(_greedy_rule, cu, draft_token_ids, bonus_token_ids, (target_token_ids,),
                     max_spec_len=max_spec_len, interpret=interpret)


def _sampling_rule(vocab_size: int, num_splits: int, has_draft_probs: bool):
    def factory(uniform_ref, score_ref, index_ref, target_ref, *draft_ref):
        def rule(slot, draft):
            in_vocab = (draft >= 0) & (draft < vocab_size)
            safe_draft = jnp.clip(draft, 0, vocab_size - 1)
            p_draft = target_ref[slot, safe_draft]
            q_draft = draft_ref[0][slot, safe_draft] if has_draft_probs else jnp.float32(1.0)
            accepted = accepts_draft(uniform_ref[slot], p_draft, q_draft, in_vocab)

            def best_split(s, carry):
                best_score, best_index = carry
                score = score_ref[slot, s]
                better = score > best_score
                return jnp.where(better, score, best_score), jnp.where(better, index_ref[slot, s], best_index)

            _, recovered = lax.fori_loop(0, num_splits, best_split, (jnp.float32(-1.0), jnp.int32(0)))
            return accepted, draft, recovered
        return rule
    return factory


def rejection_scan_kernel(draft_token_ids: jax.Array, cu: jax.Array, draft_probs: jax.Array | None,
                          target_probs: jax.Array, bonus_token_ids: jax.Array, uniforms: jax.Array,
                          split_scores: jax.Array, split_indices: jax.Array, *, max_spec_len: int,
                          interpret: bool = False):
    """Rejection-sampling acceptance given the recovered-token race winners of each vocab split.

    Args:
      draft_probs: float[T, V] or None; target_probs: float[T, V]; uniforms: float32[T].
      split_scores, split_indices: float32/int32[T, S] from ``recovered_token_splits``.
    """
    rule = _sampling_rule(target_probs.shape[1], split_scores.shape[1], draft_probs is not None)
    rule_inputs = (uniforms, split_scores, split_indices, target_probs)
    if draft_probs is not None:
        rule_inputs += (draft_probs,)
    return _run_scan(rule, cu, draft_token_ids, bonus_token_ids, rule_inputs,
                     max_spec_len=max_spec_len, interpret=interpret)
