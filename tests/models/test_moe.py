"""The mixture-of-experts block (``scv_jax.models.moe``): the ragged_dot path against a dense
reference (every expert on every token) on random, tied and degenerate routings; a MoE
``Transformer``'s layouts, forwards and config; its parameters on a mesh. (Against transformers:
``test_hf.py``'s ``qwen3_moe`` and ``mixtral`` fixtures.)"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st
from jax.sharding import PartitionSpec as P

import scv_jax
from scv_jax.models import PackedTokens, Transformer, TransformerConfig
from scv_jax.models.moe import experts_ragged, moe_dense_reference, moe_forward, route
from scv_jax.sharding.params import HeadLayout, parameter_spec, place_transformer, tensor_parallel_split
from tests.models.fixtures import commit_prefix, tiny_model

MOE = TransformerConfig(vocab_size=32, num_layers=2, d_model=16, num_heads=4, num_kv_heads=2, head_dim=8,
                        ffn_dim=48, qk_norm=True, num_experts=5, num_experts_per_tok=2, moe_ffn_dim=12)


def _weights(seed: int, n: int, d: int, f: int, e: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype(np.float32)
    return (x, rng.standard_normal((d, e)).astype(np.float32), rng.standard_normal((e, d, f)).astype(np.float32),
            rng.standard_normal((e, d, f)).astype(np.float32), rng.standard_normal((e, f, d)).astype(np.float32))


@functools.partial(jax.jit, static_argnums=(5, 6))
def _both(x, router, gate, up, down, k, normalize):
    """(``moe_forward``, ``moe_dense_reference``) of the same inputs, one compilation."""
    return (moe_forward(x, router, gate, up, down, k, normalize),
            moe_dense_reference(x, router, gate, up, down, k, normalize))


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 13), d=st.integers(1, 9), f=st.integers(1, 7), e=st.integers(1, 6), data=st.data(),
       routing=st.sampled_from(["random", "tied columns", "all tied", "one expert dominates"]),
       normalize=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_ragged_moe_equals_dense_reference(n, d, f, e, data, routing, normalize, seed):
    """ragged_dot over expert-sorted pairs = every expert on every token, masked by the routing weights:
    odd sizes, one token, ties in the router logits (equal columns; all equal: every token to experts
    0..k-1, the rest get no token), one expert chosen by every token."""
    k = data.draw(st.integers(1, e), label="k")
    x, router, gate, up, down = _weights(seed, n, d, f, e)
    if routing == "tied columns" and e > 1:
        router[:, e - 1] = router[:, 0]
    elif routing == "all tied":
        router[:] = 0.0
    elif routing == "one expert dominates":
        x = np.abs(x) + 1.0                     # positive inputs, one expert's column far larger
        router = np.abs(router)
        router[:, data.draw(st.integers(0, e - 1), label="expert")] += 100.0
    args = tuple(jnp.asarray(a) for a in (router, gate, up, down)) + (k, normalize)
    got, want = (np.asarray(a) for a in _both(jnp.asarray(x), *args))
    assert got.shape == (n, d)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * max(1.0, np.abs(want).max()))


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 9), e=st.integers(1, 5), data=st.data(), seed=st.integers(0, 2 ** 16))
def test_experts_ragged_applies_each_chosen_expert(n, e, data, seed):
    """Row (t, j) of ``experts_ragged`` is expert experts[t, j]'s SwiGLU of x[t], whatever the choice:
    every pair on one expert, experts chosen by no token, repeats of an expert within a token."""
    k = data.draw(st.integers(1, 3), label="k")
    x, _, gate, up, down = _weights(seed, n, 5, 3, e)
    experts = np.array(data.draw(st.lists(st.lists(st.integers(0, e - 1), min_size=k, max_size=k),
                                          min_size=n, max_size=n), label="experts"), np.int32)
    got = np.asarray(experts_ragged(*(jnp.asarray(a) for a in (x, experts, gate, up, down))))
    hidden = jax.nn.silu(np.einsum("nd,nkdf->nkf", x, gate[experts])) * np.einsum("nd,nkdf->nkf", x, up[experts])
    want = np.einsum("nkf,nkfd->nkd", hidden, down[experts])
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * max(1.0, np.abs(want).max()))


def test_route_renormalises_the_top_k():
    logits = jnp.asarray([[0.0, 1.0, 2.0, 3.0], [1.0, 1.0, 1.0, 1.0]])
    weights, experts = route(logits, 2, normalize=False)
    probs = np.exp([0.0, 1.0, 2.0, 3.0]) / np.exp([0.0, 1.0, 2.0, 3.0]).sum()
    np.testing.assert_allclose(weights[0], probs[[3, 2]], rtol=1e-6)
    assert experts.tolist() == [[3, 2], [0, 1]]                  # ties: the lower index first
    weights, _ = route(logits, 2, normalize=True)
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(weights[0], probs[[3, 2]] / probs[[3, 2]].sum(), rtol=1e-6)   # Mixtral's


def test_moe_model_per_layer_layout_computes_what_the_stacked_one_does():
    model = tiny_model(MOE, seed=3)
    mlp = nnx.state(model, nnx.Param)["blocks"]["mlp"]
    assert mlp["experts_gate"].get_value().shape == (2, 5, 16, 12)
    assert mlp["experts_down"].get_value().shape == (2, 5, 12, 16)
    assert mlp["router"]["kernel"].get_value().shape == (2, 16, 5)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, 13)), jnp.int32)
    np.testing.assert_allclose(np.asarray(model.per_layer()(tokens)), np.asarray(model(tokens)), rtol=1e-5, atol=1e-5)


def test_moe_model_paged_and_packed_forwards_give_the_full_logits():
    """A MoE Transformer's paged (prefix + new tokens) and packed (with padding) forwards give the
    full forward's logits."""
    model = tiny_model(MOE, seed=3)
    tokens = np.random.default_rng(0).integers(0, 32, (1, 13)).astype(np.int32)
    full = np.asarray(model(jnp.asarray(tokens)))[0]
    cache = scv_jax.PagedKVCache.create(2, 8, 4, 2, 8, dtype="float32")
    tables = jnp.asarray([[5, 2, 7, 0]], jnp.int32)
    first = model.forward_paged(jnp.asarray(tokens[:, :7]), cache, tables, jnp.zeros(1, jnp.int32))
    cache = commit_prefix(cache, first, tables, [7], 4)
    rest = model.forward_paged(jnp.asarray(tokens[:, 7:]), cache, tables, jnp.asarray([7], jnp.int32))
    np.testing.assert_allclose(np.concatenate([first.logits[0], rest.logits[0]]), full, rtol=1e-4, atol=1e-4)
    packed = PackedTokens(jnp.zeros(8, jnp.int32), jnp.asarray([-1, 5, 4, 3, 2, 1, 0, 6], jnp.int32), 6)
    out = model.forward_packed(jnp.asarray(np.r_[0, tokens[0, 7:][::-1], 3]), packed, cache, tables,
                               jnp.asarray([7], jnp.int32))
    np.testing.assert_allclose(np.asarray(out.logits)[1:-1][::-1], full[7:], rtol=1e-4, atol=1e-4)


def test_moe_parameters_are_replicated_on_a_mesh():
    """The sharding code accepts a MoE model: router and experts replicated (``parameter_spec``), the
    laid-out model computes the same logits, and its parameters can be placed on a mesh."""
    odd = TransformerConfig(**{**MOE.to_dict(), "ffn_dim": 90, "num_kv_heads": 4})      # ffn_dim unused by MoE
    HeadLayout.split(odd, 4, "test")
    for name in ("blocks/mlp/router/kernel", "blocks/mlp/experts_gate", "blocks/mlp/experts_down"):
        assert parameter_spec(name, MOE, 2, vocab_parallel=True) == P()
    model = tiny_model(MOE, seed=1)
    laid_out = nnx.merge(*tensor_parallel_split(model, 2, "test"))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 32, (2, 5)), jnp.int32)
    np.testing.assert_allclose(np.asarray(laid_out(tokens)), np.asarray(model(tokens)), rtol=2e-5, atol=2e-5)
    mesh = scv_jax.sharding.mesh.decoder_mesh(1, 1, devices=jax.devices()[:1])
    graphdef, state = place_transformer(model, mesh, tensor_parallel=True, vocab_parallel=True, who="test")
    np.testing.assert_allclose(np.asarray(nnx.merge(graphdef, state)(tokens)), np.asarray(model(tokens)),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fields, match", [
    (dict(num_experts=-1), "TransformerConfig.num_experts must be an int >= 0, got -1"),
    (dict(num_experts=4, num_experts_per_tok=5), r"num_experts_per_tok must be an int in \[1, num_experts \(4\)\]"),
    (dict(num_experts=4, num_experts_per_tok=0), "num_experts_per_tok must be an int in"),
    (dict(num_experts=4, moe_ffn_dim=0), "TransformerConfig.moe_ffn_dim must be None or an int >= 1, got 0"),
    (dict(num_experts=4, norm_topk_prob=1), "TransformerConfig.norm_topk_prob must be a bool, got 1"),
])
def test_moe_config_errors_name_the_field(fields, match):
    with pytest.raises(ValueError, match=match) as error:
        TransformerConfig(**fields)
    assert "\n" not in str(error.value)


def test_moe_config_round_trip():
    assert TransformerConfig.from_dict(MOE.to_dict()) == MOE and MOE.expert_ffn_dim == 12
    assert TransformerConfig(num_experts=2).expert_ffn_dim == 256                  # None: ffn_dim
    assert isinstance(Transformer(TransformerConfig(num_experts=0), rngs=nnx.Rngs(0)).blocks.mlp,
                      scv_jax.models.transformer.SwiGLU)


def test_moe_weights_round_trip(tmp_path):
    """``save_model`` / ``load_model`` keep a MoE model's router and experts (one array per layer)."""
    from scv_jax.models.weights import load_model, save_model

    model = tiny_model(MOE, seed=2)
    save_model(model, tmp_path / "moe.npz", dtype=np.float32)
    loaded = load_model(tmp_path / "moe.npz")
    assert loaded.config == MOE
    tokens = jnp.asarray([[1, 5, 7, 30, 2]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(loaded(tokens)), np.asarray(model(tokens)))
