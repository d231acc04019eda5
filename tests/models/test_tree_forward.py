"""``forward_paged(tree_parents=...)``: each tree node's logits, taps and K/V are those of a chain forward over
its root path (committed prefix, staged tokens, then the node's ancestors and itself)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import scv_jax
from scv_jax.models import StagedKV
from tests.models.fixtures import TINY, commit_prefix, pad_rows, tiny_model

BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS = 4, 16, 6
COMMITTED, STAGED, NODES = 8, 2, 7      # fixed widths (one compile); lengths vary through masks
AUX = (1, 0)                            # taps of TINY's last layer and of the embeddings


def _forwards():
    graphdef, state = nnx.split(tiny_model(TINY, seed=4, scale=1.0))
    full = jax.jit(lambda tokens: nnx.merge(graphdef, state)(tokens, aux_layers=AUX))
    paged = jax.jit(lambda tokens, cache, tables, lens, staged, parents: nnx.merge(graphdef, state).forward_paged(
        tokens, cache, tables, lens, staged, tree_parents=parents, aux_layers=AUX))
    chain = jax.jit(lambda *args: nnx.merge(graphdef, state).forward_paged(*args))
    return full, paged, chain


FORWARDS = []


def root_path(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


@settings(max_examples=6, deadline=None)
@given(committed=st.integers(0, COMMITTED), staged_n=st.integers(0, STAGED), seed=st.integers(0, 2 ** 16))
@pytest.mark.slow
def test_tree_nodes_see_their_root_path_only(committed, staged_n, seed):
    if not FORWARDS:
        FORWARDS.append(_forwards())
    full, paged, chain = FORWARDS[0]
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, TINY.vocab_size, committed + staged_n).tolist()
    nodes = rng.integers(0, TINY.vocab_size, NODES).tolist()
    parents = [int(rng.integers(-1, i)) for i in range(NODES)]           # any tree, parents before children
    tables = jnp.asarray(rng.permutation(NUM_BLOCKS)[:MAX_BLOCKS][None], jnp.int32)
    cache = scv_jax.PagedKVCache.create(TINY.num_layers, NUM_BLOCKS, BLOCK_SIZE, TINY.num_kv_heads, TINY.head_dim,
                                        dtype="float32")
    out = chain(jnp.asarray(pad_rows([prefix[:committed]], COMMITTED)), cache, tables, jnp.zeros(1, jnp.int32))
    cache = commit_prefix(cache, out, tables, [committed], BLOCK_SIZE)
    lens = jnp.array([committed], jnp.int32)
    out_staged = chain(jnp.asarray(pad_rows([prefix[committed:]], STAGED)), cache, tables, lens)
    staged = StagedKV(out_staged.keys, out_staged.values, jnp.array([staged_n], jnp.int32))
    tree = paged(jnp.array([nodes], jnp.int32), cache, tables, lens, staged, jnp.array([parents], jnp.int32))
    width = COMMITTED + STAGED + NODES
    for node in range(NODES):
        path = root_path(parents, node)
        sequence = prefix + [nodes[i] for i in path]
        logits, taps = full(jnp.asarray(pad_rows([sequence], width)))
        np.testing.assert_allclose(np.asarray(tree.logits[0, node]), np.asarray(logits[0, len(sequence) - 1]),
                                   atol=2e-4, rtol=2e-4)
        np.testing.assert_allclose(np.asarray(tree.taps[0, node]), np.asarray(taps[0, len(sequence) - 1]),
                                   atol=2e-5, rtol=2e-5)
    # a chain tree (parents t - 1) is the chain forward
    chain_parents = jnp.arange(-1, NODES - 1, dtype=jnp.int32)[None]
    as_tree = paged(jnp.array([nodes], jnp.int32), cache, tables, lens, staged, chain_parents)
    as_chain = chain(jnp.array([nodes], jnp.int32), cache, tables, lens, staged)
    np.testing.assert_allclose(np.asarray(as_tree.logits), np.asarray(as_chain.logits), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(as_tree.keys), np.asarray(as_chain.keys), atol=2e-5, rtol=2e-5)
