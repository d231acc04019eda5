"""The fused verify step: acceptance and the KV commit of the accepted tokens in one traceable function.

Padding contract (what graph mode relies on): padded draft slots have ``slot_mapping == -1`` and
draft id 0; padded requests repeat the last ``cu`` offset (they own no slots) and are False in
``request_mask``. Padded slots and requests then emit no tokens and write nothing to the cache.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_batch import request_spans, slot_owner
from scv_jax.checks import require_int_vector, require_rank
from scv_jax.ops.acceptance.api import accept_greedy, accept_greedy_from_logits, rejection_sample
from scv_jax.ops.commit.api import commit_draft_kv
from scv_jax.verify.summary import StepSummary

KVLayout = Literal["drafts", "query", "grid"]


class VerifyStepOutput(NamedTuple):
    """Device arrays of one verify step (a pytree).

    Attributes:
      output_token_ids: int32[B, K + 1] emitted tokens, left-aligned, -1 after the last (all -1 for
        requests outside ``request_mask``).
      num_accepted: int32[B] accepted drafts (0 outside ``request_mask``).
      accept_mask: bool[T] accepted draft slots.
      summary: ``StepSummary`` of the tokens and counts: the one array the host fetches.
    """

    output_token_ids: jax.Array
    num_accepted: jax.Array
    accept_mask: jax.Array
    summary: StepSummary


def _commit_rows(layout: KVLayout, num_rows: int, accept_mask: jax.Array, num_accepted: jax.Array,
                 cu: jax.Array, request_mask: jax.Array, max_spec_len: int) -> jax.Array:
    """bool[N]: which K/V rows to commit.

    "drafts": row t is draft slot t. "query": request b owns rows cu[b] + b ... cu[b + 1] + b, the
    pending token then its drafts; "grid": request b owns rows b * (K + 1) ... b * (K + 1) + K
    (K = max_spec_len), the pending token then its drafts, unused rows past them. In both, row j of
    a request is committed when j <= num_accepted.
    """
    num_slots = accept_mask.shape[0]
    num_requests = num_accepted.shape[0]
    if layout == "drafts":
        if num_rows != num_slots:
            raise ValueError(f"verify_step: kv_layout='drafts' needs new_keys [layers, T, kv_heads, "
                             f"head_dim] with T={num_slots} (one row per draft slot), got {num_rows} rows")
        owner, _ = slot_owner(cu, num_slots)
        return accept_mask & request_mask[owner]
    if layout == "grid":
        width = max_spec_len + 1
        if num_rows != num_requests * width:
            raise ValueError(f"verify_step: kv_layout='grid' needs new_keys [layers, B * (max_spec_len + 1), "
                             f"kv_heads, head_dim] with B * (max_spec_len + 1) = {num_requests * width} rows, "
                             f"got {num_rows}")
        owner = jnp.arange(num_rows, dtype=jnp.int32) // width
        position = jnp.arange(num_rows, dtype=jnp.int32) % width
        return request_mask[owner] & (position <= num_accepted[owner])
    query_cu = cu + jnp.arange(num_requests + 1, dtype=jnp.int32)
    owner, position = slot_owner(query_cu, num_rows)
    _, counts = request_spans(cu, num_slots, num_slots)
    owned = (jnp.arange(num_rows) >= query_cu[owner]) & (position <= counts[owner])
    return owned & request_mask[owner] & (position <= num_accepted[owner])


def verify_step(kv_cache, new_keys, new_values, slot_mapping, draft_token_ids, cu_num_draft_tokens,
                bonus_token_ids, *, target_token_ids=None, target_logits=None, target_probs=None, draft_probs=None,
                key=None, request_mask=None, max_spec_len: int, kv_layout: KVLayout = "drafts",
                backend: str = "auto"):
    """Acceptance and KV commit of one speculative step, fused into one traceable function.

    Greedy when ``target_token_ids`` or ``target_logits`` is given (the latter fuses the argmax into the
    acceptance: ``accept_greedy_from_logits``), lossless rejection sampling when ``target_probs`` is.

    Args:
      kv_cache: the ``PagedKVCache`` (donate it under jit: the commit is in place).
      new_keys, new_values: [layers, N, kv_heads, head_dim] K/V computed during verification;
        N = T rows for ``kv_layout="drafts"`` (one per draft slot), N >= T + B for ``"query"``
        (per request: the pending token, then its drafts, at rows cu[b] + b ...), N = B * (K + 1)
        for ``"grid"`` (per request: the pending token, then its drafts, at rows b * (K + 1) ...;
        K = max_spec_len: requests with fewer drafts leave rows unused).
      slot_mapping: int32[N] cache slot of each row; negative = skip (padding).
      draft_token_ids: int32[T]; cu_num_draft_tokens: int32[B + 1]; bonus_token_ids: int32[B].
      target_token_ids: int32[T] the target's argmax per slot (greedy).
      target_logits: float[T, V] the target's logits per slot (greedy, argmax fused).
      target_probs / draft_probs: float[T, V] (sampling; draft_probs may be None).
      key: one PRNG key (sampling); requests use ``fold_in(key, b)``, so padding never changes them.
      request_mask: bool[B]; False requests (padding) emit nothing and commit nothing. None = all.
      max_spec_len: the most drafts of any request (static).
      kv_layout: "drafts", "query" or "grid" (static).
      backend: "auto", "pallas", "xla" or "interpret" (static), for acceptance and commit.
    Returns:
      (the updated cache, ``VerifyStepOutput``).
    """
    op = "verify_step"
    if sum(x is not None for x in (target_token_ids, target_logits, target_probs)) != 1:
        raise ValueError(f"{op}: give exactly one of target_token_ids or target_logits (greedy) or "
                         "target_probs (rejection sampling)")
    if kv_layout not in ("drafts", "query", "grid"):
        raise ValueError(f"{op}: kv_layout must be 'drafts', 'query' or 'grid', got {kv_layout!r}")
    require_rank(op, "new_keys", new_keys, 4, "[layers, N, kv_heads, head_dim]")
    require_int_vector(op, "cu_num_draft_tokens", cu_num_draft_tokens, None, "int32[B + 1]")
    num_requests = jnp.shape(cu_num_draft_tokens)[0] - 1
    if request_mask is None:
        request_mask = jnp.ones((num_requests,), jnp.bool_)
    require_int_vector(op, "request_mask", jnp.asarray(request_mask, jnp.int32), num_requests, "bool[B]")
    request_mask = jnp.asarray(request_mask, jnp.bool_)
    if target_token_ids is not None:
        result = accept_greedy(draft_token_ids, cu_num_draft_tokens, target_token_ids, bonus_token_ids,
                               max_spec_len=max_spec_len, backend=backend)
    elif target_logits is not None:
        result = accept_greedy_from_logits(draft_token_ids, cu_num_draft_tokens, target_logits, bonus_token_ids,
                                           max_spec_len=max_spec_len, backend=backend)
    else:
        result = rejection_sample(draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs,
                                  bonus_token_ids, key=key, max_spec_len=max_spec_len, backend=backend)
    tokens = jnp.where(request_mask[:, None], result.output_token_ids, -1)
    num_accepted = jnp.where(request_mask, result.num_accepted, 0)
    cu = jnp.asarray(cu_num_draft_tokens, jnp.int32)
    commit = _commit_rows(kv_layout, jnp.shape(new_keys)[1], result.accept_mask, num_accepted, cu,
                          request_mask, max_spec_len)
    kv_cache = commit_draft_kv(kv_cache, new_keys, new_values, slot_mapping, commit, backend=backend)
    accept_mask = commit if kv_layout == "drafts" else result.accept_mask & request_mask[
        slot_owner(cu, result.accept_mask.shape[0])[0]]
    num_verified = jnp.where(request_mask, cu[1:] - cu[:-1], 0)
    return kv_cache, VerifyStepOutput(tokens, num_accepted, accept_mask,
                                      StepSummary.pack(tokens, num_accepted, num_verified))
