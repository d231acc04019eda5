"""Mosaic GPU kernel: the sequential accept/reject scan over each request's drafts.

One CTA per request walks its drafts in order (at most ``max_spec_len`` scalar steps), stops at the
first rejection, writes the request's row of ``output_token_ids`` and its bool ``accept_mask`` slots
(straight from the kernel), and emits the bonus token when every draft was accepted. Slots past the
last request (padding) are cleared by all CTAs in a strided loop. The variants differ only in the
per-draft test and in the token emitted on rejection:

* greedy: target token ids given;
* greedy from logits: the target id of a slot is the combined winner of ``target_argmax``'s splits;
* sampling: u < p(x) / q(x); the rejected slot's token is left at -1 and written afterwards by
  ``recovered_tokens.recover_rejected_tokens``, which samples only the rejected rows.
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
from pallas_kernels.target_argmax import argmax_splits
from pallas_kernels.vocab_tiles import combine_splits

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
            mask_ref[slot] = still_alive

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
            mask_ref[slot] = jnp.bool_(False)

    lax.fori_loop(0, num_rounds, clear_padding, None)


def _run_scan(rule_factory, cu, draft_token_ids, bonus_token_ids, rule_inputs, *, max_spec_len: int,
              interpret: bool):
    num_requests = bonus_token_ids.shape[0]
    num_slots = draft_token_ids.shape[0]
    out_type = (jax.ShapeDtypeStruct((num_requests, max_spec_len + 1), jnp.int32),
                jax.ShapeDtypeStruct((num_requests,), jnp.int32),
                jax.ShapeDtypeStruct((num_slots,), jnp.bool_))
    body = functools.partial(_scan_body, rule_factory, num_requests, num_slots, max_spec_len)
    return plgpu.kernel(body, out_type=out_type, grid=(num_requests,), grid_names=("b",),
                        interpret=interpret_params(interpret))(cu, draft_token_ids, bonus_token_ids,
                                                               *rule_inputs)


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


def _logits_rule(num_splits: int):
    def factory(max_ref, index_ref) -> SlotRule:
        def rule(slot, draft):
            _, target = combine_splits(lambda s: max_ref[slot, s], lambda s: index_ref[slot, s], num_splits)
            return draft == target, target, target
        return rule
    return factory


def accept_greedy_from_logits_kernel(draft_token_ids: jax.Array, cu: jax.Array, target_logits: jax.Array,
                                     bonus_token_ids: jax.Array, *, max_spec_len: int,
                                     num_splits: int | None = None, interpret: bool = False):
    """Greedy acceptance against the argmax of ``target_logits`` float[T, V] (first index of the
    maximum, NaN never wins), read once; other inputs as ``accept_greedy_kernel``."""
    maxima, indices = argmax_splits(target_logits, num_splits=num_splits, interpret=interpret)
    return _run_scan(_logits_rule(maxima.shape[1]), cu, draft_token_ids, bonus_token_ids, (maxima, indices),
                     max_spec_len=max_spec_len, interpret=interpret)


def _sampling_rule(vocab_size: int, has_draft_probs: bool):
    def factory(uniform_ref, target_ref, *draft_ref) -> SlotRule:
        def rule(slot, draft):
            in_vocab = (draft >= 0) & (draft < vocab_size)
            safe_draft = jnp.clip(draft, 0, vocab_size - 1)
            p_draft = target_ref[slot, safe_draft]
            q_draft = draft_ref[0][slot, safe_draft] if has_draft_probs else jnp.float32(1.0)
            accepted = accepts_draft(uniform_ref[slot], p_draft, q_draft, in_vocab)
            return accepted, draft, jnp.int32(-1)
        return rule
    return factory


def rejection_scan_kernel(draft_token_ids: jax.Array, cu: jax.Array, draft_probs: jax.Array | None,
                          target_probs: jax.Array, bonus_token_ids: jax.Array, uniforms: jax.Array, *,
                          max_spec_len: int, interpret: bool = False):
    """The acceptance decisions of rejection sampling; a rejected slot's token is left at -1.

    Args:
      draft_probs: float[T, V] or None (q = one-hot(draft)); target_probs: float[T, V];
      uniforms: float32[T] acceptance uniforms.
    Returns:
      (tokens int32[B, max_spec_len + 1], num_accepted int32[B], accept_mask bool[T]); feed tokens and
      num_accepted to ``recovered_tokens.recover_rejected_tokens``.
    """
    rule = _sampling_rule(target_probs.shape[1], draft_probs is not None)
    rule_inputs = (uniforms, target_probs) + (() if draft_probs is None else (draft_probs,))
    return _run_scan(rule, cu, draft_token_ids, bonus_token_ids, rule_inputs,
                     max_spec_len=max_spec_len, interpret=interpret)
