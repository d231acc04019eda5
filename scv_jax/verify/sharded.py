"""``verify_step`` on a decoder's mesh: each "data" shard verifies its own requests and commits their
accepted K/V into its own blocks, each "model" shard its own K/V heads.

Rejection sampling needs whole vocabulary rows: the target (and draft) probabilities enter the shards
split over "data" only, so XLA gathers a vocabulary-parallel model's probabilities over "model".
Greedy acceptance needs only the target's argmax: given ``target_logits``, the argmax (the same
NaN-safe first index ``accept_greedy_from_logits`` takes) is reduced over the split vocabulary before,
and the shards receive token ids. Every "model" shard then computes the same acceptance. Outside a
decoder's mesh trace it is ``verify_step``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.sampling_math import argmax_ignoring_nan
from scv_jax.ops.acceptance.randomness import normalize_keys
from scv_jax.sharding.mesh import (DATA, REPLICATED, REQUESTS, active_mesh, cache_specs, heads_axis, per_shard,
                                   rows_spec)
from scv_jax.verify.step import KVLayout, VerifyStepOutput, verify_step
from scv_jax.verify.summary import StepSummary


def sharded_verify_step(kv_cache, new_keys, new_values, slot_mapping, draft_token_ids, cu_num_draft_tokens,
                        bonus_token_ids, *, target_token_ids=None, target_logits=None, target_probs=None,
                        draft_probs=None, key=None, request_mask=None, max_spec_len: int,
                        kv_layout: KVLayout = "drafts", backend: str = "auto"):
    """``verify_step`` (same arguments and outputs), per shard on the active mesh.

    Requests, their draft slots and K/V rows split evenly over "data": the requests of shard s own
    draft slots at the start of ``[s * T / D, (s + 1) * T / D)`` (the decode step compacts its ragged
    drafts shard by shard: ``chain_verifier.ragged_slots``; ``cu``'s differences count them) and their
    slots are local to the shard's blocks. One key is first split per request
    (``fold_in(key, b)``, as ``verify_step`` does), so each request's randomness is the one-device one.
    """
    step = functools.partial(verify_step, max_spec_len=max_spec_len, kv_layout=kv_layout, backend=backend)
    if active_mesh() is None:
        return step(kv_cache, new_keys, new_values, slot_mapping, draft_token_ids, cu_num_draft_tokens,
                    bonus_token_ids, target_token_ids=target_token_ids, target_logits=target_logits,
                    target_probs=target_probs, draft_probs=draft_probs, key=key, request_mask=request_mask)
    if target_logits is not None:
        target_token_ids = argmax_ignoring_nan(jnp.asarray(target_logits))
    if key is not None:
        key = normalize_keys("verify_step", key, jnp.shape(bonus_token_ids)[0])

    def local(cache, keys, values, slots, drafts, cu, bonus, target_ids, target_p, draft_p, request_keys, mask):
        batch = bonus.shape[0]
        cu = jax.lax.dynamic_slice_in_dim(cu, jax.lax.axis_index(DATA) * batch, batch + 1)
        return step(cache, keys, values, slots, drafts, cu - cu[0], bonus, target_token_ids=target_ids,
                    target_probs=target_p, draft_probs=draft_p, key=request_keys, request_mask=mask)

    args = (kv_cache, new_keys, new_values, slot_mapping, draft_token_ids, jnp.asarray(cu_num_draft_tokens, jnp.int32),
            bonus_token_ids, target_token_ids, target_probs, draft_probs, key, request_mask)
    rows, specs = rows_spec(heads_axis(kv_cache)), cache_specs(kv_cache)
    in_specs = (specs, rows, rows, REQUESTS, REQUESTS, REPLICATED) + tuple(
        None if a is None else REQUESTS for a in args[6:])
    out_specs = (specs, VerifyStepOutput(REQUESTS, REQUESTS, REQUESTS, StepSummary(REQUESTS)))
    return per_shard(local, in_specs=in_specs, out_specs=out_specs)(*args)
