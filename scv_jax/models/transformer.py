"""A Llama-style decoder-only transformer in Flax NNX with paged + staged attention."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from scv_jax.models.attention import causal_mask, grouped_query_attention, prefix_mask, rope
from scv_jax.models.config import TransformerConfig
from scv_jax.models.paged_read import read_layer_kv
from scv_jax.models.protocol import PagedForwardOutput, StagedKV


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        variance = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(variance + self.eps) * self.scale[...]


class SwiGLU(nnx.Module):
    def __init__(self, config: TransformerConfig, rngs: nnx.Rngs):
        self.gate = nnx.Linear(config.d_model, config.ffn_dim, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(config.d_model, config.ffn_dim, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(config.ffn_dim, config.d_model, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Attention(nnx.Module):
    def __init__(self, config: TransformerConfig, rngs: nnx.Rngs):
        c = config
        self.config = c
        self.q = nnx.Linear(c.d_model, c.num_heads * c.head_dim, use_bias=False, rngs=rngs)
        self.k = nnx.Linear(c.d_model, c.num_kv_heads * c.head_dim, use_bias=False, rngs=rngs)
        self.v = nnx.Linear(c.d_model, c.num_kv_heads * c.head_dim, use_bias=False, rngs=rngs)
        self.o = nnx.Linear(c.num_heads * c.head_dim, c.d_model, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, prefix) -> tuple[jax.Array, ...]:
        """x: [B, T, d_model]; prefix: None or (keys, values [B, N, kv_heads, D], mask bool[B, T, N]).

        Returns the output [B, T, d_model] and the new tokens' keys, values [B, T, kv_heads, D].
        """
        c = self.config
        batch, num_tokens, _ = x.shape
        q = rope(self.q(x).reshape(batch, num_tokens, c.num_heads, c.head_dim), positions, c.rope_theta)
        k = rope(self.k(x).reshape(batch, num_tokens, c.num_kv_heads, c.head_dim), positions,
                 c.rope_theta)
        v = self.v(x).reshape(batch, num_tokens, c.num_kv_heads, c.head_dim)
        keys, values, mask = k, v, causal_mask(batch, num_tokens)
        if prefix is not None:
            keys = jnp.concatenate([prefix[0].astype(k.dtype), k], axis=1)
            values = jnp.concatenate([prefix[1].astype(v.dtype), v], axis=1)
            mask = jnp.concatenate([prefix[2], mask], axis=2)
        out = grouped_query_attention(q, keys, values, mask)
        return self.o(out.reshape(batch, num_tokens, -1)), k, v


class Block(nnx.Module):
    def __init__(self, config: TransformerConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config, rngs)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = SwiGLU(config, rngs)

    def __call__(self, x, positions, prefix):
        attn_out, k, v = self.attn(self.attn_norm(x), positions, prefix)
        x = x + attn_out
        return x + self.mlp(self.mlp_norm(x)), k, v


class Transformer(nnx.Module):
    """Decoder-only LM: ``model(tokens)`` for full sequences, ``forward_paged`` for decoding.

    Implements ``scv_jax.models.PagedModel``.
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embed = nnx.Embed(config.vocab_size, config.d_model, rngs=rngs)
        self.blocks = nnx.List([Block(config, rngs) for _ in range(config.num_layers)])
        self.final_norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = (None if config.tie_embeddings else
                        nnx.Linear(config.d_model, config.vocab_size, use_bias=False, rngs=rngs))

    def _logits(self, x: jax.Array) -> jax.Array:
        x = self.final_norm(x)
        if self.lm_head is None:
            return self.embed.attend(x).astype(jnp.float32)
        return self.lm_head(x).astype(jnp.float32)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Plain causal forward with no cache: tokens int32[B, S] -> logits float32[B, S, vocab]."""
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        x = self.embed(tokens)
        for block in self.blocks:
            x, _, _ = block(x, positions, None)
        return self._logits(x)

    def forward_paged(self, tokens: jax.Array, cache, block_tables: jax.Array, context_lens: jax.Array,
                      staged: StagedKV | None = None) -> PagedForwardOutput:
        """See ``PagedModel.forward_paged``; reads ``cache``, never writes it."""
        batch, num_tokens = tokens.shape
        context_lens = context_lens.astype(jnp.int32)
        staged_lens = jnp.zeros_like(context_lens) if staged is None else staged.lengths.astype(jnp.int32)
        positions = (context_lens + staged_lens)[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)
        x = self.embed(tokens)
        new_keys, new_values = [], []
        for layer, block in enumerate(self.blocks):
            keys, values = read_layer_kv(cache, layer, block_tables)
            mask = prefix_mask(context_lens, keys.shape[1], num_tokens)
            if staged is not None:
                keys = jnp.concatenate([keys, staged.keys[layer].astype(jnp.float32)], axis=1)
                values = jnp.concatenate([values, staged.values[layer].astype(jnp.float32)], axis=1)
                mask = jnp.concatenate(
                    [mask, prefix_mask(staged_lens, staged.keys.shape[2], num_tokens)], axis=2)
            x, k, v = block(x, positions, (keys, values, mask))
            new_keys.append(k)
            new_values.append(v)
        return PagedForwardOutput(self._logits(x), jnp.stack(new_keys), jnp.stack(new_values))
