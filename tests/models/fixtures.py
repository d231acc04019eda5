"""Tiny random models shared by the model, decoder and CLI tests."""

from __future__ import annotations

import jax
from flax import nnx

from scv_jax.models import Transformer, TransformerConfig

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
    """A draft that agrees with ``model`` often but not always: its weights plus relative noise."""
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [x + noise * jax.numpy.std(x) * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, noisy))
