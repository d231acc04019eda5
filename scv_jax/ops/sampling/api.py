"""Public sampling ops and their dispatch: ``filtered_probs`` (a request's target distribution after
its temperature, top-k, top-p and min-p) and ``token_logprobs`` (log-probabilities of emitted tokens).

Implementations (``scv_jax.ops.registry``): "xla" only (``xla.filtered_probs_xla``, tested against
``reference``); no Pallas kernel yet, so "pallas" / "interpret" raise and "auto" runs XLA.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from scv_jax.arguments import require_int
from scv_jax.checks import as_array, require_floating, require_integer, require_int_vector, require_rank
from scv_jax.ops import registry
from scv_jax.ops.sampling import reference
from scv_jax.ops.sampling.xla import filtered_probs_xla
from scv_jax.sampling_params import MAX_LOGPROBS

registry.register("filtered_probs", registry.Implementation("xla", filtered_probs_xla))
registry.register("token_logprobs", registry.Implementation("xla", reference.token_logprobs_reference))


class TokenLogprobs(NamedTuple):
    """Log-probabilities at temperature 1, unfiltered (as vLLM returns them).

    Attributes:
      logprob: float32[...] of each given token (-inf for an id outside [0, V)).
      top_ids: int32[..., n] the n most likely tokens, most likely first (lower id first on ties).
      top_logprobs: float32[..., n] their log-probabilities.
    """

    logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def _check_logits(op: str, logits) -> None:
    require_floating(op, "logits", logits, "float[B, ..., V]")
    if jnp.ndim(logits) < 2 or jnp.shape(logits)[-1] < 1:
        raise ValueError(f"{op}: logits must be float[B, ..., V] (rank >= 2, V >= 1), got shape {jnp.shape(logits)}")


def filtered_probs(logits, temperature, top_k, top_p, min_p, *, rows=None, backend: str = "auto") -> jax.Array:
    """Each request's sampling distribution: softmax(logits / temperature), then top-k, then top-p,
    then min-p, renormalised; a one-hot of the argmax for greedy requests (temperature 0).

    Greedy requests share the executable with sampled ones (the parameters are data): a greedy row's
    one-hot p is ``jnp.argmax`` (first index on ties; NaN never wins). Fed to ``rejection_sample``
    with a one-hot q (a greedy drafter's own filtered_probs, or ``draft_probs=None``), p(x) / q(x) is
    1 when the draft is the target's argmax and 0 otherwise, and the residual max(p - q, 0) is the
    argmax's one-hot: exactly greedy acceptance, whatever the uniforms.

    The filters: top-k keeps the tokens >= the k-th largest (ties kept; 0, -1 or >= V off); top-p keeps
    the smallest set of most likely tokens whose probability reaches top_p, at least one, with every
    token tied with its last (not < 1 off, <= 0 keeps only the most likely); min-p keeps p >= min_p *
    max p (not > 0 off, > 1 as 1). Temperature not > 0 or NaN is greedy. NaN logits count as -inf; a
    row without a finite logit gives a one-hot at 0. No input gives NaN.

    Args:
      logits: float[B, ..., V] one request per leading index (the target's [B, k + 1, V], a draft
        step's [B, V]); with ``rows``, float[N, V] rows of any requests.
      temperature, top_p, min_p: float32[B]; top_k: int32[B] (one per request, ``SamplingArrays``).
      rows: None, or int32[N] the request of each row of ``logits`` (clipped into [0, B)).
      backend: "auto" or "xla" (``scv_jax.ops.registry``; no kernel yet).
    Returns:
      float32 probabilities of ``logits``' shape.
    """
    op = "filtered_probs"
    logits = as_array(op, "logits", logits)
    _check_logits(op, logits)
    num_requests = jnp.shape(logits)[0]
    if rows is not None:
        rows = as_array(op, "rows", rows)
        require_rank(op, "logits", logits, 2, "float[N, V] (with rows)")
        require_int_vector(op, "rows", rows, jnp.shape(logits)[0], "int32[N] (one per row of logits)")
        num_requests = None
    params = []
    for name, value, integer in (("temperature", temperature, False), ("top_k", top_k, True),
                                 ("top_p", top_p, False), ("min_p", min_p, False)):
        value = as_array(op, name, value)
        doc = f"{'int32' if integer else 'float32'}[B]"
        (require_integer if integer else require_floating)(op, name, value, doc)
        require_rank(op, name, value, 1, doc)
        if num_requests is not None and jnp.shape(value)[0] != num_requests:
            raise ValueError(f"{op}: {name} must be {doc} with B = logits.shape[0] = {num_requests}, "
                             f"got shape {jnp.shape(value)}")
        params.append(value)
    if len({jnp.shape(p)[0] for p in params}) != 1:
        raise ValueError(f"{op}: temperature, top_k, top_p and min_p must have one entry per request each, "
                         f"got shapes {[jnp.shape(p) for p in params]}")
    impl = registry.select(op, backend)
    return _filtered_probs(jnp.asarray(logits), *(jnp.asarray(p) for p in params),
                           None if rows is None else jnp.asarray(rows), impl=impl)


@functools.partial(jax.jit, static_argnames=("impl",))
def _filtered_probs(logits, temperature, top_k, top_p, min_p, rows, *, impl: registry.Selected) -> jax.Array:
    shape = logits.shape
    if rows is None:   # request b's parameters for every row logits[b, ...]
        rows = jnp.repeat(jnp.arange(shape[0], dtype=jnp.int32), math.prod(shape[1:-1]))
    flat = logits.reshape(-1, shape[-1])
    if flat.shape[0] == 0 or temperature.shape[0] == 0:
        return jnp.zeros(shape, jnp.float32)
    rows = jnp.clip(rows, 0, temperature.shape[0] - 1)
    probs = impl(flat, temperature.astype(jnp.float32)[rows], top_k.astype(jnp.int32)[rows],
                 top_p.astype(jnp.float32)[rows], min_p.astype(jnp.float32)[rows])
    return probs.reshape(shape)


def token_logprobs(logits, token_ids, num_top: int = 0, *, backend: str = "auto") -> TokenLogprobs:
    """Log-probabilities of ``token_ids`` and the ``num_top`` most likely tokens, under the unfiltered
    distribution at temperature 1 (vLLM's returned logprobs). NaN logits count as -inf.

    Args:
      logits: float[..., V], V >= 1 (e.g. the target's [B, k + 1, V]).
      token_ids: int[...] one token per row of ``logits`` (e.g. the emitted tokens; -1 padding gives -inf).
      num_top: how many top log-probabilities per row (static, 0 <= n <= 20).
      backend: "auto" or "xla".
    """
    op = "token_logprobs"
    logits, token_ids = as_array(op, "logits", logits), as_array(op, "token_ids", token_ids)
    require_floating(op, "logits", logits, "float[..., V]")
    require_integer(op, "token_ids", token_ids, "int[...]")
    n = require_int(op, "num_top", num_top, minimum=0, static=True)
    if n > MAX_LOGPROBS:
        raise ValueError(f"{op}: num_top must be <= {MAX_LOGPROBS}, got {n}")
    if jnp.ndim(logits) < 1 or jnp.shape(logits)[-1] < max(n, 1) or jnp.shape(logits)[:-1] != jnp.shape(token_ids):
        raise ValueError(f"{op}: logits must be float[..., V] with V >= max(num_top, 1) and token_ids int[...] "
                         f"of its leading shape, got {jnp.shape(logits)} and {jnp.shape(token_ids)}")
    impl = registry.select(op, backend)
    return _token_logprobs(jnp.asarray(logits), jnp.asarray(token_ids), num_top=n, impl=impl)


@functools.partial(jax.jit, static_argnames=("num_top", "impl"))
def _token_logprobs(logits, token_ids, *, num_top: int, impl: registry.Selected) -> TokenLogprobs:
    lead, vocab_size = logits.shape[:-1], logits.shape[-1]
    token, top_ids, top = impl(logits.reshape(-1, vocab_size), token_ids.reshape(-1), num_top)
    return TokenLogprobs(token.reshape(lead), top_ids.reshape(lead + (num_top,)), top.reshape(lead + (num_top,)))
