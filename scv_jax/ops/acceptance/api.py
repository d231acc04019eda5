"""Public acceptance ops and their dispatch: greedy exact match (from target ids or from the target's
logits) and lossless rejection sampling over a ragged batch.

Implementations (``scv_jax.ops.registry``): "pallas" = ``pallas_kernels.accept_scan`` (+
``pallas_kernels.target_argmax`` for greedy from logits, + ``pallas_kernels.recovered_tokens`` for
sampling), "xla" = ``reference``. The kernels take float32/float16/bfloat16 [T, V] inputs (others
go to XLA under "auto").
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from scv_jax.arguments import require_int
from scv_jax.checks import as_array, require_floating, require_int_vector, require_rank
from scv_jax.ops import registry
from scv_jax.ops.acceptance import reference
from scv_jax.ops.acceptance.randomness import normalize_keys, slot_randomness
from scv_jax.ops.acceptance.result import AcceptResult


def _greedy_kernel(draft, cu, target, bonus, *, max_spec_len: int, interpret: bool) -> AcceptResult:
    from pallas_kernels.accept_scan import accept_greedy_kernel
    return AcceptResult(*accept_greedy_kernel(draft, cu, target, bonus, max_spec_len=max_spec_len,
                                              interpret=interpret))


def _greedy_from_logits_kernel(draft, cu, logits, bonus, *, max_spec_len: int, interpret: bool) -> AcceptResult:
    from pallas_kernels.accept_scan import accept_greedy_from_logits_kernel
    return AcceptResult(*accept_greedy_from_logits_kernel(draft, cu, logits, bonus, max_spec_len=max_spec_len,
                                                          interpret=interpret))


def _rejection_kernel(draft, cu, draft_probs, target_probs, bonus, uniforms, seeds, *, max_spec_len: int,
                      interpret: bool) -> AcceptResult:
    from pallas_kernels.accept_scan import rejection_scan_kernel
    from pallas_kernels.recovered_tokens import recover_rejected_tokens
    tokens, num_accepted, mask = rejection_scan_kernel(draft, cu, draft_probs, target_probs, bonus, uniforms,
                                                       max_spec_len=max_spec_len, interpret=interpret)
    tokens = recover_rejected_tokens(tokens, num_accepted, cu, draft, draft_probs, target_probs, seeds,
                                     max_spec_len=max_spec_len, interpret=interpret)
    return AcceptResult(tokens, num_accepted, mask)


KERNEL_VOCAB_DTYPES: tuple[np.dtype, ...] = (np.dtype(jnp.float32), np.dtype(jnp.float16), np.dtype(jnp.bfloat16))


def _vocab_dtypes_unsupported(*, dtypes: tuple[np.dtype, ...]) -> str:
    """The kernels stream [T, V] rows as float32/float16/bfloat16."""
    bad = [str(d) for d in dtypes if d not in KERNEL_VOCAB_DTYPES]
    return f"[T, V] inputs must be float32, float16 or bfloat16, got {', '.join(bad)}" if bad else ""


registry.register("accept_greedy", registry.Implementation("pallas", _greedy_kernel),
                  registry.Implementation("xla", reference.accept_greedy_reference))
registry.register("accept_greedy_from_logits",
                  registry.Implementation("pallas", _greedy_from_logits_kernel, _vocab_dtypes_unsupported),
                  registry.Implementation("xla", reference.accept_greedy_from_logits_reference))
registry.register("rejection_sample", registry.Implementation("pallas", _rejection_kernel, _vocab_dtypes_unsupported),
                  registry.Implementation("xla", reference.rejection_sample_reference))


def _check_ragged_batch(op: str, draft_token_ids, cu_num_draft_tokens, bonus_token_ids,
                        max_spec_len) -> tuple[int, int, int]:
    """Static checks shared by both ops; returns (T, B, max_spec_len)."""
    k = require_int(op, "max_spec_len", max_spec_len, minimum=0, static=True)
    require_int_vector(op, "draft_token_ids", draft_token_ids, None, "int32[T]")
    require_int_vector(op, "cu_num_draft_tokens", cu_num_draft_tokens, None, "int32[B + 1]")
    num_requests = jnp.shape(cu_num_draft_tokens)[0] - 1
    if num_requests < 0:
        raise ValueError(f"{op}: cu_num_draft_tokens must be int32[B + 1] with at least one entry (0)")
    require_int_vector(op, "bonus_token_ids", bonus_token_ids, num_requests, "int32[B]")
    return jnp.shape(draft_token_ids)[0], num_requests, k


def _without_drafts(num_slots: int, bonus: jax.Array, max_spec_len: int) -> AcceptResult:
    """The result when no request has a draft slot (T = 0 or B = 0): every request emits its bonus."""
    tokens = jnp.full((bonus.shape[0], max_spec_len + 1), -1, jnp.int32).at[:, 0].set(bonus)
    return AcceptResult(tokens, jnp.zeros(bonus.shape, jnp.int32), jnp.zeros((num_slots,), jnp.bool_))


def accept_greedy(draft_token_ids, cu_num_draft_tokens, target_token_ids, bonus_token_ids, *,
                  max_spec_len: int, backend: str = "auto") -> AcceptResult:
    """Greedy verification: accept drafts while they equal the target's argmax.

    Args:
      draft_token_ids: int32[T] drafts of all requests, flattened (T may include padding).
      cu_num_draft_tokens: int32[B + 1] offsets; request b owns slots cu[b]:cu[b + 1].
      target_token_ids: int32[T] the target's argmax at each draft slot.
      bonus_token_ids: int32[B] the target's token after the last draft.
      max_spec_len: the most drafts of any request (static, >= 0).
      backend: "auto", "pallas", "xla" or "interpret" (``scv_jax.ops.registry``).
    Returns:
      ``AcceptResult``: for each request, target tokens up to and including the first mismatch,
      plus the bonus token when every draft matched.
    """
    op = "accept_greedy"
    args = [as_array(op, name, x) for name, x in (
        ("draft_token_ids", draft_token_ids), ("cu_num_draft_tokens", cu_num_draft_tokens),
        ("target_token_ids", target_token_ids), ("bonus_token_ids", bonus_token_ids))]
    num_slots, _, k = _check_ragged_batch(op, args[0], args[1], args[3], max_spec_len)
    require_int_vector(op, "target_token_ids", args[2], num_slots, "int32[T] (same T as drafts)")
    impl = registry.select(op, backend)
    return _accept_greedy(*(jnp.asarray(x, jnp.int32) for x in args), max_spec_len=k, impl=impl)


@functools.partial(jax.jit, static_argnames=("max_spec_len", "impl"))
def _accept_greedy(draft, cu, target, bonus, *, max_spec_len: int, impl: registry.Selected) -> AcceptResult:
    """Both greedy ops: ``target`` is int32[T] ids or float[T, V] logits, per ``impl``."""
    if draft.shape[0] == 0 or bonus.shape[0] == 0:
        return _without_drafts(draft.shape[0], bonus, max_spec_len)
    return impl(draft, cu, target, bonus, max_spec_len=max_spec_len)


def accept_greedy_from_logits(draft_token_ids, cu_num_draft_tokens, target_logits, bonus_token_ids, *,
                              max_spec_len: int, backend: str = "auto") -> AcceptResult:
    """Greedy verification against the argmax of the target's logits, fused: [T, V] is read once.

    Same result as ``accept_greedy(draft_token_ids, cu_num_draft_tokens, argmax(target_logits),
    bonus_token_ids)`` where argmax is the first index of the row maximum and NaN never wins (a row
    of only NaN / -inf gives 0; ``jnp.argmax`` would pick the first NaN instead). The bonus tokens
    still come from the caller (as in vLLM).

    Args:
      draft_token_ids: int32[T]; cu_num_draft_tokens: int32[B + 1]; bonus_token_ids: int32[B].
      target_logits: float[T, V] the target's logits (or probabilities) at each draft slot, V >= 1.
      max_spec_len: the most drafts of any request (static, >= 0).
      backend: "auto", "pallas", "xla" or "interpret" (``scv_jax.ops.registry``).
    """
    op = "accept_greedy_from_logits"
    args = [as_array(op, name, x) for name, x in (
        ("draft_token_ids", draft_token_ids), ("cu_num_draft_tokens", cu_num_draft_tokens),
        ("target_logits", target_logits), ("bonus_token_ids", bonus_token_ids))]
    num_slots, _, k = _check_ragged_batch(op, args[0], args[1], args[3], max_spec_len)
    _check_vocab_rows(op, "target_logits", args[2], num_slots)
    impl = registry.select(op, backend, dtypes=(np.dtype(jnp.result_type(args[2])),))
    draft, cu, bonus = (jnp.asarray(x, jnp.int32) for x in (args[0], args[1], args[3]))
    return _accept_greedy(draft, cu, jnp.asarray(args[2]), bonus, max_spec_len=k, impl=impl)


def _check_vocab_rows(op: str, name: str, x, num_slots: int) -> None:
    require_rank(op, name, x, 2, "float[T, V]")
    require_floating(op, name, x, "float[T, V]")
    if jnp.shape(x)[0] != num_slots or jnp.shape(x)[1] < 1:
        raise ValueError(f"{op}: {name} must be float[T, V] with T={num_slots} and V >= 1, "
                         f"got shape {jnp.shape(x)}")


def rejection_sample(draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs,
                     bonus_token_ids, *, key: Any, max_spec_len: int, backend: str = "auto") -> AcceptResult:
    """Lossless speculative sampling: accept draft x with probability min(1, p(x) / q(x)).

    On the first rejection the request emits a sample of norm(max(p - q, 0)) and stops; when all
    drafts are accepted it emits ``bonus_token_ids``. The emitted tokens are distributed exactly as
    sampling from the target alone.

    Args:
      draft_token_ids: int32[T]; cu_num_draft_tokens: int32[B + 1]; bonus_token_ids: int32[B].
      draft_probs: float[T, V], or None for drafts without a distribution (q = one-hot(draft)).
      target_probs: float[T, V] the target's probabilities at each draft slot.
      key: one PRNG key or B keys (typed or legacy uint32).
      max_spec_len: the most drafts of any request (static, >= 0).
      backend: "auto", "pallas", "xla" or "interpret" (``scv_jax.ops.registry``).
    """
    op = "rejection_sample"
    draft_token_ids, cu_num_draft_tokens, bonus_token_ids, target_probs = (as_array(op, name, x) for name, x in (
        ("draft_token_ids", draft_token_ids), ("cu_num_draft_tokens", cu_num_draft_tokens),
        ("bonus_token_ids", bonus_token_ids), ("target_probs", target_probs)))
    num_slots, num_requests, k = _check_ragged_batch(op, draft_token_ids, cu_num_draft_tokens,
                                                     bonus_token_ids, max_spec_len)
    _check_vocab_rows(op, "target_probs", target_probs, num_slots)
    if draft_probs is not None:
        draft_probs = as_array(op, "draft_probs", draft_probs)
        require_rank(op, "draft_probs", draft_probs, 2, "float[T, V]")
        require_floating(op, "draft_probs", draft_probs, "float[T, V]")
        if jnp.shape(draft_probs) != jnp.shape(target_probs):
            raise ValueError(f"{op}: draft_probs must have target_probs' shape {jnp.shape(target_probs)}, "
                             f"got {jnp.shape(draft_probs)}")
    dtypes = tuple(np.dtype(jnp.result_type(x)) for x in (target_probs, draft_probs) if x is not None)
    impl = registry.select(op, backend, dtypes=dtypes)
    return _rejection_sample(jnp.asarray(draft_token_ids, jnp.int32), jnp.asarray(cu_num_draft_tokens, jnp.int32),
                             draft_probs, target_probs, jnp.asarray(bonus_token_ids, jnp.int32), key,
                             max_spec_len=k, impl=impl)


@functools.partial(jax.jit, static_argnames=("max_spec_len", "impl"))
def _rejection_sample(draft, cu, draft_probs, target_probs, bonus, key, *, max_spec_len: int,
                      impl: registry.Selected) -> AcceptResult:
    num_slots, num_requests = draft.shape[0], bonus.shape[0]
    keys = normalize_keys("rejection_sample", key, num_requests)   # static checks run at trace time
    bonus = jnp.clip(bonus, 0, target_probs.shape[1] - 1)
    if num_slots == 0 or num_requests == 0:
        return _without_drafts(num_slots, bonus, max_spec_len)
    uniforms, seeds = slot_randomness(keys, cu, num_slots)
    return impl(draft, cu, draft_probs, target_probs, bonus, uniforms, seeds, max_spec_len=max_spec_len)
