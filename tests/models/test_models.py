"""The paged + staged forward pass equals a plain full-sequence forward; weights round-trip."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

import scv_jax
from scv_jax.models import PagedModel, StagedKV, Transformer, load_model, save_model
from tests.models.fixtures import TINY, tiny_model

BLOCK_SIZE = 4
NUM_BLOCKS = 24
MAX_BLOCKS = 6


@pytest.fixture(scope="module")
def model():
    return tiny_model(TINY, seed=3, scale=1.0)


def _pad(rows, width, fill=0):
    out = np.full((len(rows), width), fill, np.int32)
    for r, row in zip(out, rows):
        r[:len(row)] = row
    return out


COMMITTED, STAGED, NEW = 10, 3, 3          # fixed widths (one compile); lengths vary through masks


@pytest.fixture(scope="module")
def jitted(model):
    graphdef, state = nnx.split(model)
    full = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens))
    paged = jax.jit(lambda state, *args: nnx.merge(graphdef, state).forward_paged(*args))
    return (lambda tokens: np.asarray(full(state, tokens))), (lambda *args: paged(state, *args))


def _flat(x):
    return x.reshape(x.shape[0], -1, *x.shape[3:])


@settings(max_examples=8)
@given(lengths=st.lists(st.tuples(st.integers(0, COMMITTED), st.integers(0, STAGED), st.integers(1, NEW)),
                        min_size=2, max_size=2),
       layout=st.sampled_from(["NHD", "HND"]), seed=st.integers(0, 2 ** 16))
def test_paged_staged_forward_matches_full_forward(jitted, lengths, layout, seed):
    """Committed prefix (paged, shuffled blocks) + staged tokens + new tokens == one full forward."""
    full_forward, paged_forward = jitted
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, TINY.vocab_size, sum(n)).tolist() for n in lengths]
    committed, staged_n, new_n = (np.array(x, np.int32) for x in zip(*lengths))
    tables = jnp.asarray(rng.permutation(NUM_BLOCKS)[:2 * MAX_BLOCKS].reshape(2, MAX_BLOCKS), jnp.int32)
    cache = scv_jax.PagedKVCache.create(TINY.num_layers, NUM_BLOCKS, BLOCK_SIZE, TINY.num_kv_heads,
                                        TINY.head_dim, dtype="float32", layout=layout)
    full = full_forward(jnp.asarray(_pad(seqs, COMMITTED + STAGED + NEW)))
    zeros = jnp.zeros(2, jnp.int32)

    # 1. prefix from an empty cache, then committed through the block tables
    out = paged_forward(jnp.asarray(_pad([s[:c] for s, c in zip(seqs, committed)], COMMITTED)), cache,
                        tables, zeros)
    positions = np.broadcast_to(np.arange(COMMITTED), (2, COMMITTED))
    slots = scv_jax.slots_from_block_table(tables, jnp.asarray(positions), BLOCK_SIZE)
    mask = jnp.asarray((positions < committed[:, None]).reshape(-1))
    cache = scv_jax.commit_draft_kv(cache, _flat(out.keys), _flat(out.values), slots.reshape(-1), mask)

    # 2. staged tokens (they read the cache, which they do not write)
    staged_tokens = _pad([s[c:c + n] for s, c, n in zip(seqs, committed, staged_n)], STAGED)
    out_staged = paged_forward(jnp.asarray(staged_tokens), cache, tables, jnp.asarray(committed))
    staged = StagedKV(out_staged.keys, out_staged.values, jnp.asarray(staged_n))  # padding rows masked

    # 3. new tokens read cache + staging + themselves (causal)
    new = [s[c + n:] for s, c, n in zip(seqs, committed, staged_n)]
    out_new = paged_forward(jnp.asarray(_pad(new, NEW)), cache, tables, jnp.asarray(committed), staged)
    for b, (c, n, m) in enumerate(zip(committed, staged_n, new_n)):
        got = np.concatenate([np.asarray(out.logits[b, :c]), np.asarray(out_staged.logits[b, :n]),
                              np.asarray(out_new.logits[b, :m])])
        np.testing.assert_allclose(got, full[b, :c + n + m], atol=2e-4, rtol=2e-4)


def test_fp8_cache_is_read_dequantized(jitted):
    """A per-token-head fp8 cache is read back through its scales (close to the float32 result)."""
    full_forward, paged_forward = jitted
    seq = (np.arange(2 * STAGED) * 5) % TINY.vocab_size
    cache = scv_jax.PagedKVCache.create(TINY.num_layers, NUM_BLOCKS, BLOCK_SIZE, TINY.num_kv_heads,
                                        TINY.head_dim, dtype="float8_e4m3fn", scale_mode="token_head")
    tables = jnp.arange(2 * MAX_BLOCKS, dtype=jnp.int32).reshape(2, MAX_BLOCKS)
    tokens = jnp.asarray(np.stack([seq[:STAGED]] * 2))
    out = paged_forward(tokens, cache, tables, jnp.zeros(2, jnp.int32))
    slots = scv_jax.slots_from_block_table(tables, jnp.broadcast_to(jnp.arange(STAGED), (2, STAGED)),
                                           BLOCK_SIZE)
    cache = scv_jax.commit_draft_kv(cache, _flat(out.keys), _flat(out.values), slots.reshape(-1))
    tail = paged_forward(jnp.asarray(np.stack([seq[STAGED:]] * 2)), cache, tables,
                         jnp.full(2, STAGED, jnp.int32))
    full = full_forward(jnp.asarray(_pad([seq.tolist()] * 2, COMMITTED + STAGED + NEW)))
    np.testing.assert_allclose(np.asarray(tail.logits[0]), full[0, STAGED:2 * STAGED], atol=0.15)


def test_transformer_is_a_paged_model(model):
    assert isinstance(model, PagedModel)


def test_weights_round_trip(tmp_path, model):
    save_model(model, tmp_path / "m.npz", dtype=np.float32)
    loaded = load_model(tmp_path / "m.npz")
    tokens = jnp.arange(12)[None] % TINY.vocab_size
    np.testing.assert_array_equal(np.asarray(loaded(tokens)), np.asarray(model(tokens)))


def test_load_model_rejects_mismatched_file(tmp_path, model):
    save_model(model, tmp_path / "m.npz")
    data = dict(np.load(tmp_path / "m.npz"))
    data.pop(next(k for k in data if k != "__config__"))
    np.savez(tmp_path / "bad.npz", **data)
    with pytest.raises(ValueError, match="does not match"):
        load_model(tmp_path / "bad.npz")


def test_demo_weights_are_shipped_and_small():
    from scv_jax.models.weights import DEMO_WEIGHTS_DIR
    target, draft = scv_jax.models.load_demo()
    assert isinstance(target, Transformer) and isinstance(draft, Transformer)
    assert target.config.vocab_size == draft.config.vocab_size == 256
    assert sum(p.stat().st_size for p in DEMO_WEIGHTS_DIR.glob("*.npz")) < 20 * 2 ** 20


def test_config_rejects_bad_head_grouping():
    with pytest.raises(ValueError, match="num_heads"):
        scv_jax.models.TransformerConfig(num_heads=3, num_kv_heads=2)
