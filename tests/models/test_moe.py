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
from scv_jax.models.moe import (ExpertWeights, experts_ragged, moe_dense_reference, moe_forward, partial_sum, route,
                                swiglu)
from scv_jax.sharding.params import HeadLayout, parameter_spec, place_transformer, tensor_parallel_split
from tests.models.fixtures import commit_prefix, tiny_model

MOE = TransformerConfig(vocab_size=32, num_layers=2, d_model=16, num_heads=4, num_kv_heads=2, head_dim=8,
                        ffn_dim=48, qk_norm=True, num_experts=5, num_experts_per_tok=2, moe_ffn_dim=12)


def _weights(seed: int, n: int, d: int, f: int, e: int, biases: bool = False):
    """(x [n, d], router [d, E], router bias [E] or None, ExpertWeights), standard normal float32."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    x, router = normal(n, d), normal(d, e)
    weights = ExpertWeights(normal(e, d, f), normal(e, d, f), normal(e, f, d),
                            *((normal(e, f), normal(e, f), normal(e, d)) if biases else ()))
    return x, router, normal(e) if biases else None, weights


@functools.partial(jax.jit, static_argnames=("k", "normalize", "limit"))
def _both(x, router, router_bias, weights, *, k, normalize, limit):
    """(``moe_forward``, ``moe_dense_reference``) of the same inputs, one compilation."""
    options = dict(router_bias=router_bias, limit=limit)
    return (moe_forward(x, router, weights, k, normalize, **options),
            moe_dense_reference(x, router, weights, k, normalize, **options))


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 13), d=st.integers(1, 9), f=st.integers(1, 7), e=st.integers(1, 6), data=st.data(),
       routing=st.sampled_from(["random", "tied columns", "all tied", "one expert dominates"]),
       normalize=st.booleans(), gpt_oss=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_ragged_moe_equals_dense_reference(n, d, f, e, data, routing, normalize, gpt_oss, seed):
    """ragged_dot over expert-sorted pairs = every expert on every token, masked by the routing weights:
    odd sizes, one token, ties in the router logits (equal columns; all equal: every token to experts
    0..k-1, the rest get no token), one expert chosen by every token; gpt-oss's router and expert
    biases and clamped SwiGLU (limit 1: most units clamped) or none."""
    k = data.draw(st.integers(1, e), label="k")
    x, router, router_bias, weights = _weights(seed, n, d, f, e, biases=gpt_oss)
    if routing == "tied columns" and e > 1:
        router[:, e - 1] = router[:, 0]
    elif routing == "all tied":
        router[:] = 0.0
    elif routing == "one expert dominates":
        x = np.abs(x) + 1.0                     # positive inputs, one expert's column far larger
        router = np.abs(router)
        router[:, data.draw(st.integers(0, e - 1), label="expert")] += 100.0
    if router_bias is not None and routing != "random":      # the bias must not break the tie tested
        router_bias[:] = 0.0
    got, want = (np.asarray(a) for a in _both(jnp.asarray(x), jnp.asarray(router), router_bias, weights, k=k,
                                              normalize=normalize, limit=1.0 if gpt_oss else None))
    assert got.shape == (n, d)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * max(1.0, np.abs(want).max()))


@settings(max_examples=6, deadline=None)       # each example compiles its shapes (~1.5 s)
@given(n=st.integers(1, 9), shards=st.sampled_from([1, 2, 3, 4]), per_shard=st.integers(1, 3), data=st.data(),
       gpt_oss=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_expert_parallel_parts_sum_to_the_whole_block(n, shards, per_shard, data, gpt_oss, seed):
    """Expert parallelism's arithmetic (what each "model" shard computes before the all-reduce): the
    ``partial_sum`` of each shard's experts (``first_expert`` = shard * E / shards), summed over the
    shards, is ``moe_forward`` on every expert; a shard whose experts no token chose adds exactly zero."""
    e = shards * per_shard
    k = data.draw(st.integers(1, e), label="k")
    x, router, router_bias, w = _weights(seed, n, 6, 4, e, biases=gpt_oss)
    options = dict(router_bias=router_bias, limit=1.0 if gpt_oss else None)
    whole = np.asarray(moe_forward(jnp.asarray(x), router, w, k, True, **options))
    parts = [np.asarray(partial_sum(jnp.asarray(x), router, ExpertWeights(*(None if a is None else
                                                                           a[s * per_shard:(s + 1) * per_shard]
                                                                           for a in w)),
                                    k, True, **options, first_expert=s * per_shard)) for s in range(shards)]
    np.testing.assert_allclose(sum(parts), whole, rtol=2e-5, atol=2e-5 * max(1.0, np.abs(whole).max()))
    _, chosen = route(jnp.asarray(x) @ router + (0 if router_bias is None else router_bias), k, True)
    for s, part in enumerate(parts):
        if not np.any((np.asarray(chosen) >= s * per_shard) & (np.asarray(chosen) < (s + 1) * per_shard)):
            assert not part.any()


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 9), e=st.integers(1, 5), data=st.data(), biases=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_experts_ragged_applies_each_chosen_expert(n, e, data, biases, seed):
    """Row (t, j) of ``experts_ragged`` is expert experts[t, j]'s SwiGLU of x[t] (with its own biases
    when there are), whatever the choice: every pair on one expert, experts chosen by no token,
    repeats of an expert within a token."""
    k = data.draw(st.integers(1, 3), label="k")
    x, _, _, w = _weights(seed, n, 5, 3, e, biases)
    experts = np.array(data.draw(st.lists(st.lists(st.integers(0, e - 1), min_size=k, max_size=k),
                                          min_size=n, max_size=n), label="experts"), np.int32)
    got = np.asarray(experts_ragged(jnp.asarray(x), jnp.asarray(experts), w))
    bias = (lambda b: b[experts]) if biases else (lambda b: 0.0)  # noqa: E731
    gate = np.einsum("nd,nkdf->nkf", x, w.gate[experts]) + bias(w.gate_bias)
    up = np.einsum("nd,nkdf->nkf", x, w.up[experts]) + bias(w.up_bias)
    want = np.einsum("nkf,nkfd->nkd", jax.nn.silu(gate) * up, w.down[experts]) + bias(w.down_bias)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * max(1.0, np.abs(want).max()))


def test_clamped_swiglu_is_gpt_oss_formula():
    """gpt-oss's experts: g = min(gate, L), u = clip(up, -L, L), g * sigmoid(1.702 g) * (u + 1)."""
    gate = jnp.asarray([-9.0, -1.0, 0.0, 2.0, 7.5, 20.0])
    up = jnp.asarray([-9.0, 8.0, 3.0, -0.5, 0.0, 7.0])
    g, u = np.minimum(np.asarray(gate), 7.0), np.clip(np.asarray(up), -7.0, 7.0)
    want = g / (1 + np.exp(-1.702 * g)) * (u + 1)
    np.testing.assert_allclose(np.asarray(swiglu(gate, up, 7.0)), want, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(swiglu(gate, up, None)), np.asarray(jax.nn.silu(gate) * up), rtol=1e-6)


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


def test_moe_experts_are_split_over_the_model_axis():
    """The sharding code accepts a MoE model: experts split over "model" by expert, router replicated
    (``parameter_spec``; a number of experts the axis does not divide is refused naming it), the laid-out
    model computes the same logits, and its parameters can be placed on a mesh. (Decoding on meshes:
    tests/decoding/test_mesh.py's qwen-style pair, a gpt-oss-style MoE.)"""
    odd = TransformerConfig(**{**MOE.to_dict(), "ffn_dim": 90, "num_kv_heads": 5, "num_heads": 5})   # ffn_dim unused
    HeadLayout.split(odd, 5, "test")
    with pytest.raises(ValueError, match=r"^test: num_experts \(5\) must be a multiple of the mesh's model axis "
                                         r"\(2\) \(the experts are split over it\)$"):
        HeadLayout.split(MOE, 2, "test")
    assert parameter_spec("blocks/mlp/router/kernel", MOE, 5, vocab_parallel=True) == P()
    for name in ("blocks/mlp/experts_gate", "blocks/mlp/experts_down", "blocks/mlp/experts_down_bias"):
        assert parameter_spec(name, MOE, 5, vocab_parallel=True) == P(None, "model")
    model = tiny_model(TransformerConfig(**{**MOE.to_dict(), "num_experts": 4}), seed=1)
    laid_out = nnx.merge(*tensor_parallel_split(model, 2, "test"))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 32, (2, 5)), jnp.int32)
    np.testing.assert_allclose(np.asarray(laid_out(tokens)), np.asarray(model(tokens)), rtol=2e-5, atol=2e-5)
    mesh = scv_jax.sharding.mesh.decoder_mesh(1, 1, devices=jax.devices()[:1])
    graphdef, state = place_transformer(model, mesh, tensor_parallel=True, vocab_parallel=True, who="test")
    np.testing.assert_allclose(np.asarray(nnx.merge(graphdef, state)(tokens)), np.asarray(model(tokens)),
                               rtol=1e-6, atol=1e-6)


GPT_OSS_STYLE = TransformerConfig(vocab_size=32, num_layers=2, d_model=16, num_heads=6, num_kv_heads=2, head_dim=8,
                                  ffn_dim=48, qkv_bias=True, attention_out_bias=True, attention_sinks=True,
                                  sliding_window=3, sliding_layers=(True, False), num_experts=4, num_experts_per_tok=2,
                                  moe_ffn_dim=8, moe_bias=True, swiglu_limit=1.0)


def test_gpt_oss_style_model_tensor_parallel_layout_and_forwards():
    """gpt-oss's parts together (random sinks and biases, a windowed and a full layer, the clamp): the
    per-layer, paged and tensor-parallel layouts (6 query heads over 4 shards: groups padded with
    zero heads, whose sinks are padded too) compute the full forward's logits."""
    model = tiny_model(GPT_OSS_STYLE, seed=4)
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(4)
    for path, var in nnx.to_flat_state(state):
        if path[-1] == "sinks" or str(path[-1]).endswith("bias"):
            var.set_value(jnp.asarray(rng.standard_normal(var.get_value().shape), jnp.float32))
    model = nnx.merge(graphdef, state)
    tokens = jnp.asarray(rng.integers(0, 32, (2, 11)), jnp.int32)
    full = np.asarray(model(tokens))
    np.testing.assert_allclose(np.asarray(model.per_layer()(tokens)), full, rtol=1e-5, atol=1e-5)
    laid_out = nnx.merge(*tensor_parallel_split(model, 4, "test"))
    assert laid_out.config.num_heads == 8
    np.testing.assert_allclose(np.asarray(laid_out(tokens)), full, rtol=2e-5, atol=2e-5)
    cache = scv_jax.PagedKVCache.create(2, 8, 4, 2, 8, dtype="float32")
    tables = jnp.asarray([[5, 2, 7, 0], [1, 3, 4, 6]], jnp.int32)
    first = model.forward_paged(tokens[:, :6], cache, tables, jnp.zeros(2, jnp.int32))
    cache = commit_prefix(cache, first, tables, [6, 6], 4)
    rest = model.forward_paged(tokens[:, 6:], cache, tables, jnp.full(2, 6, jnp.int32))
    np.testing.assert_allclose(np.concatenate([first.logits, rest.logits], axis=1), full, rtol=1e-4, atol=1e-4)


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
