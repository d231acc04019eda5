"""Megatron-style layout of a Transformer over a model axis: KV-head replication and query-group
padding change no output; the shardings of each parameter; errors naming the field."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from scv_jax.models import TransformerConfig
from scv_jax.sharding.params import HeadLayout, parameter_spec, tensor_parallel_config, tensor_parallel_split
from tests.models.fixtures import tiny_model


@pytest.mark.parametrize("heads, kv_heads, model_size, expected", [
    (8, 4, 2, (8, 4)),      # KV heads divide: split, nothing replicated
    (8, 2, 8, (8, 8)),      # each KV head replicated 4 times, one query head per shard
    (6, 2, 4, (8, 4)),      # the demo target on 4: KV heads x2, groups of 3 padded to 4
    (6, 2, 8, (8, 8)),      # ... on 8: KV heads x4, groups padded to 4
    (2, 1, 8, (8, 8)),      # the demo draft on 8
])
def test_laid_out_model_computes_the_same_logits(heads, kv_heads, model_size, expected):
    config = TransformerConfig(vocab_size=32, num_layers=1, d_model=32, num_heads=heads, num_kv_heads=kv_heads,
                               head_dim=8, ffn_dim=64, qkv_bias=True, qk_norm=True)
    model = tiny_model(config, seed=0)
    laid_out = nnx.merge(*tensor_parallel_split(model, model_size, "test"))
    assert (laid_out.config.num_heads, laid_out.config.num_kv_heads) == expected
    assert tensor_parallel_config(config, model_size, "test") == laid_out.config
    # both head counts divide the axis: shard c's query heads use exactly its own KV heads
    assert laid_out.config.num_heads % model_size == 0 and laid_out.config.num_kv_heads % model_size == 0
    tokens = np.random.default_rng(0).integers(0, 32, (2, 11))
    np.testing.assert_allclose(np.asarray(laid_out(tokens)), np.asarray(model(tokens)), rtol=2e-5, atol=2e-5)


def test_padded_query_heads_are_zero_and_kv_heads_are_copies():
    config = TransformerConfig(num_heads=6, num_kv_heads=2, head_dim=4, d_model=8, ffn_dim=16)
    layout = HeadLayout.split(config, 4, "test")
    assert (layout.replicas, layout.padded_group) == (2, 4)
    q = np.arange(3 * 24, dtype=np.float32).reshape(3, 24) + 1          # [d, heads * head_dim]
    padded = layout.queries(q, -1).reshape(3, 2, 4, 4)                   # [d, kv, group, head_dim]
    np.testing.assert_array_equal(padded[:, :, :3], q.reshape(3, 2, 3, 4))
    assert not padded[:, :, 3].any()
    kv = np.arange(3 * 8, dtype=np.float32).reshape(3, 8)
    repeated = layout.keys_values(kv, -1).reshape(3, 4, 4)
    np.testing.assert_array_equal(repeated[:, [0, 1]], np.stack([kv[:, :4]] * 2, axis=1))
    np.testing.assert_array_equal(repeated[:, [2, 3]], np.stack([kv[:, 4:]] * 2, axis=1))


@pytest.mark.parametrize("fields, model_size, match", [
    (dict(num_heads=6, num_kv_heads=3), 2, r"num_kv_heads \(3\) cannot be split over the mesh's model axis \(2\)"),
    (dict(num_heads=8, num_kv_heads=4), 3, r"num_kv_heads \(4\) cannot be split"),
    (dict(ffn_dim=90), 4, r"ffn_dim \(90\) must be a multiple of the mesh's model axis \(4\)"),
])
def test_layout_errors_name_the_field(fields, model_size, match):
    with pytest.raises(ValueError, match="the target: " + match):
        HeadLayout.split(TransformerConfig(**fields), model_size, "the target")


def test_parameter_specs():
    config = TransformerConfig(vocab_size=64)
    spec = lambda name, **kw: parameter_spec(name, config, 4, vocab_parallel=kw.get("vocab", True))  # noqa: E731
    assert spec("blocks/attn/q/kernel") == spec("blocks/mlp/up/kernel") == P(None, None, "model")
    assert spec("blocks/attn/o/kernel") == spec("blocks/mlp/down/kernel") == P(None, "model", None)
    assert spec("blocks/attn/k/bias") == P(None, "model")
    assert spec("blocks/attn_norm/scale") == spec("final_norm/scale") == P()
    assert spec("embed/embedding") == P("model", None) and spec("lm_head/kernel") == P(None, "model")
    assert spec("embed/embedding", vocab=False) == P()
    odd = TransformerConfig(vocab_size=66)                               # does not divide: replicated
    assert parameter_spec("embed/embedding", odd, 4, vocab_parallel=True) == P()
