"""Tiny random models and paged-forward helpers shared by the model, decoder and CLI tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import scv_jax
from scv_jax.models import PagedForwardOutput, Transformer, TransformerConfig

TINY = TransformerConfig(vocab_size=16, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8,
                         ffn_dim=48)
TINY_DRAFT = TransformerConfig(vocab_size=16, num_layers=1, d_model=16, num_heads=2, num_kv_heads=1,
                               head_dim=8, ffn_dim=32)


def tiny_model(config: TransformerConfig = TINY, seed: int = 0, scale: float = 3.0) -> Transformer:
    """A random model with sharpened logits (``scale`` on the embeddings) so argmax ties never occur."""
    model = Transformer(config, rngs=nnx.Rngs(seed))
    model.embed.embedding.set_value(model.embed.embedding.get_value() * scale)
    return model


def perturbed_copy(model: Transformer, noise: float, seed: int = 1) -> Transformer:
    """A draft that agrees with ``model`` often but not always: its weights plus relative noise (same
    dtypes)."""
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))

    def noisy(x, key):
        x32 = x.astype(jnp.float32)
        return (x32 + noise * jnp.std(x32) * jax.random.normal(key, x.shape)).astype(x.dtype)

    return nnx.merge(graphdef, jax.tree.unflatten(treedef, [noisy(x, k) for x, k in zip(leaves, keys)]))


def pad_rows(rows, width: int, fill: int = 0) -> np.ndarray:
    """int32[len(rows), width]: the token lists, right-padded with ``fill``."""
    out = np.full((len(rows), width), fill, np.int32)
    for r, row in zip(out, rows):
        r[:len(row)] = row
    return out


def commit_prefix(cache, out: PagedForwardOutput, block_tables: jax.Array, lengths, block_size: int):
    """``cache`` with the K/V of tokens t < lengths[b] of a paged forward that started at position 0."""
    batch, num_tokens = out.keys.shape[1:3]
    positions = np.broadcast_to(np.arange(num_tokens), (batch, num_tokens))
    slots = scv_jax.slots_from_block_table(block_tables, jnp.asarray(positions), block_size).reshape(-1)
    mask = jnp.asarray((positions < np.asarray(lengths)[:, None]).reshape(-1))
    flat = [x.reshape(x.shape[0], batch * num_tokens, *x.shape[3:]) for x in (out.keys, out.values)]
    return scv_jax.commit_draft_kv(cache, *flat, slots, mask)
