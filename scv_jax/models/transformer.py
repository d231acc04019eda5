"""A Llama-style decoder-only transformer in Flax NNX with paged + staged attention.

The layers' parameters are stacked on a leading ``[num_layers]`` axis (``Transformer.blocks`` is one
``Block`` whose every parameter has that axis) and both forward passes run the layers under
``jax.lax.scan``, so tracing and compile time do not grow with depth.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from scv_jax.models.attention import causal_attention
from scv_jax.models.config import TransformerConfig
from scv_jax.models.moe import MoE
from scv_jax.models.protocol import PackedTokens, PagedForwardOutput, StagedKV
from scv_jax.models.rope import apply_rope, attention_factor, inverse_frequencies
from scv_jax.ops.attention.api import tree_depths
from scv_jax.ops.attention.sharded import sharded_paged_attention

# attend(q [B, T, heads, D], k, v [B, T, kv_heads, D], sinks [heads] or None) -> [B, T, heads, D]: one
# layer's attention of the new tokens (RoPE applied) over whatever keys the forward pass provides.
Attend = Callable[[jax.Array, jax.Array, jax.Array, jax.Array | None], jax.Array]


class RMSNorm(nnx.Module):
    """x * rsqrt(mean(x^2) + eps), computed in float32, cast back to x's dtype, times ``scale``."""

    def __init__(self, dim: int, eps: float, dtype: jnp.dtype):
        self.scale = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return normed.astype(x.dtype) * self.scale[...]


def _linear(config: TransformerConfig, fan_in: int, fan_out: int, rngs: nnx.Rngs, *,
            use_bias: bool = False) -> nnx.Linear:
    dtype = config.jnp_dtype
    return nnx.Linear(fan_in, fan_out, use_bias=use_bias, dtype=dtype, param_dtype=dtype, rngs=rngs)


class SwiGLU(nnx.Module):
    def __init__(self, config: TransformerConfig, rngs: nnx.Rngs):
        self.gate = _linear(config, config.d_model, config.ffn_dim, rngs)
        self.up = _linear(config, config.d_model, config.ffn_dim, rngs)
        self.down = _linear(config, config.ffn_dim, config.d_model, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Attention(nnx.Module):
    """Grouped-query attention with RoPE; q/k/v project from ``in_features`` (default ``d_model``) inputs."""

    def __init__(self, config: TransformerConfig, rngs: nnx.Rngs, *, in_features: int | None = None):
        c = config
        self.config = c
        fan_in = in_features or c.d_model
        self.q = _linear(c, fan_in, c.num_heads * c.head_dim, rngs, use_bias=c.qkv_bias)
        self.k = _linear(c, fan_in, c.num_kv_heads * c.head_dim, rngs, use_bias=c.qkv_bias)
        self.v = _linear(c, fan_in, c.num_kv_heads * c.head_dim, rngs, use_bias=c.qkv_bias)
        self.o = _linear(c, c.num_heads * c.head_dim, c.d_model, rngs, use_bias=c.attention_out_bias)
        # Qwen3: each query / key head RMS-normalised (one scale for all heads) before RoPE
        self.q_norm = RMSNorm(c.head_dim, c.norm_eps, c.jnp_dtype) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.norm_eps, c.jnp_dtype) if c.qk_norm else None
        # gpt-oss: a sink logit per query head
        self.sinks = nnx.Param(jnp.zeros((c.num_heads,), c.jnp_dtype)) if c.attention_sinks else None

    def __call__(self, x: jax.Array, positions: jax.Array, attend: Attend, query_rows: jax.Array | None = None):
        """x: [B, T, in_features] at positions int32[B, T]. Returns the output [B, T, d_model] and the new
        tokens' keys (normed when ``qk_norm``, RoPE applied), values [B, T, kv_heads, D].

        ``query_rows`` int32[B, Q]: only those rows query (``attend`` gets q [B, Q, heads, D] and every
        row's keys and values) and the output is theirs, [B, Q, d_model]."""
        c = self.config
        batch, num_tokens, _ = x.shape
        inv_freq = inverse_frequencies(c.head_dim, c.rope_theta, c.rope_scaling)
        scale = attention_factor(c.rope_scaling)
        if query_rows is None:
            query_x, query_positions = x, positions
        else:
            query_x = jnp.take_along_axis(x, query_rows[:, :, None], axis=1)
            query_positions = jnp.take_along_axis(positions, query_rows, axis=1)
        q = self.q(query_x).reshape(batch, query_x.shape[1], c.num_heads, c.head_dim)
        k = self.k(x).reshape(batch, num_tokens, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, query_positions, inv_freq, scale), apply_rope(k, positions, inv_freq, scale)
        v = self.v(x).reshape(batch, num_tokens, c.num_kv_heads, c.head_dim)
        sinks = None if self.sinks is None else self.sinks[...]
        return self.o(attend(q, k, v, sinks).reshape(batch, query_x.shape[1], -1)), k, v


class Block(nnx.Module):
    """One decoder layer (pre-norm attention and SwiGLU, residual connections); the SwiGLU is a
    mixture of experts (``scv_jax.models.moe.MoE``) when ``config.num_experts > 0``."""

    def __init__(self, config: TransformerConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps, config.jnp_dtype)
        self.attn = Attention(config, rngs)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps, config.jnp_dtype)
        self.mlp = MoE(config, rngs) if config.num_experts else SwiGLU(config, rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, attend: Attend):
        attn_out, k, v = self.attn(self.attn_norm(x), positions, attend)
        x = x + attn_out
        return x + self.mlp(self.mlp_norm(x)), k, v


def _stacked_blocks(config: TransformerConfig, rngs: nnx.Rngs) -> Block:
    """``num_layers`` independently initialised blocks as one ``Block`` with stacked parameters."""

    @nnx.split_rngs(splits=config.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs: nnx.Rngs) -> Block:
        return Block(config, rngs)

    return make(rngs)


def _layer_of(stacked, i: int):
    """Layer ``i`` of a stacked parameter (of its shape alone for an abstract model's ``ShapeDtypeStruct``)."""
    if isinstance(stacked, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(stacked.shape[1:], stacked.dtype)
    return stacked[i]


def _check_aux_layers(aux_layers, num_layers: int) -> None:
    """ValueError unless ``aux_layers`` is a non-empty tuple or list of ints in [0, num_layers)."""
    if not (isinstance(aux_layers, (tuple, list)) and aux_layers
            and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in aux_layers)):
        raise ValueError(f"aux_layers must be a non-empty tuple of layer indices in [0, {num_layers}), "
                         f"got {aux_layers!r}")


def _concat_taps(layer_taps: dict[int, jax.Array], aux_layers: tuple[int, ...]) -> jax.Array:
    """[B, T, len(aux_layers) * d_model]: ``layer_taps[i]`` (the input of layer i, [B, T, d_model]) for
    each layer i of ``aux_layers``, in its order."""
    return jnp.concatenate([layer_taps[i] for i in aux_layers], axis=-1)


def paged_positions(num_tokens: int, context_lens: jax.Array, staged: StagedKV | None,
                    tree_parents: jax.Array | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(context_lens, staged_lens) as int32[B] and the positions int32[B, T] of a paged forward's new
    tokens: context + staged + t, or + t's depth when ``tree_parents`` (``PagedModel.forward_paged``)."""
    context_lens = context_lens.astype(jnp.int32)
    staged_lens = jnp.zeros_like(context_lens) if staged is None else staged.lengths.astype(jnp.int32)
    offsets = (jnp.arange(num_tokens, dtype=jnp.int32)[None, :] if tree_parents is None
               else tree_depths(tree_parents))
    return context_lens, staged_lens, (context_lens + staged_lens)[:, None] + offsets


class Transformer(nnx.Module):
    """Decoder-only LM: ``model(tokens)`` for full sequences, ``forward_paged`` for decoding.

    Implements ``scv_jax.models.PagedModel``. Parameters: ``embed`` (``[vocab, d_model]``), ``blocks``
    (every layer parameter stacked as ``[num_layers, ...]``), ``final_norm`` and ``lm_head`` (None when
    ``config.tie_embeddings``), all in ``config.dtype``; logits are float32.
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.config = config
        dtype = config.jnp_dtype
        self.embed = nnx.Embed(config.vocab_size, config.d_model, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.blocks = _stacked_blocks(config, rngs)
        self.final_norm = RMSNorm(config.d_model, config.norm_eps, dtype)
        self.lm_head = (None if config.tie_embeddings else
                        nnx.Linear(config.d_model, config.vocab_size, use_bias=False, dtype=dtype,
                                   param_dtype=dtype, preferred_element_type=jnp.float32, rngs=rngs))

    def _logits(self, x: jax.Array) -> jax.Array:
        """float32[B, T, vocab] from the last layer's output (products accumulated in float32)."""
        x = self.final_norm(x)
        if self.lm_head is None:
            return jnp.einsum("btd,vd->btv", x, self.embed.embedding[...], preferred_element_type=jnp.float32)
        return self.lm_head(x)

    def _run_layers(self, x: jax.Array, positions: jax.Array, attend: Callable[..., jax.Array],
                    layer_inputs=None, aux_layers: tuple[int, ...] | None = None):
        """Runs the blocks over x [B, T, d_model]; each layer attends with ``attend(inputs, q, k, v, sinks,
        window)``, ``inputs`` being its slice of ``layer_inputs`` (a pytree of ``[num_layers, ...]`` arrays, or
        None) and ``window`` its sliding window (static; ``config.layer_window``). Stacked blocks run under
        ``jax.lax.scan`` when every layer has the same window, else one after another (sliced from the
        stacked parameters), as a ``per_layer`` model's blocks do.

        Returns the last layer's output, the new tokens' keys, values [layers, B, T, kv_heads, D] and the
        taps: the inputs of layers ``aux_layers`` concatenated, [B, T, len(aux_layers) * d_model] (None
        when ``aux_layers`` is None; nothing extra is then traced).
        """
        if aux_layers is not None:
            _check_aux_layers(aux_layers, self.config.num_layers)
        windows = self.config.layer_windows
        if isinstance(self.blocks, nnx.List) or len(set(windows)) > 1:
            keys, values, layer_taps = [], [], {}
            for i, block in enumerate(self._layer_blocks()):
                if aux_layers is not None and i in aux_layers:
                    layer_taps[i] = x
                inputs = jax.tree.map(lambda a: a[i], layer_inputs)
                x, k, v = block(x, positions, lambda q, k, v, sinks: attend(inputs, q, k, v, sinks, windows[i]))
                keys.append(k)
                values.append(v)
            taps = None if aux_layers is None else _concat_taps(layer_taps, aux_layers)
            return x, jnp.stack(keys), jnp.stack(values), taps
        graphdef, layer_params = nnx.split(self.blocks)

        def layer(carry, params_inputs_slot):
            x, acc = carry
            params, inputs, slot = params_inputs_slot
            if acc is not None:         # slot len(asked) (a layer not asked) is out of range: no write
                acc = acc.at[slot].set(x, mode="drop")
            block = nnx.merge(graphdef, params)
            x, k, v = block(x, positions, lambda q, k, v, sinks: attend(inputs, q, k, v, sinks, windows[0]))
            return (x, acc), (k, v)

        acc = slots = None
        if aux_layers is not None:           # one accumulator slot per distinct layer asked
            asked = tuple(dict.fromkeys(aux_layers))
            acc = jnp.zeros((len(asked), *x.shape), x.dtype)
            slots = jnp.asarray([asked.index(i) if i in asked else len(asked)
                                 for i in range(self.config.num_layers)], jnp.int32)
        (x, acc), (keys, values) = jax.lax.scan(layer, (x, acc), (layer_params, layer_inputs, slots))
        taps = None if acc is None else _concat_taps(dict(zip(asked, acc)), aux_layers)
        return x, keys, values, taps

    def _layer_blocks(self) -> list[Block]:
        """The blocks one by one: a ``per_layer`` model's, or each layer's slice of the stacked ones."""
        if isinstance(self.blocks, nnx.List):
            return list(self.blocks)
        graphdef, stacked = nnx.split(self.blocks)
        return [nnx.merge(graphdef, jax.tree.map(lambda a: _layer_of(a, i), stacked))
                for i in range(self.config.num_layers)]

    def per_layer(self) -> "Transformer":
        """This model with each layer's parameters in arrays of their own (``blocks`` an ``nnx.List`` of
        ``num_layers`` ``Block`` modules, sliced from the stacked ones; the other parameters shared), for the
        decoding steps: a layer's weights are then the step's own inputs, where a scan over stacked
        weights copies every layer's slice of them on each call (XLA's dynamic-slice; on a CPU the
        largest cost of a small model's step). Costs a second copy of the layer weights while the
        stacked model is alive."""
        if isinstance(self.blocks, nnx.List):
            return self
        model = nnx.merge(*nnx.split(self))
        model.blocks = nnx.List(self._layer_blocks())
        return model


    def __call__(self, tokens: jax.Array, aux_layers: tuple[int, ...] | None = None
                 ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """Plain causal forward with no cache: tokens int32[B, S] -> logits float32[B, S, vocab]; with
        ``aux_layers`` (i, j, ...) -> (logits, taps [B, S, len(aux_layers) * d_model]): the input of
        layer i (0: the embeddings; transformers' ``hidden_states[i]``), of layer j, ... concatenated."""
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)

        def attend(_, q, k, v, sinks, window):
            return causal_attention(q, k, v, positions, sliding_window=window, sinks=sinks)

        x, _, _, taps = self._run_layers(self.embed(tokens), positions, attend, aux_layers=aux_layers)
        return self._logits(x) if aux_layers is None else (self._logits(x), taps)

    def forward_paged(self, tokens: jax.Array, cache, block_tables: jax.Array, context_lens: jax.Array,
                      staged: StagedKV | None = None, *, tree_parents: jax.Array | None = None,
                      backend: str = "auto", aux_layers: tuple[int, ...] | None = None) -> PagedForwardOutput:
        """See ``PagedModel.forward_paged``; reads ``cache``, never writes it. Each layer attends with
        ``scv_jax.paged_attention`` (its Mosaic GPU kernel or XLA path, per ``backend``; per shard on a
        decoder's mesh: ``scv_jax.ops.attention.sharded``). ``tree_parents`` int32[B, T]: the new tokens
        form a tree (new token t's parent, -1 = after the context and staged entries): each attends to
        its ancestors and itself only, at position context + staged + its depth. ``aux_layers``: also the
        new tokens' taps, ``taps`` [B, T, len(aux_layers) * d_model] (as ``model(tokens, aux_layers)``)."""
        context_lens, staged_lens, positions = paged_positions(tokens.shape[1], context_lens, staged, tree_parents)
        layers = jnp.arange(self.config.num_layers, dtype=jnp.int32)
        staged_kv = None if staged is None else (staged.keys, staged.values)

        def attend(inputs, q, k, v, sinks, window):
            layer, layer_staged = inputs
            staged_keys, staged_values = (None, None) if layer_staged is None else layer_staged
            return sharded_paged_attention(q, cache, layer, block_tables, context_lens, staged_keys=staged_keys,
                                           staged_values=staged_values,
                                           staged_lens=None if staged is None else staged_lens, new_keys=k,
                                           new_values=v, sliding_window=window, new_token_parents=tree_parents,
                                           sinks=sinks, backend=backend)

        x, keys, values, taps = self._run_layers(self.embed(tokens), positions, attend, (layers, staged_kv),
                                                 aux_layers)
        return PagedForwardOutput(self._logits(x), keys, values, taps)

    def forward_packed(self, tokens: jax.Array, packed: PackedTokens, cache, block_tables: jax.Array,
                       context_lens: jax.Array, *, backend: str = "auto",
                       aux_layers: tuple[int, ...] | None = None) -> PagedForwardOutput:
        """``forward_paged`` of B requests' tokens packed in one row: tokens int32[N], request
        ``packed.rows[i]`` at offset ``packed.offsets[i]`` (``PackedTokens``), so a request with fewer
        tokens costs fewer (every layer but attention runs on the N tokens). Returns logits
        float32[N, vocab], K/V [layers, N, kv_heads, head_dim] and, with ``aux_layers``, taps
        [N, len(aux_layers) * d_model]; reads ``cache``, never writes it.

        Attention places each layer's queries and new K/V in a ``[B, width]`` grid (padding tokens
        dropped), runs ``scv_jax.paged_attention`` on it and takes each token's row back: a token sees
        its request's cache and its request's tokens at smaller offsets, exactly as in ``forward_paged``.
        """
        batch, width = block_tables.shape[0], packed.width
        context_lens = context_lens.astype(jnp.int32)
        rows = jnp.clip(packed.rows.astype(jnp.int32), 0, batch - 1)
        offsets = packed.offsets.astype(jnp.int32)
        real = (offsets >= 0) & (offsets < width)
        cell = jnp.where(real, rows * width + offsets, batch * width)        # batch * width: dropped
        positions = (context_lens[rows] + jnp.clip(offsets, 0, width - 1))[None]
        layers = jnp.arange(self.config.num_layers, dtype=jnp.int32)

        def to_grid(x: jax.Array) -> jax.Array:      # [1, N, heads, D] -> [B, width, heads, D]
            grid = jnp.zeros((batch * width, *x.shape[2:]), x.dtype).at[cell].set(x[0], mode="drop")
            return grid.reshape(batch, width, *x.shape[2:])

        def attend(layer, q, k, v, sinks, window):
            out = sharded_paged_attention(to_grid(q), cache, layer, block_tables, context_lens,
                                          new_keys=to_grid(k), new_values=to_grid(v), sliding_window=window,
                                          sinks=sinks, backend=backend)
            return out.reshape(batch * width, *out.shape[2:])[jnp.minimum(cell, batch * width - 1)][None]

        x, keys, values, taps = self._run_layers(self.embed(tokens.astype(jnp.int32)[None]), positions, attend,
                                                 layers, aux_layers)
        return PagedForwardOutput(self._logits(x)[0], keys[:, 0], values[:, 0], None if taps is None else taps[0])
