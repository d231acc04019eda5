"""accepted_path_slots + commit_draft_kv: only the pending token and the accepted root-to-leaf path are
written, at consecutive positions; every other byte of the cache is unchanged."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import scv_jax
from tests.ops.tree.oracle import trees

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, DIM = 2, 24, 4, 2, 8


def _targets_along_children(rng, tokens, parents, num_nodes) -> np.ndarray:
    """Target tokens that usually match one of each node's children (so paths are long)."""
    batch, n = tokens.shape
    target = rng.integers(0, 3, (batch, n + 1)).astype(np.int32)
    for b in range(batch):
        for column in range(n + 1):
            children = [i for i in range(min(num_nodes[b], n)) if parents[b, i] == column - 1]
            if children and rng.random() < 0.8:
                target[b, column] = tokens[b, rng.choice(children)]
    return target


def _pages_as_bits(cache) -> tuple[np.ndarray, np.ndarray]:
    """K and V pages as raw uint bytes [layers, num_slots, heads, dim] (NHD)."""
    def bits(x):
        x = np.asarray(x)
        return x.view(np.dtype(f"u{x.dtype.itemsize}")).reshape(LAYERS, BLOCKS * BLOCK_SIZE, HEADS, DIM)
    return bits(cache.k_pages), bits(cache.v_pages)


@pytest.mark.parametrize("op", ["greedy", "sampling"])
@settings(max_examples=10)
@given(tree=trees(bad=False, max_nodes=8), seed=st.integers(0, 2**31), dtype=st.sampled_from(["float32", "bfloat16"]))
@pytest.mark.slow
def test_only_the_accepted_path_is_written(op, tree, seed, dtype):
    tokens, parents, num_nodes, max_depth = tree
    batch, n = tokens.shape
    rng = np.random.default_rng(seed)
    if op == "greedy":
        target = _targets_along_children(rng, tokens, parents, num_nodes)
        result = scv_jax.accept_tree_greedy(tokens, parents, num_nodes, target, max_depth=max_depth, backend="xla")
    else:
        probs = rng.dirichlet(np.ones(3), (batch, n + 1)).astype(np.float32)
        result = scv_jax.tree_rejection_sample(tokens, parents, num_nodes, probs, key=jax.random.key(seed),
                                               max_depth=max_depth)
    cache = scv_jax.PagedKVCache.create(LAYERS, BLOCKS, BLOCK_SIZE, HEADS, DIM, dtype=dtype)
    cache = cache.replace(k_pages=jnp.asarray(rng.standard_normal(cache.k_pages.shape), cache.dtype),
                          v_pages=jnp.asarray(rng.standard_normal(cache.v_pages.shape), cache.dtype))
    tables = rng.permutation(BLOCKS)[:batch * 8].reshape(batch, 8).astype(np.int32)
    first = rng.integers(0, 8 * BLOCK_SIZE - n - 1, batch).astype(np.int32)     # the pending token's position
    slots = scv_jax.accepted_path_slots(result, tables, first, tree_size=n, block_size=BLOCK_SIZE)
    assert slots.shape == (batch, n + 1)
    keys, values = (jnp.asarray(rng.standard_normal((LAYERS, batch * (n + 1), HEADS, DIM)), jnp.float32)
                    for _ in range(2))
    committed = scv_jax.commit_draft_kv(cache, keys, values, slots.reshape(-1), backend="xla")

    accepted = np.asarray(result.num_accepted)
    nodes = np.asarray(result.accepted_nodes)
    written = []
    for b in range(batch):
        columns = [0] + [int(c) + 1 for c in nodes[b, :accepted[b]]]
        positions = first[b] + np.arange(len(columns))
        path_slots = tables[b, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        got_k, got_v = scv_jax.gather_kv(committed, jnp.asarray(path_slots, jnp.int32))
        rows = b * (n + 1) + np.asarray(columns)
        as_cache = lambda x: np.asarray(jnp.asarray(x[:, rows]).astype(cache.dtype).astype(jnp.float32))  # noqa: E731
        np.testing.assert_array_equal(np.asarray(got_k), as_cache(keys))
        np.testing.assert_array_equal(np.asarray(got_v), as_cache(values))
        written += list(path_slots)
    assert np.sum(np.asarray(slots) >= 0) == len(written) == np.sum(accepted + 1)
    untouched = np.ones(BLOCKS * BLOCK_SIZE, bool)
    untouched[written] = False
    for before, after in zip(_pages_as_bits(cache), _pages_as_bits(committed)):
        np.testing.assert_array_equal(after[:, untouched], before[:, untouched])


def test_slots_of_a_hand_checked_path():
    """Nodes 1 then 3 accepted of a 4-node tree; the pending token at position 5 of blocks [2, 7]."""
    result = scv_jax.TreeAcceptResult(jnp.asarray([[0, 0, 0, 0]]), jnp.asarray([2]), jnp.asarray([[1, 3, -1]]))
    slots = scv_jax.accepted_path_slots(result, [[2, 7]], [5], tree_size=4, block_size=4)
    # positions 5, 6, 7 -> block 7 offsets 1, 2, 3 -> slots 29, 30, 31 in columns 0, 2 (node 1), 4 (node 3)
    assert slots.tolist() == [[29, -1, 30, -1, 31]]


@pytest.mark.parametrize("change,error,match", [
    (dict(result=(1, 2, 3)), TypeError, "result"),
    (dict(tree_size=-1), ValueError, "tree_size"),
    (dict(first_positions=[0, 0]), ValueError, "first_positions"),
    (dict(block_size=0), ValueError, "block_size"),
])
def test_bad_static_inputs_raise_naming_the_argument(change, error, match):
    args = dict(result=scv_jax.TreeAcceptResult(jnp.zeros((1, 2), jnp.int32), jnp.zeros(1, jnp.int32),
                                                jnp.full((1, 1), -1, jnp.int32)),
                block_tables=[[0]], first_positions=[0], tree_size=2, block_size=4)
    args.update(change)
    with pytest.raises(error, match=match):
        scv_jax.accepted_path_slots(**args)
