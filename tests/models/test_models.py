"""The paged + staged forward pass equals a plain full-sequence forward (logits, K/V, taps); weights
round-trip."""

from __future__ import annotations

import dataclasses
import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

import scv_jax
from scv_jax.models import (Llama3RopeScaling, PackedTokens, PagedModel, StagedKV, Transformer, TransformerConfig,
                            YarnRopeScaling, load_model, save_model)
from scv_jax.models.rope import attention_factor
from tests.models.fixtures import TINY, commit_prefix, pad_rows, tiny_model

SCALING = Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16)
BLOCK_SIZE = 4
NUM_BLOCKS = 24
MAX_BLOCKS = 6


@pytest.fixture(scope="module")
def model():
    return tiny_model(TINY, seed=3, scale=1.0)


COMMITTED, STAGED, NEW = 10, 3, 3          # fixed widths (one compile); lengths vary through masks


@pytest.fixture(scope="module")
def jitted(model):
    graphdef, state = nnx.split(model)
    full = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens))
    paged = jax.jit(lambda state, *args: nnx.merge(graphdef, state).forward_paged(*args))
    return (lambda tokens: np.asarray(full(state, tokens))), (lambda *args: paged(state, *args))


@settings(max_examples=8)
@given(lengths=st.lists(st.tuples(st.integers(0, COMMITTED), st.integers(0, STAGED), st.integers(1, NEW)),
                        min_size=2, max_size=2),
       layout=st.sampled_from(["NHD", "HND"]), seed=st.integers(0, 2 ** 16))
@pytest.mark.slow
def test_paged_staged_forward_matches_full_forward(jitted, lengths, layout, seed):
    """Committed prefix (paged, shuffled blocks) + staged tokens + new tokens == one full forward."""
    full_forward, paged_forward = jitted
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, TINY.vocab_size, sum(n)).tolist() for n in lengths]
    committed, staged_n, new_n = (np.array(x, np.int32) for x in zip(*lengths))
    tables = jnp.asarray(rng.permutation(NUM_BLOCKS)[:2 * MAX_BLOCKS].reshape(2, MAX_BLOCKS), jnp.int32)
    cache = scv_jax.PagedKVCache.create(TINY.num_layers, NUM_BLOCKS, BLOCK_SIZE, TINY.num_kv_heads,
                                        TINY.head_dim, dtype="float32", layout=layout)
    full = full_forward(jnp.asarray(pad_rows(seqs, COMMITTED + STAGED + NEW)))
    zeros = jnp.zeros(2, jnp.int32)

    # 1. prefix from an empty cache, then committed through the block tables
    out = paged_forward(jnp.asarray(pad_rows([s[:c] for s, c in zip(seqs, committed)], COMMITTED)), cache,
                        tables, zeros)
    cache = commit_prefix(cache, out, tables, committed, BLOCK_SIZE)

    # 2. staged tokens (they read the cache, which they do not write)
    staged_tokens = pad_rows([s[c:c + n] for s, c, n in zip(seqs, committed, staged_n)], STAGED)
    out_staged = paged_forward(jnp.asarray(staged_tokens), cache, tables, jnp.asarray(committed))
    staged = StagedKV(out_staged.keys, out_staged.values, jnp.asarray(staged_n))  # padding rows masked

    # 3. new tokens read cache + staging + themselves (causal)
    new = [s[c + n:] for s, c, n in zip(seqs, committed, staged_n)]
    out_new = paged_forward(jnp.asarray(pad_rows(new, NEW)), cache, tables, jnp.asarray(committed), staged)
    for b, (c, n, m) in enumerate(zip(committed, staged_n, new_n)):
        got = np.concatenate([np.asarray(out.logits[b, :c]), np.asarray(out_staged.logits[b, :n]),
                              np.asarray(out_new.logits[b, :m])])
        np.testing.assert_allclose(got, full[b, :c + n + m], atol=2e-4, rtol=2e-4)


PACKED_BATCH, PACKED_WIDTH, PACKED_TOKENS = 3, 4, 11     # fixed shapes (one compile each window)


@functools.cache
def packed_forwards(window: int | None):
    """(dense ``forward_paged``, ``forward_packed``) of a tiny model, jitted; ``window``: sliding window."""
    config = dataclasses.replace(TINY, sliding_window=window)
    graphdef, state = nnx.split(tiny_model(config, seed=5, scale=1.0))
    dense = jax.jit(lambda *args: nnx.merge(graphdef, state).forward_paged(*args))
    packed = jax.jit(lambda tokens, rows, offsets, *args: nnx.merge(graphdef, state).forward_packed(
        tokens, PackedTokens(rows, offsets, PACKED_WIDTH), *args))
    return dense, packed


@settings(max_examples=8)
@given(counts=st.lists(st.integers(1, PACKED_WIDTH), min_size=PACKED_BATCH, max_size=PACKED_BATCH),
       committed=st.lists(st.integers(0, 12), min_size=PACKED_BATCH, max_size=PACKED_BATCH),
       window=st.sampled_from([None, 3]), seed=st.integers(0, 2 ** 16))
def test_packed_forward_equals_the_dense_rows(counts, committed, window, seed):
    """Each request's tokens packed in any order among padding tokens (offset outside [0, width)) get
    the logits and K/V of the dense forward's rows; padding changes nothing."""
    dense, packed = packed_forwards(window)
    rng = np.random.default_rng(seed)
    cells = [(b, t) for b, n in enumerate(counts) for t in range(n)]
    order = rng.permutation(PACKED_TOKENS)                      # token i holds cells[order[i]], or padding
    rows = np.array([cells[j][0] if j < len(cells) else rng.integers(PACKED_BATCH) for j in order], np.int32)
    offsets = np.array([cells[j][1] if j < len(cells) else rng.choice([-1, PACKED_WIDTH, 99]) for j in order],
                       np.int32)
    grid = rng.integers(0, TINY.vocab_size, (PACKED_BATCH, PACKED_WIDTH)).astype(np.int32)
    tokens = np.where((offsets >= 0) & (offsets < PACKED_WIDTH), grid[rows, np.clip(offsets, 0, PACKED_WIDTH - 1)],
                      rng.integers(0, TINY.vocab_size, PACKED_TOKENS)).astype(np.int32)
    cache = scv_jax.PagedKVCache.create(TINY.num_layers, NUM_BLOCKS, BLOCK_SIZE, TINY.num_kv_heads, TINY.head_dim,
                                        dtype="float32")
    cache = cache.replace(k_pages=jnp.asarray(rng.normal(size=cache.k_pages.shape), jnp.float32),
                          v_pages=jnp.asarray(rng.normal(size=cache.v_pages.shape), jnp.float32))
    tables = jnp.asarray(rng.permutation(NUM_BLOCKS)[:PACKED_BATCH * MAX_BLOCKS].reshape(PACKED_BATCH, MAX_BLOCKS),
                         jnp.int32)
    lens = jnp.asarray(committed, jnp.int32)
    want = dense(jnp.asarray(grid), cache, tables, lens)
    got = packed(jnp.asarray(tokens), jnp.asarray(rows), jnp.asarray(offsets), cache, tables, lens)
    assert got.logits.shape == (PACKED_TOKENS, TINY.vocab_size)
    assert got.keys.shape == (TINY.num_layers, PACKED_TOKENS, TINY.num_kv_heads, TINY.head_dim)
    real = np.flatnonzero(order < len(cells))
    for i in real:
        b, t = rows[i], offsets[i]
        np.testing.assert_allclose(np.asarray(got.logits[i]), np.asarray(want.logits[b, t]), atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(got.keys[:, i]), np.asarray(want.keys[:, b, t]), atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(got.values[:, i]), np.asarray(want.values[:, b, t]), atol=1e-5,
                                   rtol=1e-5)


AUX = (1, 0, 1)         # TINY's last layer, the embeddings, a layer asked twice


@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.slow
def test_paged_and_packed_taps_are_the_dense_taps(model, per_layer):
    """``forward_paged`` and ``forward_packed`` give every token they score the taps of
    ``model(tokens, aux_layers)`` at its position: a prefill in one pass or in chunks (committed, staged,
    new), and the tokens after a committed prefix packed in reversed order among padding tokens. No
    ``aux_layers``: no taps."""
    m = model.per_layer() if per_layer else model
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, TINY.vocab_size, (2, 12)).astype(np.int32)
    _, taps = m(jnp.asarray(tokens), aux_layers=AUX)
    assert taps.shape == (2, 12, len(AUX) * TINY.d_model)
    cache = scv_jax.PagedKVCache.create(TINY.num_layers, NUM_BLOCKS, BLOCK_SIZE, TINY.num_kv_heads, TINY.head_dim,
                                        dtype="float32")
    tables = jnp.asarray(rng.permutation(NUM_BLOCKS)[:2 * MAX_BLOCKS].reshape(2, MAX_BLOCKS), jnp.int32)
    zeros, context = jnp.zeros(2, jnp.int32), jnp.full(2, 7, jnp.int32)
    one_pass = m.forward_paged(jnp.asarray(tokens), cache, tables, zeros, aux_layers=AUX)
    assert m.forward_paged(jnp.asarray(tokens), cache, tables, zeros).taps is None
    first = m.forward_paged(jnp.asarray(tokens[:, :7]), cache, tables, zeros, aux_layers=AUX)
    cache = commit_prefix(cache, first, tables, [7, 7], BLOCK_SIZE)
    middle = m.forward_paged(jnp.asarray(tokens[:, 7:9]), cache, tables, context, aux_layers=AUX)
    last = m.forward_paged(jnp.asarray(tokens[:, 9:]), cache, tables, context,
                           StagedKV(middle.keys, middle.values, jnp.full(2, 2, jnp.int32)), aux_layers=AUX)
    for got in (one_pass.taps, jnp.concatenate([first.taps, middle.taps, last.taps], axis=1)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(taps), rtol=1e-5, atol=1e-5)

    rows = np.array([0] + [0] * 5 + [1] * 5 + [1], np.int32)
    offsets = np.array([-1] + [4, 3, 2, 1, 0] * 2 + [5], np.int32)              # padding at both ends
    packed = PackedTokens(jnp.asarray(rows), jnp.asarray(offsets), 5)
    packed_tokens = jnp.asarray(tokens[rows, 7 + np.clip(offsets, 0, 4)])
    out = m.forward_packed(packed_tokens, packed, cache, tables, context, aux_layers=AUX)
    assert out.taps.shape == (len(rows), len(AUX) * TINY.d_model)
    assert m.forward_packed(packed_tokens, packed, cache, tables, context).taps is None
    np.testing.assert_allclose(np.asarray(out.taps)[1:-1], np.asarray(taps)[rows[1:-1], 7 + offsets[1:-1]],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("aux_layers", [(2,), (0, -1), (0.0,), 1, (), (True,), None])
def test_bad_aux_layers_are_named(model, aux_layers):
    """aux_layers must be a non-empty tuple or list of layer indices in [0, num_layers): a one-line
    ValueError naming it, from every forward, stacked or per layer (None: asks for no taps, is the
    default and gets no error)."""
    tokens = jnp.zeros((1, 3), jnp.int32)
    cache = scv_jax.PagedKVCache.create(TINY.num_layers, 8, 4, TINY.num_kv_heads, TINY.head_dim)
    tables, lens = jnp.zeros((1, 2), jnp.int32), jnp.zeros(1, jnp.int32)
    packed = PackedTokens(jnp.zeros(3, jnp.int32), jnp.arange(3, dtype=jnp.int32), 3)
    for m in (model, model.per_layer()):
        for run in (lambda: m(tokens, aux_layers=aux_layers),
                    lambda: m.forward_paged(tokens, cache, tables, lens, aux_layers=aux_layers),
                    lambda: m.forward_packed(tokens[0], packed, cache, tables, lens, aux_layers=aux_layers)):
            if aux_layers is None:
                run()
                continue
            with pytest.raises(ValueError, match=r"^aux_layers .*got " + re.escape(repr(aux_layers)) + "$"):
                run()


def test_fp8_cache_is_read_dequantized(jitted):
    """A per-token-head fp8 cache is read back through its scales (close to the float32 result)."""
    full_forward, paged_forward = jitted
    seq = (np.arange(2 * STAGED) * 5) % TINY.vocab_size
    cache = scv_jax.PagedKVCache.create(TINY.num_layers, NUM_BLOCKS, BLOCK_SIZE, TINY.num_kv_heads,
                                        TINY.head_dim, dtype="float8_e4m3fn", scale_mode="token_head")
    tables = jnp.arange(2 * MAX_BLOCKS, dtype=jnp.int32).reshape(2, MAX_BLOCKS)
    tokens = jnp.asarray(np.stack([seq[:STAGED]] * 2))
    out = paged_forward(tokens, cache, tables, jnp.zeros(2, jnp.int32))
    cache = commit_prefix(cache, out, tables, [STAGED, STAGED], BLOCK_SIZE)
    tail = paged_forward(jnp.asarray(np.stack([seq[STAGED:]] * 2)), cache, tables,
                         jnp.full(2, STAGED, jnp.int32))
    full = full_forward(jnp.asarray(pad_rows([seq.tolist()] * 2, COMMITTED + STAGED + NEW)))
    np.testing.assert_allclose(np.asarray(tail.logits[0]), full[0, STAGED:2 * STAGED], atol=0.15)


def test_transformer_is_a_paged_model(model):
    assert isinstance(model, PagedModel)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weights_round_trip(tmp_path, dtype):
    """Every config field (dtype, biases, q/k norms, RoPE scaling, window) and parameter survives save +
    load."""
    config = TransformerConfig(**{**TINY.to_dict(), "dtype": dtype, "qkv_bias": True, "qk_norm": True,
                                  "tie_embeddings": False, "sliding_window": 5, "rope_scaling": SCALING})
    model = tiny_model(config, seed=4)
    save_model(model, tmp_path / "m.npz", dtype=np.float32)
    loaded = load_model(tmp_path / "m.npz")
    assert loaded.config == config
    tokens = jnp.arange(12)[None] % TINY.vocab_size
    np.testing.assert_array_equal(np.asarray(loaded(tokens)), np.asarray(model(tokens)))
    assert load_model(tmp_path / "m.npz", dtype="float32").config.dtype == "float32"


def test_load_model_rejects_mismatched_file(tmp_path, model):
    save_model(model, tmp_path / "m.npz")
    data = dict(np.load(tmp_path / "m.npz"))
    data.pop(next(k for k in data if k != "__config__"))
    np.savez(tmp_path / "bad.npz", **data)
    with pytest.raises(ValueError, match="does not match"):
        load_model(tmp_path / "bad.npz")


# Logits of the shipped demo models for b"import sys\n\n\ndef main(", computed by the per-layer
# (unscanned) model before layers were stacked: argmax per position, the last position's logits of
# bytes 0..5 and of b"x(): ", the sum of all logits.
DEMO_PROMPT = b"import sys\n\n\ndef main("
DEMO_LOGITS = {
    "target": ([110, 97, 111, 114, 116, 32, 105, 101, 115, 46, 10, 10, 99, 101, 102, 32, 95, 111, 105, 110, 95, 115],
               [-12.292179, -11.97934, -10.283752, -10.74605, -11.842413, -11.975697],
               [1.579003, 1.806674, 4.113901, -0.504764, -0.236057], -31880.3607),
    "draft": ([110, 112, 111, 114, 116, 32, 105, 101, 115, 46, 32, 32, 32, 101, 102, 32, 95, 97, 105, 110, 32, 115],
              [-8.532328, -8.228744, -8.228592, -9.133102, -7.218218, -8.346097],
              [2.975721, 1.844616, 3.564998, 0.52535, 3.710967], -23456.2342),
}


def test_demo_weights_load_with_unchanged_logits():
    """The shipped per-layer .npz files load into the stacked model and give the logits they gave
    before (float32; within accumulation-order rounding)."""
    from scv_jax.models.weights import DEMO_WEIGHTS_DIR
    target, draft = scv_jax.models.load_demo()
    assert isinstance(target, Transformer) and isinstance(draft, Transformer)
    assert target.config.vocab_size == draft.config.vocab_size == 256
    assert sum(p.stat().st_size for p in DEMO_WEIGHTS_DIR.glob("*.npz")) < 20 * 2 ** 20
    for name, model in (("target", target), ("draft", draft)):
        argmax, first, chosen, total = DEMO_LOGITS[name]
        logits = np.asarray(model(jnp.asarray([list(DEMO_PROMPT)])))[0]
        assert logits.argmax(-1).tolist() == argmax
        np.testing.assert_allclose(logits[-1, :6], first, atol=1e-4)
        np.testing.assert_allclose(logits[-1, list(b"x(): ")], chosen, atol=1e-4)
        assert logits.astype(np.float64).sum() == pytest.approx(total, abs=0.05)


def test_trace_size_does_not_grow_with_depth():
    """The layers run under a scan: a 12-layer forward traces to as many operations as a 2-layer one."""
    def num_equations(num_layers: int, paged: bool) -> int:
        config = TransformerConfig(**{**TINY.to_dict(), "num_layers": num_layers})
        graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
        cache = scv_jax.PagedKVCache.create(num_layers, 8, 4, config.num_kv_heads, config.head_dim)
        tokens, tables, lens = jnp.zeros((2, 3), jnp.int32), jnp.zeros((2, 2), jnp.int32), jnp.zeros(2, jnp.int32)
        fn = ((lambda state: nnx.merge(graphdef, state).forward_paged(tokens, cache, tables, lens)) if paged
              else (lambda state: nnx.merge(graphdef, state)(tokens)))
        return len(jax.make_jaxpr(fn)(state).eqns)

    for paged in (False, True):
        assert num_equations(2, paged) == num_equations(12, paged)


def test_per_layer_model_computes_what_the_stacked_one_does(model):
    """``per_layer``: the layers as separate modules with their own arrays; every forward pass (full,
    paged with staged K/V, packed) gives the stacked model's results (taps too), and the stacked model is
    unchanged."""
    per_layer = model.per_layer()
    assert isinstance(per_layer.blocks, nnx.List) and len(per_layer.blocks) == TINY.num_layers
    assert per_layer.per_layer() is per_layer and not isinstance(model.blocks, nnx.List)
    np.testing.assert_array_equal(np.asarray(per_layer.blocks[1].mlp.up.kernel[...]),
                                  np.asarray(model.blocks.mlp.up.kernel[...][1]))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, TINY.vocab_size, (2, 5)), jnp.int32)
    cache = scv_jax.PagedKVCache.create(TINY.num_layers, NUM_BLOCKS, BLOCK_SIZE, TINY.num_kv_heads, TINY.head_dim,
                                        dtype="float32")
    cache = cache.replace(k_pages=jnp.asarray(rng.normal(size=cache.k_pages.shape), jnp.float32),
                          v_pages=jnp.asarray(rng.normal(size=cache.v_pages.shape), jnp.float32))
    tables = jnp.asarray(rng.permutation(NUM_BLOCKS)[:2 * MAX_BLOCKS].reshape(2, MAX_BLOCKS), jnp.int32)
    lens = jnp.asarray([3, 9], jnp.int32)
    staged_kv = jnp.asarray(rng.normal(size=(TINY.num_layers, 2, 2, TINY.num_kv_heads, TINY.head_dim)), jnp.float32)
    staged = StagedKV(staged_kv, -staged_kv, jnp.asarray([1, 2], jnp.int32))
    packed = PackedTokens(jnp.asarray([0, 0, 1, 1, 1], jnp.int32), jnp.asarray([0, 1, 0, 1, 2], jnp.int32), 3)
    runs = [lambda m: list(m(tokens, aux_layers=AUX)),
            lambda m: list(m.forward_paged(tokens, cache, tables, lens, staged, aux_layers=AUX)),
            lambda m: list(m.forward_packed(tokens[0], packed, cache, tables, lens, aux_layers=AUX))]
    for run in runs:
        for want, got in zip(run(model), run(per_layer), strict=True):
            # the two are compiled separately, so XLA may fuse (and round) differently: float32 noise only
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    abstract = nnx.eval_shape(lambda: Transformer(TINY, rngs=nnx.Rngs(0))).per_layer()    # shapes alone
    assert abstract.blocks[0].mlp.up.kernel.shape == model.blocks.mlp.up.kernel.shape[1:]


def test_bfloat16_parameters_activations_and_float32_logits():
    config = TransformerConfig(**{**TINY.to_dict(), "dtype": "bfloat16"})
    model = tiny_model(config, seed=2)
    assert {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))} == {jnp.dtype(jnp.bfloat16)}
    tokens = jnp.arange(6)[None] % TINY.vocab_size
    assert model(tokens).dtype == jnp.float32
    cache = scv_jax.PagedKVCache.create(TINY.num_layers, 8, 4, TINY.num_kv_heads, TINY.head_dim, dtype="bfloat16")
    out = model.forward_paged(tokens, cache, jnp.zeros((1, 2), jnp.int32), jnp.zeros(1, jnp.int32))
    assert out.logits.dtype == jnp.float32 and out.keys.dtype == out.values.dtype == jnp.bfloat16
    assert out.keys.shape == (TINY.num_layers, 1, 6, TINY.num_kv_heads, TINY.head_dim)
    taps = model.forward_paged(tokens, cache, jnp.zeros((1, 2), jnp.int32), jnp.zeros(1, jnp.int32),
                               aux_layers=(1,)).taps
    assert taps.dtype == jnp.bfloat16 and model(tokens, aux_layers=(0, 1))[1].dtype == jnp.bfloat16


def test_sliding_window_limits_what_a_token_sees():
    """With window W each layer looks W - 1 positions back: through TINY's 2 layers the last token's
    logits do not depend on a token 5 positions before it, and do on one 4 positions before it."""
    model = tiny_model(TransformerConfig(**{**TINY.to_dict(), "sliding_window": 3}), seed=5)
    seq = np.array([[1, 2, 3, 4, 5, 6, 7]])
    far, near = seq.copy(), seq.copy()
    far[0, 1], near[0, 2] = 9, 9
    logits = [np.asarray(model(jnp.asarray(s)))[0, -1] for s in (seq, far, near)]
    np.testing.assert_array_equal(logits[0], logits[1])
    assert np.abs(logits[0] - logits[2]).max() > 1e-3


@pytest.mark.parametrize("fields, match", [
    (dict(num_heads=3, num_kv_heads=2), "num_heads"),
    (dict(dtype="int8"), "dtype must be one of"),
    (dict(dtype="float64"), "dtype must be one of"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(rope_scaling={"factor": 8.0}), "rope_scaling must be None, a Llama3RopeScaling or a YarnRopeScaling"),
    (dict(sliding_window=4, sliding_layers=(True,)), "sliding_layers must be None or a tuple of num_layers \\(2\\)"),
    (dict(sliding_layers=(True, False)), "sliding_layers needs sliding_window"),
    (dict(attention_sinks=1), "attention_sinks must be a bool"),
    (dict(swiglu_limit=0.0), "swiglu_limit must be None or a number > 0"),
])
def test_config_rejects_bad_fields(fields, match):
    with pytest.raises(ValueError, match=match):
        TransformerConfig(**fields)


def test_config_dict_round_trip_and_dtype_spellings():
    config = TransformerConfig(dtype=jnp.bfloat16, rope_scaling=SCALING, sliding_window=7)
    assert config.dtype == "bfloat16" and config.jnp_dtype == jnp.bfloat16
    assert TransformerConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    with pytest.raises(ValueError, match="unknown fields \\['colour'\\]"):
        TransformerConfig.from_dict({"colour": 1})
    with pytest.raises(ValueError, match="high_freq_factor"):
        Llama3RopeScaling(factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0, original_max_position_embeddings=8)
    with pytest.raises(ValueError, match="factor must be a number > 0"):
        Llama3RopeScaling(factor=0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8)
    yarn = TransformerConfig(rope_scaling=YarnRopeScaling(factor=4.0, original_max_position_embeddings=64),
                             sliding_window=3, sliding_layers=(True, False), attention_sinks=True, moe_bias=True,
                             num_experts=2, swiglu_limit=7.0)
    assert TransformerConfig.from_dict(json.loads(json.dumps(yarn.to_dict()))) == yarn
    assert yarn.layer_windows == (3, None) and TransformerConfig(sliding_window=5).layer_windows == (5, 5)
    with pytest.raises(ValueError, match="rope_type 'linear' is not one of"):
        TransformerConfig.from_dict({"rope_scaling": {"rope_type": "linear", "factor": 2.0}})


def test_yarn_attention_factor():
    """YaRN's attention factor: given, else 0.1 ln(factor) + 1, or with mscale and mscale_all_dim the
    ratio of that form for each (DeepSeek's configs); 1 for other scalings."""
    plain = YarnRopeScaling(factor=4.0, original_max_position_embeddings=64)
    assert attention_factor(plain) == pytest.approx(0.1 * np.log(4.0) + 1)
    assert attention_factor(dataclasses.replace(plain, attention_factor=0.5)) == 0.5
    both = dataclasses.replace(plain, mscale=1.0, mscale_all_dim=0.5)
    assert attention_factor(both) == pytest.approx((0.1 * np.log(4.0) + 1) / (0.05 * np.log(4.0) + 1))
    assert attention_factor(SCALING) == attention_factor(None) == 1.0
