"""A mixture-of-experts SwiGLU block (Qwen3-MoE, Mixtral, gpt-oss) with the experts run as one grouped
matmul.

Routing: a linear router (d_model -> num_experts; with a bias for gpt-oss) gives float32 logits,
their softmax is taken, the top ``num_experts_per_tok`` experts of each token kept, and
(``norm_topk_prob``) their weights renormalised to sum to 1 (Mixtral's and gpt-oss's softmax over the
top-k logits is the same thing).

Experts: each expert is a SwiGLU whose weights are stacked over experts, ``experts_gate`` /
``experts_up`` [E, d_model, f] and ``experts_down`` [E, f, d_model]. The N tokens' N * k (token,
slot) pairs are sorted by expert once (a stable argsort), so each expert's rows are contiguous, and
the three products run as ``jax.lax.ragged_dot`` with the group sizes (a bincount over the experts):
every pair costs one expert's FLOPs, whatever the routing, no expert capacity and no token dropped.
gpt-oss adds a bias to every expert projection (each sorted row takes its expert's) and clamps its
SwiGLU (``TransformerConfig.swiglu_limit``; ``swiglu``).
The outputs are put back in (token, slot) order and summed with the routing weights. A token's
output depends on that token alone, so prefill, draft scoring and verification (every forward of
``Transformer``) compute the same thing for it whatever else is in the batch.

Expert parallelism: traced on a decoder's mesh (``scv_jax.sharding.mesh.tracing_on``) whose "model" axis
divides the experts, each "model" shard holds E / model of them (``scv_jax.sharding.params``) and runs the
block under ``jax.shard_map`` on the activations it already holds (replicated over "model" after the
attention's all-reduce, so dispatch moves nothing): every token's routing, its pairs with the shard's own
experts (the others sorted last, outside every group, and left out of the sum), and one all-reduce over
"model" of the float32 [N, d] partial sums, the same collective as a dense MLP's.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from scv_jax.models.config import TransformerConfig
from scv_jax.sharding.mesh import DATA, MODEL, REPLICATED, active_mesh, per_shard

GPT_OSS_ALPHA = 1.702          # gpt-oss's sigmoid slope in its clamped SwiGLU


class ExpertWeights(NamedTuple):
    """One layer's experts: ``gate``, ``up`` [E, d, f], ``down`` [E, f, d] and, for gpt-oss, the biases
    ``gate_bias``, ``up_bias`` [E, f], ``down_bias`` [E, d] (None without)."""

    gate: jax.Array
    up: jax.Array
    down: jax.Array
    gate_bias: jax.Array | None = None
    up_bias: jax.Array | None = None
    down_bias: jax.Array | None = None


def swiglu(gate: jax.Array, up: jax.Array, limit: float | None) -> jax.Array:
    """``silu(gate) * up`` (``limit`` None), or gpt-oss's clamped form: g * sigmoid(1.702 g) * (u + 1),
    g = min(gate, limit), u = up clipped to [-limit, limit]."""
    if limit is None:
        return jax.nn.silu(gate) * up
    gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return gate * jax.nn.sigmoid(gate * GPT_OSS_ALPHA) * (up + 1)


def route(logits: jax.Array, k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """Top-k softmax routing: logits float32[N, E] -> (weights float32[N, k], experts int32[N, k]).

    The softmax is over all E experts; ``normalize``: the k kept weights are divided by their sum.
    Ties go to the lower expert index (``jax.lax.top_k``)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def experts_ragged(x: jax.Array, experts: jax.Array, w: ExpertWeights, limit: float | None = None) -> jax.Array:
    """Each token's chosen experts' SwiGLU outputs, by grouped matmul.

    x: [N, d]; experts: int32[N, k] (in [0, E]); ``w``: the layer's ``ExpertWeights``; ``limit``: as
    ``swiglu``. Returns [N, k, d] (x's dtype): row (n, j) is expert ``experts[n, j]`` applied to x[n]
    (zeros where ``experts[n, j]`` is E: a pair left out, sorted after every group).

    The N * k (token, slot) pairs are sorted by expert, each of the three products is one
    ``jax.lax.ragged_dot`` over the sorted rows (group sizes: the number of pairs per expert, 0 for
    an expert no token chose), and the result is scattered back to (token, slot) order.
    """
    num_tokens, k = experts.shape
    num_experts = w.gate.shape[0]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)                       # [N * k] pair indices, grouped by expert
    rows = x[order // k]                                         # [N * k, d]
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    row_expert = flat[order]                                     # each sorted row's expert

    def project(inputs: jax.Array, weight: jax.Array, bias: jax.Array | None) -> jax.Array:
        out = jax.lax.ragged_dot(inputs, weight, sizes)
        return out if bias is None else out + jnp.take(bias, row_expert, axis=0, mode="clip").astype(out.dtype)

    hidden = swiglu(project(rows, w.gate, w.gate_bias), project(rows, w.up, w.up_bias), limit)
    out = project(hidden.astype(x.dtype), w.down, w.down_bias)   # [N * k, d], sorted by expert
    out = jnp.where((row_expert < num_experts)[:, None], out, 0)  # pairs left out: zero, whatever a bias adds
    return jnp.zeros_like(out).at[order].set(out, unique_indices=True).reshape(num_tokens, k, -1)


def _routing(flat: jax.Array, router: jax.Array, router_bias: jax.Array | None, k: int,
             normalize: bool) -> tuple[jax.Array, jax.Array]:
    logits = jnp.matmul(flat, router, preferred_element_type=jnp.float32)
    if router_bias is not None:
        logits = logits + router_bias.astype(jnp.float32)
    return route(logits, k, normalize)


def moe_forward(x: jax.Array, router: jax.Array, w: ExpertWeights, k: int, normalize: bool, *,
                router_bias: jax.Array | None = None, limit: float | None = None) -> jax.Array:
    """The MoE block on x [..., d] (router [d, E] and ``router_bias`` [E] or None; experts ``w`` as in
    ``experts_ragged``) -> [..., d] in x's dtype: the routing-weighted sum (float32) of each token's k
    experts' outputs. Traced on a mesh whose "model" axis divides E: expert-parallel (module docstring)."""
    mesh, num_experts = active_mesh(), w.gate.shape[0]
    if mesh is None or mesh.shape[MODEL] == 1 or num_experts % mesh.shape[MODEL]:
        return partial_sum(x, router, w, k, normalize, router_bias=router_bias, limit=limit).astype(x.dtype)
    per_model_shard = num_experts // mesh.shape[MODEL]

    def shard(x: jax.Array, router: jax.Array, router_bias: jax.Array | None, w: ExpertWeights) -> jax.Array:
        partial = partial_sum(x, router, w, k, normalize, router_bias=router_bias, limit=limit,
                              first_expert=jax.lax.axis_index(MODEL) * per_model_shard)
        return jax.lax.psum(partial, MODEL).astype(x.dtype)

    tokens = P(DATA) if x.shape[0] % mesh.shape[DATA] == 0 else REPLICATED
    return per_shard(shard, in_specs=(tokens, REPLICATED, REPLICATED, P(MODEL)), out_specs=tokens)(
        x, router, router_bias, w)


def partial_sum(x: jax.Array, router: jax.Array, w: ExpertWeights, k: int, normalize: bool, *,
                router_bias: jax.Array | None = None, limit: float | None = None,
                first_expert: jax.Array | int = 0) -> jax.Array:
    """float32[..., d]: the part of ``moe_forward`` (same arguments, router [d, E] over all experts) from
    the experts ``w`` holds, experts ``first_expert`` .. ``first_expert + len(w.gate) - 1``: each token's
    routing-weighted sum over those of its chosen experts (all of them when ``w`` holds every expert)."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    weights, experts = _routing(flat, router, router_bias, k, normalize)
    held = w.gate.shape[0]
    local = experts - first_expert
    local = jnp.where((local >= 0) & (local < held), local, held)     # another shard's expert: left out
    outputs = experts_ragged(flat, local, w, limit)
    combined = jnp.einsum("nk,nkd->nd", weights, outputs.astype(jnp.float32))
    return combined.reshape(shape)


def moe_dense_reference(x: jax.Array, router: jax.Array, w: ExpertWeights, k: int, normalize: bool, *,
                        router_bias: jax.Array | None = None, limit: float | None = None) -> jax.Array:
    """``moe_forward`` computed densely, for tests: every expert on every token ([N, E, d] outputs),
    summed with a [N, E] matrix holding each token's routing weight of its chosen experts (0 elsewhere)."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    weights, experts = _routing(flat, router, router_bias, k, normalize)
    mask = jnp.zeros((flat.shape[0], w.gate.shape[0]), jnp.float32).at[
        jnp.arange(flat.shape[0])[:, None], experts].add(weights)

    def project(inputs: jax.Array, spec: str, weight: jax.Array, bias: jax.Array | None) -> jax.Array:
        out = jnp.einsum(spec, inputs, weight)
        return out if bias is None else out + bias[None].astype(out.dtype)

    hidden = swiglu(project(flat, "nd,edf->nef", w.gate, w.gate_bias),
                    project(flat, "nd,edf->nef", w.up, w.up_bias), limit)
    outputs = project(hidden.astype(x.dtype), "nef,efd->ned", w.down, w.down_bias)
    return jnp.einsum("ne,ned->nd", mask, outputs.astype(jnp.float32)).astype(x.dtype).reshape(shape)


class MoE(nnx.Module):
    """The mixture-of-experts MLP of a ``TransformerConfig`` with ``num_experts > 0``.

    Parameters (``config.dtype``): ``router`` (``nnx.Linear`` kernel [d_model, E], a bias [E] with
    ``config.moe_bias``), ``experts_gate``, ``experts_up`` [E, d_model, f] and ``experts_down``
    [E, f, d_model], f = ``config.expert_ffn_dim``, and with ``moe_bias`` ``experts_gate_bias``,
    ``experts_up_bias`` [E, f] and ``experts_down_bias`` [E, d_model].
    ``model(x [..., d_model])`` -> [..., d_model] (``moe_forward``).
    """

    def __init__(self, config: TransformerConfig, rngs: nnx.Rngs):
        dtype = config.jnp_dtype
        e, d, f = config.num_experts, config.d_model, config.expert_ffn_dim
        self.num_experts_per_tok = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.swiglu_limit = config.swiglu_limit
        self.router = nnx.Linear(d, e, use_bias=config.moe_bias, dtype=dtype, param_dtype=dtype, rngs=rngs)
        init = jax.nn.initializers.lecun_normal(batch_axis=(0,))      # fan-in per expert
        self.experts_gate = nnx.Param(init(rngs.params(), (e, d, f), dtype))
        self.experts_up = nnx.Param(init(rngs.params(), (e, d, f), dtype))
        self.experts_down = nnx.Param(init(rngs.params(), (e, f, d), dtype))
        bias = (lambda *shape: nnx.Param(jnp.zeros(shape, dtype))) if config.moe_bias else (lambda *shape: None)
        self.experts_gate_bias, self.experts_up_bias, self.experts_down_bias = bias(e, f), bias(e, f), bias(e, d)

    def __call__(self, x: jax.Array) -> jax.Array:
        value = lambda p: None if p is None else p[...]  # noqa: E731
        weights = ExpertWeights(*(value(p) for p in (self.experts_gate, self.experts_up, self.experts_down,
                                                     self.experts_gate_bias, self.experts_up_bias,
                                                     self.experts_down_bias)))
        return moe_forward(x, self.router.kernel[...], weights, self.num_experts_per_tok, self.norm_topk_prob,
                           router_bias=value(self.router.bias), limit=self.swiglu_limit)
