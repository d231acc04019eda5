"""EAGLE-3 draft heads: both checkpoint layouts and the torch .bin path load, and the head's forward
(dense and paged) equals an independent numpy reference of the published semantics."""

from __future__ import annotations

import collections
import copy
import dataclasses
import io
import json
import os
import pathlib
import pickle
import shutil
import sys
import tempfile
import types
import zipfile

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings, strategies as st
from safetensors.numpy import save_file

import scv_jax
from scv_jax.models import Eagle3Head, StagedKV, TransformerConfig, load_eagle3, save_eagle3
from scv_jax.models.torch_checkpoint import read_torch_state_dict
from tests.models.eagle3_fixtures import published
from tests.models.eagle3_fixtures.heads import BIN_HEAD, LAYER_PREFIX, head_config, head_tensors
from tests.models.fixtures import commit_prefix, tiny_model

FIXTURES = pathlib.Path(__file__).parent / "eagle3_fixtures"
TARGET = TransformerConfig(vocab_size=24, num_layers=8, d_model=16, num_heads=2, num_kv_heads=1, head_dim=8,
                           ffn_dim=32)
HEAD = dict(hidden=16, heads=4, kv_heads=2, head_dim=8, ffn=24, target_vocab=24, draft_vocab=12)
SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8}


@pytest.fixture(scope="module")
def target():
    return tiny_model(TARGET, seed=5)


def write_head(directory: pathlib.Path, tensors: dict, config: dict) -> pathlib.Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config))
    return directory


# ------------------------------------------------------------------------------ numpy reference
def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> np.ndarray:
    """transformers' default, "llama3" and "yarn" RoPE frequencies."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    if scaling is None:
        return inv
    if scaling["rope_type"] == "yarn":          # transformers' _compute_yarn_parameters
        def dim(rotations):
            return head_dim * np.log(scaling["original_max_position_embeddings"] / (rotations * 2 * np.pi)) / (
                2 * np.log(theta))
        low, high = dim(scaling.get("beta_fast") or 32), dim(scaling.get("beta_slow") or 1)
        if scaling.get("truncate", True):
            low, high = np.floor(low), np.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        ramp = np.clip((np.arange(head_dim // 2) - low) / (high - low + 0.001 * (low == high)), 0, 1)
        extrapolation = 1 - ramp
        return inv / scaling["factor"] * (1 - extrapolation) + inv * extrapolation
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * np.pi / inv
    smooth = (old / wavelen - scaling["low_freq_factor"]) / (scaling["high_freq_factor"] - scaling["low_freq_factor"])
    scaled = np.where(wavelen > old / scaling["low_freq_factor"], inv / scaling["factor"], inv)
    medium = (wavelen <= old / scaling["low_freq_factor"]) & (wavelen >= old / scaling["high_freq_factor"])
    return np.where(medium, (1 - smooth) * inv / scaling["factor"] + smooth * inv, scaled)


def yarn_attention_factor(scaling: dict) -> float:
    """transformers' YaRN attention factor (what cos and sin are multiplied by)."""
    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * np.log(scale) + 1.0
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(scaling["factor"], scaling["mscale"]) / mscale(scaling["factor"], scaling["mscale_all_dim"])
    return mscale(scaling["factor"])


def rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """x [T, heads, D] rotated Llama style: (x * cos) + (rotate_half(x) * sin), angles repeated twice."""
    angles = np.concatenate([positions[:, None] * inv_freq] * 2, axis=-1)[:, None, :]
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * np.cos(angles) + rotated * np.sin(angles)


def reference(tensors: dict, config: dict, embedding: np.ndarray, token_ids: np.ndarray,
              hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(logits [B, T, target vocab], hidden_out [B, T, H]) in float64, straight from the checkpoint
    (its embed_tokens.weight when it has one, else ``embedding``) and config.json, with the published
    defaults: rope_theta 10000 (or rope_parameters'), head_dim H / heads, norm_before_residual false,
    norm_output (speculators: the normed output passed on) false; q/k norms for a Qwen3 layer."""
    w = {k: np.asarray(v, np.float64) if v.dtype.kind == "f" else v for k, v in tensors.items()}
    embedding = w.get("embed_tokens.weight", embedding)
    llama = config.get("transformer_layer_config", config)
    layout = "speculators" if "speculators_model_type" in config else "eagle3"
    p = LAYER_PREFIX[layout]
    heads = llama["num_attention_heads"]
    eps, kv_heads, head_dim = (llama.get("rms_norm_eps", 1e-6), llama.get("num_key_value_heads", heads),
                               llama.get("head_dim") or llama["hidden_size"] // heads)
    rope_fields = llama.get("rope_parameters") or {"rope_theta": llama.get("rope_theta", 10000.0),
                                                    **(llama.get("rope_scaling") or {})}
    scaling = rope_fields if rope_fields.get("rope_type") in ("llama3", "yarn") else None
    inv_freq = inverse_frequencies(head_dim, rope_fields["rope_theta"], scaling)
    rope_scale = yarn_attention_factor(scaling) if rope_fields.get("rope_type") == "yarn" else 1.0
    norm_before_residual = config.get("norm_before_residual", False)
    norm_output = layout == "speculators" and config.get("norm_output", False)
    qk_norm = llama.get("model_type") == "qwen3"
    vocab = embedding.shape[0]
    target_ids = np.arange(len(w["lm_head.weight"])) + w.get("d2t", 0)
    batch, num_tokens = token_ids.shape
    logits = np.full((batch, num_tokens, vocab), -np.inf)
    hidden_out = np.zeros((batch, num_tokens, hidden.shape[-1]))
    positions = np.arange(num_tokens, dtype=np.float64)
    for b in range(batch):
        h = hidden[b].astype(np.float64)
        h_normed = rms_norm(h, w[f"{p}hidden_norm.weight"], eps)
        emb = rms_norm(embedding[token_ids[b]].astype(np.float64), w[f"{p}input_layernorm.weight"], eps)
        x = np.concatenate([emb, h_normed], axis=-1)
        q = (x @ w[f"{p}self_attn.q_proj.weight"].T).reshape(num_tokens, heads, head_dim)
        k = (x @ w[f"{p}self_attn.k_proj.weight"].T).reshape(num_tokens, kv_heads, head_dim)
        v = (x @ w[f"{p}self_attn.v_proj.weight"].T).reshape(num_tokens, kv_heads, head_dim)
        if qk_norm:
            q, k = rms_norm(q, w[f"{p}self_attn.q_norm.weight"], eps), rms_norm(k, w[f"{p}self_attn.k_norm.weight"], eps)
        q, k = rope(q, positions, inv_freq) * rope_scale, rope(k, positions, inv_freq) * rope_scale
        attn = np.zeros((num_tokens, heads, head_dim))
        for head in range(heads):
            kv = head // (heads // kv_heads)
            for t in range(num_tokens):
                scores = k[:t + 1, kv] @ q[t, head] / np.sqrt(head_dim)
                probs = np.exp(scores - scores.max())
                attn[t, head] = (probs / probs.sum()) @ v[:t + 1, kv]
        out = (h_normed if norm_before_residual else h) + attn.reshape(num_tokens, -1) @ w[f"{p}self_attn.o_proj.weight"].T
        m = rms_norm(out, w[f"{p}post_attention_layernorm.weight"], eps)
        gate = m @ w[f"{p}mlp.gate_proj.weight"].T
        out = out + (gate / (1 + np.exp(-gate)) * (m @ w[f"{p}mlp.up_proj.weight"].T)) @ w[f"{p}mlp.down_proj.weight"].T
        normed = rms_norm(out, w["norm.weight"], eps)
        hidden_out[b] = normed if norm_output else out
        logits[b][:, target_ids] = normed @ w["lm_head.weight"].T
    return logits, hidden_out


def reference_combine(tensors: dict, config: dict, taps: np.ndarray) -> np.ndarray:
    """fc of the taps [..., 3H] after fc_norm (each feature) or norm_before_fc (all), in float64."""
    w = {k: np.asarray(v, np.float64) for k, v in tensors.items() if v.dtype.kind == "f"}
    eps = config.get("transformer_layer_config", config).get("rms_norm_eps", 1e-6)
    taps = taps.astype(np.float64)
    if config.get("fc_norm"):
        taps = np.concatenate([rms_norm(t, w[f"fc_norm.{i}.weight"], eps) for i, t in enumerate(np.split(taps, 3, -1))], -1)
    if config.get("norm_before_fc"):
        taps = rms_norm(taps, w["input_norm.weight"], eps)
    return taps @ w["fc.weight"].T


def assert_matches(got: np.ndarray, want: np.ndarray, tol: float = 2e-4):
    got = np.asarray(got)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], atol=tol, rtol=tol)


def assert_forward_and_fc_match(head, tensors: dict, config: dict, target, rng: np.random.Generator,
                                shape: tuple[int, int]):
    """The head's logits and hidden_out over random tokens and features of ``shape`` [B, T] (on ``target``'s
    24-token vocabulary and 16 wide), and its fc over random taps, equal the numpy reference."""
    token_ids = rng.integers(0, 24, shape)
    hidden = rng.standard_normal((*shape, 16)).astype(np.float32)
    logits, hidden_out = head(jnp.asarray(token_ids), jnp.asarray(hidden))
    want_logits, want_hidden = reference(tensors, config, np.asarray(target.embed.embedding[...]), token_ids, hidden)
    assert_matches(hidden_out, want_hidden)
    assert_matches(logits, want_logits)
    taps = rng.standard_normal((*shape, 48)).astype(np.float32)
    assert_matches(head.combine(jnp.asarray(taps)), reference_combine(tensors, config, taps))


# ------------------------------------------------------------------------------ dense forward
HEAD_SHAPES = [dict(heads=4, kv_heads=2, head_dim=8, ffn=24), dict(heads=2, kv_heads=2, head_dim=16, ffn=40),
               dict(heads=4, kv_heads=1, head_dim=4, ffn=16)]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=st.sampled_from(["eagle3", "speculators"]), norm_before_residual=st.sampled_from([None, False, True]),
       shape=st.sampled_from(HEAD_SHAPES), draft_vocab=st.sampled_from([5, 12, 24]), batch=st.integers(1, 2),
       num_tokens=st.integers(1, 6), scaled=st.booleans(), seed=st.integers(0, 2 ** 16))
@pytest.mark.slow
def test_head_matches_numpy_reference(target, layout, norm_before_residual, shape, draft_vocab, batch,
                                      num_tokens, scaled, seed):
    """Logits (mapped through d2t) and hidden_out of both layouts, both residual variants, GQA/MHA
    shapes and llama3 RoPE scaling equal the numpy reference; a shipped copy of the target's embedding
    is shared, not duplicated."""
    sizes = {**HEAD, **shape, "draft_vocab": draft_vocab}
    tensors = head_tensors(**sizes, seed=seed, layout=layout)
    if layout == "speculators":
        tensors["embed_tokens.weight"] = np.asarray(target.embed.embedding[...])
    config = head_config(**sizes, layout=layout, norm_before_residual=norm_before_residual, rope_theta=500.0,
                         rope_scaling=SCALING if scaled else None)
    rng = np.random.default_rng(seed)
    token_ids = rng.integers(0, TARGET.vocab_size, (batch, num_tokens))
    hidden = rng.standard_normal((batch, num_tokens, TARGET.d_model)).astype(np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        head = load_eagle3(write_head(pathlib.Path(tmp), tensors, config), target, dtype="float32")
    logits, hidden_out = head(jnp.asarray(token_ids), jnp.asarray(hidden))
    want_logits, want_hidden = reference(tensors, config, np.asarray(target.embed.embedding[...]), token_ids, hidden)
    assert logits.dtype == jnp.float32 and logits.shape == (batch, num_tokens, TARGET.vocab_size)
    assert_matches(hidden_out, want_hidden)
    assert_matches(logits, want_logits)
    assert head.norm_before_residual is bool(norm_before_residual)
    assert head.embed is target.embed


@pytest.mark.parametrize("layout", ["eagle3", "speculators"])
def test_norm_before_residual_changes_the_output(tmp_path, target, layout):
    """The two residual variants differ (so the reference test tells them apart); absent = False."""
    tensors = head_tensors(**HEAD, seed=3, layout=layout)
    heads = {value: load_eagle3(write_head(tmp_path / str(value), tensors,
                                           head_config(**HEAD, layout=layout, norm_before_residual=value)),
                                target, dtype="float32")
             for value in (None, False, True)}
    assert [heads[v].norm_before_residual for v in (None, False, True)] == [False, False, True]
    tokens, hidden = jnp.array([[3, 1, 4]]), 5 * jax.random.normal(jax.random.key(0), (1, 3, TARGET.d_model))
    outputs = {v: np.asarray(heads[v](tokens, hidden)[1]) for v in heads}
    np.testing.assert_array_equal(outputs[None], outputs[False])
    assert not np.allclose(outputs[False], outputs[True], atol=1e-2)


def test_identity_vocabulary_without_d2t(tmp_path, target):
    """No d2t and draft vocabulary == target vocabulary: the logits are the lm_head's, none -inf."""
    sizes = {**HEAD, "draft_vocab": TARGET.vocab_size}
    tensors = head_tensors(**sizes, seed=11, d2t=False)
    config = head_config(**sizes)
    head = load_eagle3(write_head(tmp_path, tensors, config), target, dtype="float32")
    assert head.draft_to_target is None
    token_ids, hidden = np.array([[7, 0, 23]]), np.random.default_rng(0).standard_normal((1, 3, 16)).astype(np.float32)
    logits, _ = head(jnp.asarray(token_ids), jnp.asarray(hidden))
    assert np.isfinite(np.asarray(logits)).all()
    assert_matches(logits, reference(tensors, config, np.asarray(target.embed.embedding[...]), token_ids, hidden)[0])


def test_shares_the_targets_embedding(tmp_path):
    """The head holds the target's Embed: a change to the target's embedding reaches the head."""
    model = tiny_model(TARGET, seed=1)
    head = load_eagle3(write_head(tmp_path, head_tensors(**HEAD, seed=2), head_config(**HEAD)), model, dtype="float32")
    assert head.embed is model.embed
    tokens, hidden = jnp.array([[1, 2]]), jnp.ones((1, 2, 16))
    before = np.asarray(head(tokens, hidden)[1])
    model.embed.embedding.set_value(model.embed.embedding[...] * 2)
    assert not np.allclose(before, np.asarray(head(tokens, hidden)[1]))


def test_bfloat16_head(tmp_path, target):
    """The default dtype: bfloat16 parameters, float32 logits near the float32 head's."""
    tensors = head_tensors(**HEAD, seed=4)
    directory = write_head(tmp_path, tensors, head_config(**HEAD))
    head, head32 = load_eagle3(directory, target), load_eagle3(directory, target, dtype="float32")
    assert head.fc.kernel[...].dtype == jnp.bfloat16 and head.config.dtype == "bfloat16"
    tokens, hidden = jnp.array([[5, 6, 7]]), jax.random.normal(jax.random.key(1), (1, 3, 16))
    logits, hidden_out = head(tokens, hidden)
    assert logits.dtype == jnp.float32 and hidden_out.dtype == jnp.bfloat16
    assert_matches(logits, np.asarray(head32(tokens, hidden)[0]), tol=0.15)


# ------------------------------------------------------------------------------ aux layers, combine
@pytest.mark.parametrize("layout", ["eagle3", "speculators"])
def test_aux_layers_default_and_from_config(tmp_path, target, layout):
    tensors = head_tensors(**HEAD, seed=5, layout=layout)
    default = load_eagle3(write_head(tmp_path / "a", tensors, head_config(**HEAD, layout=layout)), target)
    assert default.aux_layers == (2, TARGET.num_layers // 2, TARGET.num_layers - 3) == (2, 4, 5)
    given_ids = load_eagle3(write_head(tmp_path / "b", tensors, head_config(**HEAD, layout=layout,
                                                                            aux_layers=[0, 3, 7])), target)
    assert given_ids.aux_layers == (0, 3, 7)


def test_combine_is_the_fc_projection(tmp_path, target):
    tensors = head_tensors(**HEAD, seed=6)
    head = load_eagle3(write_head(tmp_path, tensors, head_config(**HEAD)), target, dtype="float32")
    taps = np.random.default_rng(1).standard_normal((2, 3, 3 * TARGET.d_model)).astype(np.float32)
    combined = head.combine(jnp.asarray(taps))
    assert combined.shape == (2, 3, TARGET.d_model)
    np.testing.assert_allclose(combined, taps @ tensors["fc.weight"].T, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ paged forward
BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS = 4, 12, 5
COMMITTED, STAGED, NEW = 8, 3, 3


@pytest.fixture(scope="module")
def paged_head(target, tmp_path_factory):
    """(head, dense forward, jitted paged forward)."""
    directory = tmp_path_factory.mktemp("paged")
    head = load_eagle3(write_head(directory, head_tensors(**HEAD, seed=8),
                                  head_config(**HEAD, norm_before_residual=True)), target, dtype="float32")
    graphdef, state = nnx.split(head)
    paged = jax.jit(lambda state, *args, tree_parents=None, out_rows=None: nnx.merge(graphdef, state).forward_paged(
        *args, tree_parents=tree_parents, out_rows=out_rows))
    dense = jax.jit(lambda state, tokens, hidden: nnx.merge(graphdef, state)(tokens, hidden))
    return head, (lambda *args: dense(state, *args)), (lambda *args, **kw: paged(state, *args, **kw))


def empty_cache() -> scv_jax.PagedKVCache:
    return scv_jax.PagedKVCache.create(1, NUM_BLOCKS, BLOCK_SIZE, HEAD["kv_heads"], HEAD["head_dim"],
                                       dtype="float32")


def test_paged_config_sizes_a_one_layer_cache(paged_head):
    config = paged_head[0].config
    assert (config.vocab_size, config.num_layers, config.num_kv_heads, config.head_dim, config.d_model,
            config.dtype) == (TARGET.vocab_size, 1, HEAD["kv_heads"], HEAD["head_dim"], TARGET.d_model, "float32")


@settings(max_examples=6, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(0, COMMITTED), st.integers(0, STAGED), st.integers(1, NEW)),
                        min_size=2, max_size=2), seed=st.integers(0, 2 ** 16))
@pytest.mark.slow
def test_paged_chunks_equal_one_dense_pass(paged_head, lengths, seed):
    """An empty-cache paged pass equals the dense call; committed + staged + new chunks (the first
    committed with scv_jax's commit op through shuffled block tables) equal one dense pass."""
    _, dense, paged = paged_head
    rng = np.random.default_rng(seed)
    width = COMMITTED + STAGED + NEW
    tokens = jnp.asarray(rng.integers(0, TARGET.vocab_size, (2, width)), jnp.int32)
    hidden = jnp.asarray(rng.standard_normal((2, width, TARGET.d_model)), jnp.float32)
    want_logits, want_hidden = (np.asarray(x) for x in dense(tokens, hidden))
    tables = jnp.asarray(rng.permutation(NUM_BLOCKS)[:2 * MAX_BLOCKS].reshape(2, MAX_BLOCKS), jnp.int32)
    zeros = jnp.zeros(2, jnp.int32)

    whole = paged(tokens, hidden, empty_cache(), tables, zeros)
    assert whole.keys.shape == (1, 2, width, HEAD["kv_heads"], HEAD["head_dim"])
    assert_matches(whole.logits, want_logits)
    assert_matches(whole.hidden, want_hidden)

    committed, staged_n, new_n = (np.array(x, np.int32) for x in zip(*lengths))

    def rows(start, count, size):
        index = np.minimum(start[:, None] + np.arange(size), width - 1)
        return (jnp.asarray(np.take_along_axis(np.asarray(tokens), index, 1)),
                jnp.asarray(np.take_along_axis(np.asarray(hidden), index[..., None], 1)))

    first = paged(*rows(zeros, 0, COMMITTED), empty_cache(), tables, zeros)
    cache = commit_prefix(empty_cache(), first, tables, committed, BLOCK_SIZE)
    out_staged = paged(*rows(committed, 0, STAGED), cache, tables, jnp.asarray(committed))
    staged = StagedKV(out_staged.keys, out_staged.values, jnp.asarray(staged_n))
    out_new = paged(*rows(committed + staged_n, 0, NEW), cache, tables, jnp.asarray(committed), staged)
    for b, (c, s, n) in enumerate(zip(committed, staged_n, new_n)):
        for out, start, count in ((first, 0, c), (out_staged, c, s), (out_new, c + s, n)):
            assert_matches(out.logits[b, :count], want_logits[b, start:start + count])
            assert_matches(out.hidden[b, :count], want_hidden[b, start:start + count])
    # out_rows: one row per request (a catch-up's last) computes an output; every row's K/V as before
    picked = rng.integers(0, STAGED + NEW, 2).astype(np.int32)
    one = paged(*rows(committed, 0, STAGED + NEW), cache, tables, jnp.asarray(committed), out_rows=jnp.asarray(picked))
    every = paged(*rows(committed, 0, STAGED + NEW), cache, tables, jnp.asarray(committed))
    assert one.logits.shape == (2, 1, TARGET.vocab_size) and one.hidden.shape == (2, 1, TARGET.d_model)
    np.testing.assert_array_equal(one.keys, every.keys)
    np.testing.assert_array_equal(one.values, every.values)
    for b, (c, r) in enumerate(zip(committed, picked)):
        assert_matches(one.logits[b, 0], want_logits[b, c + r])
        assert_matches(one.hidden[b, 0], want_hidden[b, c + r])


def test_paged_tree_rows_see_their_ancestors_only(paged_head):
    """With tree_parents [-1, 0, 0], row 2 (a sibling of row 1) equals row 1 of the chain [row 0, row 2]."""
    _, _, paged = paged_head
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(0, TARGET.vocab_size, (1, 3)), jnp.int32)
    hidden = jnp.asarray(rng.standard_normal((1, 3, TARGET.d_model)), jnp.float32)
    tables = jnp.arange(MAX_BLOCKS, dtype=jnp.int32)[None]
    tree = paged(tokens, hidden, empty_cache(), tables, jnp.zeros(1, jnp.int32),
                 tree_parents=jnp.array([[-1, 0, 0]], jnp.int32))
    chain = paged(tokens[:, ::2], hidden[:, ::2], empty_cache(), tables, jnp.zeros(1, jnp.int32))
    assert_matches(tree.logits[0, 2], np.asarray(chain.logits[0, 1]))
    assert_matches(tree.logits[0, :2], np.asarray(paged(tokens[:, :2], hidden[:, :2], empty_cache(), tables,
                                                        jnp.zeros(1, jnp.int32)).logits[0]))


def test_out_rows_takes_neither_staged_nor_tree_parents(paged_head):
    head = paged_head[0]
    tokens, hidden = jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2, TARGET.d_model), jnp.float32)
    tables, zeros = jnp.arange(MAX_BLOCKS, dtype=jnp.int32)[None], jnp.zeros(1, jnp.int32)
    with pytest.raises(ValueError, match="out_rows takes neither staged nor tree_parents"):
        head.forward_paged(tokens, hidden, empty_cache(), tables, zeros, tree_parents=jnp.array([[-1, 0]], jnp.int32),
                           out_rows=zeros)


# ------------------------------------------------------------------------------ pytorch_model.bin
def test_torch_reader_matches_torch_bit_for_bit():
    """The torch-written fixture (every supported dtype, a transposed view, a shared storage) reads
    back exactly (expected.npz holds bfloat16 as uint16 bits)."""
    arrays = read_torch_state_dict(FIXTURES / "pytorch_model.bin")
    expected = np.load(FIXTURES / "expected.npz")
    assert sorted(arrays) == sorted(expected.files)
    assert arrays["bfloat16"].dtype == ml_dtypes.bfloat16
    for name, array in arrays.items():
        bits = array.view(np.uint16) if array.dtype == ml_dtypes.bfloat16 else array
        assert bits.dtype == expected[name].dtype and bits.shape == expected[name].shape, name
        np.testing.assert_array_equal(bits, expected[name])


def test_head_from_pytorch_model_bin_equals_the_safetensors_head(tmp_path, target):
    """The torch-written float16 head loads from pytorch_model.bin exactly as from model.safetensors."""
    config = head_config(**BIN_HEAD)
    (tmp_path / "bin").mkdir()
    shutil.copy(FIXTURES / "eagle3_head.bin", tmp_path / "bin" / "pytorch_model.bin")
    (tmp_path / "bin" / "config.json").write_text(json.dumps(config))
    tensors = head_tensors(**BIN_HEAD, dtype=np.float16)
    from_bin = load_eagle3(tmp_path / "bin", target, dtype="float32")
    from_safetensors = load_eagle3(write_head(tmp_path / "st", tensors, config), target, dtype="float32")
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(from_bin)), nnx.to_flat_state(nnx.state(from_safetensors))):
        np.testing.assert_array_equal(a.get_value(), b.get_value(), err_msg=str(path))
    tokens, hidden = jnp.array([[1, 2, 3]]), jnp.ones((1, 3, TARGET.d_model))
    np.testing.assert_array_equal(from_bin(tokens, hidden)[0], from_safetensors(tokens, hidden)[0])
    hidden = np.random.default_rng(0).standard_normal((1, 3, 16)).astype(np.float32)
    assert_matches(from_bin(tokens, jnp.asarray(hidden))[0],
                   reference(tensors, config, np.asarray(target.embed.embedding[...]), np.asarray(tokens), hidden)[0],
                   tol=1e-3)


def write_zip(file: pathlib.Path, payload: bytes) -> pathlib.Path:
    with zipfile.ZipFile(file, "w") as archive:
        archive.writestr("archive/data.pkl", payload)
    return file


@pytest.mark.parametrize("make, match", [
    (lambda f: write_zip(f, pickle.dumps(os.system)), r"pickled global posix\.system is not allowed"),
    (lambda f: write_zip(f, pickle.dumps([1, 2])), "expected a state dict of tensors"),
    (lambda f: (f.write_bytes(b"\x80\x02not a zip"), f)[1], "is not a zip-format torch checkpoint"),
    (lambda f: write_zip(f, b"\x80\x02garbage"), "unreadable torch checkpoint"),
])
def test_torch_reader_rejects(tmp_path, make, match):
    file = make(tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=match) as error:
        read_torch_state_dict(file)
    assert str(file) in str(error.value) and "\n" not in str(error.value)


# ------------------------------------------------------------------------------ bad checkpoints
def _drop(name):
    return lambda tensors, config: tensors.pop(name)


def _set(name, value):
    return lambda tensors, config: tensors.__setitem__(name, value)


def _configure(**fields):
    return lambda tensors, config: config.update(fields)


BAD = [
    ("hidden size", _configure(hidden_size=32), "config.json", "hidden_size 32"),
    ("target hidden size", _configure(target_hidden_size=64), "config.json", "target_hidden_size 64"),
    ("no d2t", lambda t, c: (t.pop("d2t"), t.pop("t2d")), "model.safetensors", "tensor d2t is missing"),
    ("missing tensor", _drop("midlayer.mlp.up_proj.weight"), "model.safetensors", "midlayer.mlp.up_proj.weight"),
    ("wrong shape", lambda t, c: t.__setitem__("fc.weight", np.ascontiguousarray(t["fc.weight"].T)),
     "model.safetensors", "tensor fc.weight"),
    ("integer weight", lambda t, c: t.__setitem__("norm.weight", np.ones(16, np.int64)), "model.safetensors",
     "tensor norm.weight"),
    ("unknown architecture", _configure(architectures=["MistralForCausalLM"]), "config.json", "architectures"),
    ("unused tensor", _set("midlayer.self_attn.q_proj.bias", np.zeros(32, np.float32)), "model.safetensors",
     "midlayer.self_attn.q_proj.bias"),
    ("d2t out of range", lambda t, c: t.__setitem__("d2t", t["d2t"] + 30), "model.safetensors", "tensor d2t"),
    ("t2d mismatch", lambda t, c: t.__setitem__("t2d", ~t["t2d"]), "model.safetensors", "tensor t2d"),
    ("vocab size", _configure(vocab_size=30), "config.json", "vocab_size 30"),
    ("draft vocab too big", _configure(draft_vocab_size=25), "config.json", "draft_vocab_size"),
    ("embedding copy", _set("embed_tokens.weight", np.zeros((20, 16), np.float32)), "model.safetensors",
     "embed_tokens.weight"),
    ("two layers", _configure(num_hidden_layers=2), "config.json", "num_hidden_layers 2"),
    ("aux ids", _configure(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2]}), "config.json",
     "eagle_aux_hidden_state_layer_ids"),
    ("activation", _configure(hidden_act="gelu"), "config.json", "hidden_act"),
    ("residual flag", _configure(norm_before_residual="yes"), "config.json", "norm_before_residual"),
    ("no fc", _configure(eagle_config={"use_aux_hidden_state": False}), "config.json", "use_aux_hidden_state"),
    ("un-normed logits", _configure(norm_output=False), "config.json", "norm_output: false"),
    ("two tap norms", _configure(fc_norm=True, norm_before_fc=True), "config.json", "fc_norm and norm_before_fc"),
    ("tied lm_head", _configure(tie_word_embeddings=True), "config.json", "tie_word_embeddings"),
    ("fc_norm without its tensors", _configure(fc_norm=True), "model.safetensors", "tensor fc_norm.0.weight is missing"),
    ("aux id past the target", _configure(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 8]}), "config.json",
     r"eagle_aux_hidden_state_layer_ids \[1, 2, 8\] must name layers in \[0, 8\)"),
]


@pytest.mark.parametrize("mutate, file, match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_checkpoint_raises_one_line_naming_file_and_field(tmp_path, target, mutate, file, match):
    tensors, config = head_tensors(**HEAD, seed=12), head_config(**HEAD)
    mutate(tensors, config)
    with pytest.raises(ValueError, match=match) as error:
        load_eagle3(write_head(tmp_path, tensors, config), target)
    assert str(tmp_path / file) in str(error.value) and "\n" not in str(error.value)


def test_bad_speculators_checkpoints(tmp_path, target):
    tensors, config = head_tensors(**HEAD, seed=13, layout="speculators"), head_config(**HEAD, layout="speculators")
    config["transformer_layer_config"]["model_type"] = "mistral"
    with pytest.raises(ValueError, match=r"config\.json: transformer_layer_config\.model_type 'mistral'"):
        load_eagle3(write_head(tmp_path / "a", tensors, config), target)
    config = head_config(**HEAD, layout="speculators")
    tensors.pop("layers.0.self_attn.o_proj.weight")
    with pytest.raises(ValueError, match=r"tensor layers\.0\.self_attn\.o_proj\.weight is missing"):
        load_eagle3(write_head(tmp_path / "b", tensors, config), target)


def test_missing_files(tmp_path, target):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_eagle3(tmp_path, target)
    (tmp_path / "config.json").write_text(json.dumps(head_config(**HEAD)))
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor pytorch_model.bin"):
        load_eagle3(tmp_path, target)


def test_eagle3_head_is_exported():
    assert scv_jax.models.Eagle3Head is Eagle3Head and "load_eagle3" in scv_jax.models.__all__


# ------------------------------------------------------------------------------ published heads
# A target deep enough for every published config's aux layer ids (qwen3-235B's reach layer 90).
DEEP_TARGET = dataclasses.replace(TARGET, num_layers=96)
SMALL = dict(hidden_size=16, intermediate_size=24, num_attention_heads=4, vocab_size=24)


@pytest.fixture(scope="module")
def deep_target():
    """What load_eagle3 reads of a target (its config and embedding), without building 96 layers."""
    embed = nnx.Embed(DEEP_TARGET.vocab_size, DEEP_TARGET.d_model, dtype=jnp.float32, rngs=nnx.Rngs(9))
    return types.SimpleNamespace(config=DEEP_TARGET, embed=embed)


def shrink(config: dict) -> tuple[dict, dict]:
    """A published config with tiny sizes (every other field as published: rope, eps, flags, aux ids,
    max_position_embeddings, extra keys) and the head_tensors sizes of its layout."""
    small = copy.deepcopy(config)
    llama = small.get("transformer_layer_config", small)
    mha = llama["num_key_value_heads"] == llama["num_attention_heads"]
    llama.update(SMALL, num_key_value_heads=4 if mha else 2)
    if llama.get("head_dim") is not None:
        llama["head_dim"] = 8                       # != hidden_size / heads: read, not derived
    if small.get("draft_vocab_size") is not None:
        small["draft_vocab_size"] = 24 if config["draft_vocab_size"] == llama_of(config)["vocab_size"] else 12
    sizes = dict(hidden=16, heads=4, kv_heads=llama["num_key_value_heads"], head_dim=llama.get("head_dim") or 4, ffn=24,
                 target_vocab=24, draft_vocab=small.get("draft_vocab_size") or 24)
    return small, sizes


def llama_of(config: dict) -> dict:
    return config.get("transformer_layer_config", config)


# name -> the aux layers (target layer inputs) it must give on DEEP_TARGET: the config's ids as they
# are (vLLM's reading); without ids, the default (2, L // 2, L - 3).
LOADABLE = {**{name: None for name in published.SPECFORGE if name != "qwen2-5-vl-7b-eagle3.json"},
            "gpt-oss-20B-eagle3.json": (1, 11, 21), "deepseek-v3-671b-eagle3.json": (1, 29, 57),
            "qwen3-235B-A22B-eagle3.json": (1, 46, 90), "SafeAILab traineagle3/config.json": None}


def published_config(name: str) -> dict:
    return published.SAFEAILAB_TRAINER if name.startswith("SafeAILab") else published.SPECFORGE[name]


@pytest.mark.parametrize("name", sorted(LOADABLE))
def test_published_config_loads_and_matches_the_reference(tmp_path, deep_target, name):
    """Each published config (shrunk, random weights of its layout) loads: its RoPE theta (10000 where
    absent), eps, flags and aux ids are read as published, max_position_embeddings does not bound the
    context, and the head's forward and fc equal the numpy reference."""
    config, sizes = shrink(published_config(name))
    tensors = head_tensors(**sizes, seed=len(name), fc_norm=bool(config.get("fc_norm")))
    head = load_eagle3(write_head(tmp_path, tensors, config), deep_target, dtype="float32")
    original = published_config(name)
    assert head.config.rope_theta == float(original.get("rope_theta", 10000.0))
    assert head.config.norm_eps == original["rms_norm_eps"] and head.config.max_position_embeddings is None
    assert head.aux_layers == (LOADABLE[name] or (2, 48, 93))
    assert (head.fc_norm is not None, head.norm_output) == (bool(original.get("fc_norm")), False)
    assert_forward_and_fc_match(head, tensors, config, deep_target, np.random.default_rng(0), (1, 5))


@pytest.mark.parametrize("config, match", [
    (published.SPECFORGE["qwen2-5-vl-7b-eagle3.json"], "rope_scaling type 'mrope' is not supported"),
    (published.SPECULATORS_ISSUE_1065, r"eagle_aux_hidden_state_layer_ids must be 3 layer ids, got \[2, 46, 91, 93\]"),
    ({**published.SPECULATORS_ISSUE_1065, "eagle_aux_hidden_state_layer_ids": [2, 46, 91]},
     r"layer_types names 'sliding_attention' layers, which LlamaForCausalLM does not have"),
], ids=["mrope", "four aux ids", "sliding layer"])
def test_published_configs_a_head_cannot_honour_are_refused(tmp_path, deep_target, config, match):
    small, sizes = shrink(config)
    directory = write_head(tmp_path, head_tensors(**sizes, seed=1, layout="speculators" if "speculators_model_type"
                                                  in small else "eagle3"), small)
    with pytest.raises(ValueError, match=match) as error:
        load_eagle3(directory, deep_target)
    assert str(directory / "config.json") in str(error.value) and "\n" not in str(error.value)


def speculators_config(model_type: str, **flags) -> dict:
    """A speculators config.json as its Eagle3SpeculatorConfig writes one (vllm-project/speculators,
    src/speculators/models/eagle3/config.py; the layout of SPECULATORS_ISSUE_1065), with a full-attention
    layer of ``model_type`` in the transformers 5 form (rope_parameters), tiny sizes."""
    config = copy.deepcopy(published.SPECULATORS_ISSUE_1065)
    layer = config["transformer_layer_config"]
    for field in ("layer_types", "sliding_window", "rope_scaling", "rope_theta"):
        layer.pop(field)
    layer.update(model_type=model_type, use_sliding_window=False,
                 rope_parameters={"rope_type": "default", "rope_theta": 5000000.0})
    config.update(eagle_aux_hidden_state_layer_ids=[1, 46, 91], **flags)
    return shrink(config)[0]


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@pytest.mark.parametrize("flags", [dict(norm_before_fc=True, fc_norm=False, norm_output=True),
                                   dict(norm_before_fc=False, fc_norm=True, norm_output=False)], ids=["3.1", "fc_norm"])
def test_speculators_options_match_the_reference(tmp_path, deep_target, model_type, flags):
    """speculators' options: a Qwen3 layer (q/k norms), norm_before_fc (input_norm over the taps),
    fc_norm, norm_output (the normed output passed on), rope_parameters; aux ids as given (no shift)."""
    config = speculators_config(model_type, **flags)
    sizes = dict(hidden=16, heads=4, kv_heads=2, head_dim=8, ffn=24, target_vocab=24, draft_vocab=12)
    tensors = head_tensors(**sizes, seed=4, layout="speculators", qk_norm=model_type == "qwen3",
                           fc_norm=flags["fc_norm"], norm_before_fc=flags["norm_before_fc"])
    head = load_eagle3(write_head(tmp_path, tensors, config), deep_target, dtype="float32")
    assert head.aux_layers == (1, 46, 91) and head.config.rope_theta == 5e6 and head.config.qk_norm == (model_type == "qwen3")
    assert head.norm_output == flags["norm_output"] and head.norm_before_residual
    assert_forward_and_fc_match(head, tensors, config, deep_target, np.random.default_rng(1), (2, 4))


@pytest.mark.parametrize("where", ["eagle_config", "top level"])
def test_aux_layer_ids_are_taken_as_given_unless_overridden(tmp_path, target, where):
    """The config's ids name the target layers whose inputs the head reads, as they are (SpecForge's
    [1, ...] too: vLLM's reading); ``aux_layers=`` overrides them (e.g. + 1, SGLang's reading)."""
    config = head_config(**HEAD)
    if where == "eagle_config":
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 3, 5], "use_aux_hidden_state": True}
    else:
        config["eagle_aux_hidden_state_layer_ids"] = [1, 3, 5]
    directory = write_head(tmp_path, head_tensors(**HEAD, seed=2), config)
    assert load_eagle3(directory, target).aux_layers == (1, 3, 5)
    assert load_eagle3(directory, target, aux_layers=(2, 4, 6)).aux_layers == (2, 4, 6)
    with pytest.raises(ValueError, match=r"^load_eagle3: aux_layers \[2, 4, 9\] must name layers in \[0, 8\)"):
        load_eagle3(directory, target, aux_layers=(2, 4, 9))


def test_known_extra_tensors_are_ignored_and_an_own_embedding_is_kept(tmp_path, target):
    """verifier_* (speculators training) and rotary inv_freq buffers are skipped; an embed_tokens
    that differs from the target's embedding is the head's own (as vLLM keeps it), one equal to it
    (rounded to the checkpoint's dtype) is shared."""
    tensors = head_tensors(**HEAD, seed=5, layout="speculators")
    config = head_config(**HEAD, layout="speculators")
    tensors.update({"verifier_lm_head.weight": np.zeros((12, 16), np.float32),
                    "verifier_norm.weight": np.ones(16, np.float32),
                    "layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32),
                    "embed_tokens.weight": np.asarray(target.embed.embedding[...]).astype(np.float16)})
    shared = load_eagle3(write_head(tmp_path / "shared", tensors, config), target, dtype="float32")
    assert shared.embed is target.embed
    tensors["embed_tokens.weight"] = np.random.default_rng(3).standard_normal((24, 16)).astype(np.float32)
    own = load_eagle3(write_head(tmp_path / "own", tensors, config), target, dtype="float32")
    assert own.embed is not target.embed
    np.testing.assert_array_equal(own.embed.embedding[...], tensors["embed_tokens.weight"])
    token_ids, hidden = np.array([[3, 9, 17]]), np.random.default_rng(4).standard_normal((1, 3, 16)).astype(np.float32)
    logits, _ = own(jnp.asarray(token_ids), jnp.asarray(hidden))
    assert_matches(logits, reference(tensors, config, np.asarray(target.embed.embedding[...]), token_ids, hidden)[0])
    assert not np.allclose(np.asarray(logits)[np.isfinite(logits)],
                           np.asarray(shared(jnp.asarray(token_ids), jnp.asarray(hidden))[0])[np.isfinite(logits)])


def test_save_round_trips_fc_norm_and_refuses_what_the_layout_cannot_say(tmp_path, target):
    tensors, config = head_tensors(**HEAD, seed=6, fc_norm=True), head_config(**HEAD)
    config["fc_norm"] = True
    head = load_eagle3(write_head(tmp_path / "in", tensors, config), target, dtype="float32")
    again = load_eagle3(save_eagle3(head, tmp_path / "out", dtype="float32"), target, dtype="float32")
    taps = jnp.asarray(np.random.default_rng(5).standard_normal((1, 2, 48)), jnp.float32)
    np.testing.assert_array_equal(again.combine(taps), head.combine(taps))
    config = head_config(**HEAD, layout="speculators")
    config["norm_output"] = True
    speculators = load_eagle3(write_head(tmp_path / "spec", head_tensors(**HEAD, seed=6, layout="speculators"), config),
                              target, dtype="float32")
    with pytest.raises(ValueError, match="save_eagle3: a head with norm_output cannot be written"):
        save_eagle3(speculators, tmp_path / "refused")


def test_state_dict_metadata_of_a_module_state_dict_is_accepted(tmp_path, monkeypatch):
    """nn.Module.state_dict() (what SafeAILab's trainer saves) is an OrderedDict carrying a _metadata
    attribute, pickled as the dict's state: the reader accepts it. The file is written as torch.save
    does, through stand-in torch modules (torch is not installed here)."""
    torch, utils = types.ModuleType("torch"), types.ModuleType("torch._utils")

    class HalfStorage:
        pass

    def _rebuild_tensor_v2(*args):
        raise AssertionError("only pickled, never called")

    HalfStorage.__module__, _rebuild_tensor_v2.__module__ = "torch", "torch._utils"
    HalfStorage.__qualname__, _rebuild_tensor_v2.__qualname__ = "HalfStorage", "_rebuild_tensor_v2"
    torch.HalfStorage, utils._rebuild_tensor_v2 = HalfStorage, _rebuild_tensor_v2
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch._utils", utils)
    weights = {"fc.weight": np.arange(6, dtype=np.float16).reshape(2, 3), "norm.weight": np.ones(2, np.float16)}

    class Tensor:
        def __init__(self, key):
            self.key = key

        def __reduce__(self):
            shape = weights[self.key].shape
            return _rebuild_tensor_v2, (Storage(self.key), 0, shape, (shape[-1], 1)[-len(shape):], False, {})

    class Storage:
        def __init__(self, key):
            self.key = key

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", HalfStorage, obj.key, "cpu", weights[obj.key].size) if isinstance(obj, Storage) else None

    state = collections.OrderedDict((key, Tensor(key)) for key in weights)
    state._metadata = collections.OrderedDict([("", {"version": 1}), ("midlayer", {"version": 1})])
    buffer = io.BytesIO()
    Pickler(buffer, protocol=2).dump(state)
    file = tmp_path / "pytorch_model.bin"
    with zipfile.ZipFile(file, "w") as archive:
        archive.writestr("archive/data.pkl", buffer.getvalue())
        for key, array in weights.items():
            archive.writestr(f"archive/data/{key}", array.tobytes())
    read = read_torch_state_dict(file)
    assert sorted(read) == sorted(weights)
    for key, array in weights.items():
        np.testing.assert_array_equal(read[key], array)
