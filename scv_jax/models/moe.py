"""A mixture-of-experts SwiGLU block (Qwen3-MoE, Mixtral) with the experts run as one grouped matmul.

Routing: a linear router (d_model -> num_experts, no bias) gives float32 logits, their softmax is
taken, the top ``num_experts_per_tok`` experts of each token kept, and (``norm_topk_prob``) their
weights renormalised to sum to 1 (Mixtral's softmax over the top-k logits is the same thing).

Experts: each expert is a SwiGLU whose weights are stacked over experts, ``experts_gate`` /
``experts_up`` [E, d_model, f] and ``experts_down`` [E, f, d_model]. The N tokens' N * k (token,
slot) pairs are sorted by expert once (a stable argsort), so each expert's rows are contiguous, and
the three products run as ``jax.lax.ragged_dot`` with the group sizes (a bincount over the experts):
every pair costs one expert's FLOPs, whatever the routing, no expert capacity and no token dropped.
The outputs are put back in (token, slot) order and summed with the routing weights. A token's
output depends on that token alone, so prefill, draft scoring and verification (every forward of
``Transformer``) compute the same thing for it whatever else is in the batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from scv_jax.models.config import TransformerConfig


def route(logits: jax.Array, k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """Top-k softmax routing: logits float32[N, E] -> (weights float32[N, k], experts int32[N, k]).

    The softmax is over all E experts; ``normalize``: the k kept weights are divided by their sum.
    Ties go to the lower expert index (``jax.lax.top_k``)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def experts_ragged(x: jax.Array, experts: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    """Each token's chosen experts' SwiGLU outputs, by grouped matmul.

    x: [N, d]; experts: int32[N, k] (in [0, E)); gate, up: [E, d, f]; down: [E, f, d].
    Returns [N, k, d] (x's dtype): row (n, j) is expert ``experts[n, j]`` applied to x[n].

    The N * k (token, slot) pairs are sorted by expert, each of the three products is one
    ``jax.lax.ragged_dot`` over the sorted rows (group sizes: the number of pairs per expert, 0 for
    an expert no token chose), and the result is scattered back to (token, slot) order.
    """
    num_tokens, k = experts.shape
    num_experts = gate.shape[0]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)                       # [N * k] pair indices, grouped by expert
    rows = x[order // k]                                         # [N * k, d]
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    hidden = jax.nn.silu(jax.lax.ragged_dot(rows, gate, sizes)) * jax.lax.ragged_dot(rows, up, sizes)
    out = jax.lax.ragged_dot(hidden.astype(x.dtype), down, sizes)  # [N * k, d], sorted by expert
    return jnp.zeros_like(out).at[order].set(out, unique_indices=True).reshape(num_tokens, k, -1)


def moe_forward(x: jax.Array, router: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, k: int,
                normalize: bool) -> jax.Array:
    """The MoE block on x [..., d] (router [d, E], experts as in ``experts_ragged``) -> [..., d] in x's
    dtype: the routing-weighted sum (float32) of each token's k experts' outputs."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    logits = jnp.matmul(flat, router, preferred_element_type=jnp.float32)
    weights, experts = route(logits, k, normalize)
    outputs = experts_ragged(flat, experts, gate, up, down)
    combined = jnp.einsum("nk,nkd->nd", weights, outputs.astype(jnp.float32))
    return combined.astype(x.dtype).reshape(shape)


def moe_dense_reference(x: jax.Array, router: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, k: int,
                        normalize: bool) -> jax.Array:
    """``moe_forward`` computed densely, for tests: every expert on every token ([N, E, d] outputs),
    summed with a [N, E] matrix holding each token's routing weight of its chosen experts (0 elsewhere)."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    logits = jnp.matmul(flat, router, preferred_element_type=jnp.float32)
    weights, experts = route(logits, k, normalize)
    mask = jnp.zeros(logits.shape, jnp.float32).at[jnp.arange(flat.shape[0])[:, None], experts].add(weights)
    hidden = jax.nn.silu(jnp.einsum("nd,edf->nef", flat, gate)) * jnp.einsum("nd,edf->nef", flat, up)
    outputs = jnp.einsum("nef,efd->ned", hidden.astype(x.dtype), down)
    return jnp.einsum("ne,ned->nd", mask, outputs.astype(jnp.float32)).astype(x.dtype).reshape(shape)


class MoE(nnx.Module):
    """The mixture-of-experts MLP of a ``TransformerConfig`` with ``num_experts > 0``.

    Parameters (``config.dtype``): ``router`` (``nnx.Linear`` kernel [d_model, E]), ``experts_gate``,
    ``experts_up`` [E, d_model, f] and ``experts_down`` [E, f, d_model], f = ``config.expert_ffn_dim``.
    ``model(x [..., d_model])`` -> [..., d_model] (``moe_forward``).
    """

    def __init__(self, config: TransformerConfig, rngs: nnx.Rngs):
        dtype = config.jnp_dtype
        e, d, f = config.num_experts, config.d_model, config.expert_ffn_dim
        self.num_experts_per_tok = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.router = nnx.Linear(d, e, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
        init = jax.nn.initializers.lecun_normal(batch_axis=(0,))      # fan-in per expert
        self.experts_gate = nnx.Param(init(rngs.params(), (e, d, f), dtype))
        self.experts_up = nnx.Param(init(rngs.params(), (e, d, f), dtype))
        self.experts_down = nnx.Param(init(rngs.params(), (e, f, d), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        return moe_forward(x, self.router.kernel[...], self.experts_gate[...], self.experts_up[...],
                           self.experts_down[...], self.num_experts_per_tok, self.norm_topk_prob)
