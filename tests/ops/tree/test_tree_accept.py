"""Tree acceptance ops: every backend against a plain-Python walk and against each other on random trees,
the lossless sampler's sequences against the target's autoregressive distribution (chi-square), bad data,
bad static input, CUDA lowering of the greedy kernel."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import scv_jax
from scv_jax.ops import registry
import scv_jax.ops.tree.api  # noqa: F401,E402 - registers the op's implementations for registry.implementation
from scv_jax.ops.acceptance.randomness import normalize_keys
from scv_jax.ops.registry import cuda_available
from scv_jax.ops.tree.api import node_randomness
from tests.ops.sampling.oracle import fits
from tests.ops.tree.oracle import greedy_walk, sampling_walk, trees

KERNEL = "pallas" if cuda_available() else "interpret"


def assert_rows(result, rows) -> None:
    want_out, want_num, want_nodes = (np.array([r[i] for r in rows]).reshape(len(rows), -1) for i in range(3))
    np.testing.assert_array_equal(np.asarray(result.output_token_ids), want_out)
    np.testing.assert_array_equal(np.asarray(result.num_accepted), want_num.reshape(-1))
    np.testing.assert_array_equal(np.asarray(result.accepted_nodes), want_nodes.reshape(len(rows), -1))


def _targets(rng, tokens, vocab_size: int, bad: bool) -> np.ndarray:
    target = rng.integers(0, vocab_size, (tokens.shape[0], tokens.shape[1] + 1)).astype(np.int32)
    return np.where(rng.random(target.shape) < 0.2, rng.integers(-2, vocab_size + 2, target.shape), target) if bad \
        else target


@settings(max_examples=40)
@given(tree=trees(), seed=st.integers(0, 2**31))
def test_greedy_reference_matches_walk(tree, seed):
    tokens, parents, num_nodes, max_depth = tree
    target = _targets(np.random.default_rng(seed), tokens, 3, bad=seed % 2 == 1)
    result = scv_jax.accept_tree_greedy(tokens, parents, num_nodes, target, max_depth=max_depth, backend="xla")
    assert_rows(result, [greedy_walk(*row, max_depth) for row in zip(tokens, parents, num_nodes, target)])


@settings(max_examples=8)   # interpret mode compiles a simulator per shape
@given(tree=trees(), seed=st.integers(0, 2**31))
def test_greedy_kernel_matches_reference_and_walk(tree, seed):
    tokens, parents, num_nodes, max_depth = tree
    target = _targets(np.random.default_rng(seed), tokens, 3, bad=seed % 2 == 1)
    args = (tokens, parents, num_nodes, target)
    kernel = scv_jax.accept_tree_greedy(*args, max_depth=max_depth, backend=KERNEL)
    reference = scv_jax.accept_tree_greedy(*args, max_depth=max_depth, backend="xla")
    for got, want in zip(kernel, reference):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert_rows(kernel, [greedy_walk(*row, max_depth) for row in zip(*args)])


def test_greedy_examples():
    """A hand-checked tree: root children 0 (token 5) and 1 (token 6); 2 (7) under 1; 3 (8) and 4 (7) under 2."""
    tokens, parents = [[5, 6, 7, 8, 7]], [[-1, -1, 1, 2, 2]]
    cases = [([6, 0, 7, 7, 0, 0], 5, [6, 7, 7, 0], [1, 2, 4]),        # duplicate sibling: the first matching wins
             ([6, 0, 7, 8, 3, 0], 5, [6, 7, 8, 3], [1, 2, 3]),        # bonus after the leaf
             ([5, 9, 0, 0, 0, 0], 5, [5, 9, -1, -1], [0, -1, -1]),   # node 0 is a leaf: its bonus
             ([6, 0, 7, 8, 3, 0], 3, [6, 7, 8, -1], [1, 2, -1]),      # nodes >= num_nodes are padding
             ([4, 0, 0, 0, 0, 0], 5, [4, -1, -1, -1], [-1, -1, -1])]  # no root child matches
    for target, num_nodes, out, nodes in cases:
        for backend in ("xla", KERNEL):
            r = scv_jax.accept_tree_greedy(tokens, parents, [num_nodes], [target], max_depth=3, backend=backend)
            assert r.output_token_ids.tolist() == [out] and r.accepted_nodes.tolist() == [nodes], (backend, target)
            assert r.num_accepted.tolist() == [sum(x >= 0 for x in nodes)]
    r = scv_jax.accept_tree_greedy(tokens, parents, [5], [[6, 0, 7, 8, 3, 0]], max_depth=1, backend="xla")
    assert r.output_token_ids.tolist() == [[6, 7]] and r.accepted_nodes.tolist() == [[1]]


def _node_randomness(key, batch: int, n: int, max_depth: int):
    keys = normalize_keys("test", key, batch)
    return [np.asarray(x) for x in node_randomness(keys, max(n, 1), max_depth)]


def _random_probs(rng, shape, kind: str) -> np.ndarray:
    if kind == "dirichlet":
        return rng.dirichlet(np.ones(shape[-1]), shape[:-1]).astype(np.float32)
    probs = rng.random(shape) * (rng.random(shape) < 0.5)         # sparse; some rows all zero
    if kind == "unnormalised":
        probs[..., 0] = np.nan
    return probs.astype(np.float32)


@settings(max_examples=30)
@given(tree=trees(vocab_size=4), kind=st.sampled_from(["dirichlet", "sparse", "unnormalised"]),
       seed=st.integers(0, 2**31))
@pytest.mark.slow
def test_sampling_matches_walk(tree, kind, seed):
    tokens, parents, num_nodes, max_depth = tree
    rng = np.random.default_rng(seed)
    probs = _random_probs(rng, (tokens.shape[0], tokens.shape[1] + 1, 4), kind)
    key = jax.random.key(seed)
    result = scv_jax.tree_rejection_sample(tokens, parents, num_nodes, probs, key=key, max_depth=max_depth)
    uniforms, seeds = _node_randomness(key, *tokens.shape, max_depth)
    assert_rows(result, [sampling_walk(*row, max_depth) for row in zip(tokens, parents, num_nodes, probs, uniforms,
                                                                         seeds)])
    emitted = np.asarray(result.output_token_ids)
    assert np.all((emitted == -1) | ((emitted >= 0) & (emitted < 4)))
    assert np.all(emitted[np.arange(len(emitted)), np.asarray(result.num_accepted)] >= 0)


# ------------------------------------------------------------------------------------------- losslessness

VOCAB = 4


def target_distribution(prefix: tuple[int, ...]) -> np.ndarray:
    """The target's next-token distribution after ``prefix``: a function of the whole prefix."""
    rng = np.random.default_rng(hash(("target", prefix)) % 2**32)
    return rng.dirichlet(np.full(VOCAB, 0.7)) * 0.9 + 0.1 / VOCAB


def draft_children(prefix: tuple[int, ...], branching: int) -> list[int]:
    """Deterministic candidates after ``prefix``: a fixed prefix-dependent ranking (not the target's)."""
    return list(np.random.default_rng(hash(("draft", prefix)) % 2**32).permutation(VOCAB)[:branching])


def build_tree(branching: tuple[int, ...]):
    """(tokens, parents, the prefix of each node) of the full tree with ``branching[d]`` children at depth d."""
    tokens, parents, prefixes = [], [], []
    frontier = [(-1, ())]
    for width in branching:
        next_frontier = []
        for parent, prefix in frontier:
            for token in draft_children(prefix, width):
                tokens.append(token)
                parents.append(parent)
                prefixes.append(prefix + (token,))
                next_frontier.append((len(tokens) - 1, prefix + (token,)))
        frontier = next_frontier
    return tokens, parents, prefixes


@pytest.mark.parametrize("branching", [(2, 2), (3, 2, 2)])
def test_sampled_sequences_follow_the_target(branching):
    """The emitted tokens, completed to a fixed length by sampling the target autoregressively, follow the
    target's joint distribution of that length (a chi-square over all V ** length sequences); a walk that
    ignored the residual (or the target) would not."""
    tokens, parents, prefixes = build_tree(branching)
    depth, n, samples = len(branching), len(tokens), 40_000
    rows = [target_distribution(())] + [target_distribution(p) for p in prefixes]
    probs = np.broadcast_to(np.asarray(rows, np.float32), (samples, n + 1, VOCAB))
    tile = lambda x: np.broadcast_to(np.asarray(x, np.int32), (samples, n))  # noqa: E731
    result = scv_jax.tree_rejection_sample(tile(tokens), tile(parents), np.full(samples, n, np.int32), probs,
                                           key=jax.random.key(7), max_depth=depth)
    out, accepted = np.asarray(result.output_token_ids), np.asarray(result.num_accepted)
    assert {int(a) for a in np.unique(accepted)} == set(range(depth + 1))     # every depth is reached
    rng = np.random.default_rng(0)
    length = depth + 1
    sequences = np.zeros(samples, np.int64)
    for s in range(samples):
        sequence = tuple(int(t) for t in out[s, :accepted[s] + 1])
        while len(sequence) < length:
            sequence += (int(rng.choice(VOCAB, p=target_distribution(sequence))),)
        sequences[s] = int(np.ravel_multi_index(sequence, (VOCAB,) * length))
    joint = np.zeros((VOCAB,) * length)
    for index in np.ndindex(*joint.shape):
        joint[index] = np.prod([target_distribution(index[:i])[index[i]] for i in range(length)])
    counts = np.bincount(sequences, minlength=joint.size)
    assert fits(counts, joint.reshape(-1))
    flat = np.full(joint.size, 1 / joint.size)
    assert not fits(counts, flat) and not fits(counts, 0.7 * joint.reshape(-1) + 0.3 * flat)


# ------------------------------------------------------------------------------------------- inputs


def test_empty_batch_and_empty_trees():
    for backend in ("xla", KERNEL):
        r = scv_jax.accept_tree_greedy(np.zeros((0, 3), np.int32), np.zeros((0, 3), np.int32), np.zeros(0, np.int32),
                                       np.zeros((0, 4), np.int32), max_depth=2, backend=backend)
        assert r.output_token_ids.shape == (0, 3) and r.accepted_nodes.shape == (0, 2)
    r = scv_jax.tree_rejection_sample(np.zeros((2, 0), np.int32), np.zeros((2, 0), np.int32), [0, 0],
                                      np.full((2, 1, 3), 1 / 3, np.float32), key=jax.random.key(0), max_depth=0)
    assert r.output_token_ids.shape == (2, 1) and r.accepted_nodes.shape == (2, 0)
    assert np.all((np.asarray(r.output_token_ids) >= 0) & (np.asarray(r.output_token_ids) < 3))


GOOD = dict(tree_token_ids=np.zeros((2, 3), np.int32), tree_parents=np.full((2, 3), -1, np.int32),
            num_nodes=np.full(2, 3, np.int32))


@pytest.mark.parametrize("change,error,match", [
    (dict(max_depth=-1), ValueError, "max_depth"),
    (dict(max_depth=1.5), ValueError, "max_depth"),
    (dict(tree_token_ids=np.zeros((2, 3), np.float32)), TypeError, "tree_token_ids"),
    (dict(tree_token_ids=np.zeros(3, np.int32)), ValueError, "tree_token_ids"),
    (dict(tree_parents=np.zeros((2, 4), np.int32)), ValueError, "tree_parents"),
    (dict(num_nodes=np.zeros(3, np.int32)), ValueError, "num_nodes"),
    (dict(target_token_ids=np.zeros((2, 3), np.int32)), ValueError, "target_token_ids"),
    (dict(target_probs=np.zeros((2, 4), np.float32)), ValueError, "target_probs"),
    (dict(target_probs=np.zeros((2, 4, 0), np.float32)), ValueError, "target_probs"),
    (dict(target_probs=np.zeros((2, 4, 3), np.int32)), TypeError, "target_probs"),
    (dict(key=None), ValueError, "key"),
    (dict(backend="cuda"), ValueError, "backend must be"),
])
def test_bad_static_inputs_raise_naming_the_argument(change, error, match):
    sampling = "target_probs" in change or "key" in change
    args = dict(GOOD, max_depth=2, **({"target_probs": np.full((2, 4, 3), 1 / 3, np.float32),
                                       "key": jax.random.key(0)} if sampling else
                                      {"target_token_ids": np.zeros((2, 4), np.int32)}))
    args.update(change)
    op = scv_jax.tree_rejection_sample if sampling else scv_jax.accept_tree_greedy
    with pytest.raises(error, match=match):
        op(**args)


def test_sampling_has_no_kernel():
    with pytest.raises(ValueError, match="no Pallas kernel"):
        scv_jax.tree_rejection_sample(**GOOD, target_probs=np.ones((2, 4, 3), np.float32), key=jax.random.key(0),
                                      max_depth=1, backend="interpret")


def test_runs_under_jit_with_traced_data():
    """Bad data under jit: garbage parents, ids and counts still give in-range, well-formed results."""
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(-5, 10, (4, 6)), jnp.int32)
    parents = jnp.asarray(rng.integers(-5, 10, (4, 6)), jnp.int32)
    num_nodes = jnp.asarray([-3, 0, 6, 100], jnp.int32)
    probs = jnp.asarray(rng.random((4, 7, 5)), jnp.float32)
    sample = jax.jit(functools.partial(scv_jax.tree_rejection_sample, max_depth=6))
    r = sample(tokens, parents, num_nodes, probs, key=jax.random.key(1))
    out = np.asarray(r.output_token_ids)
    emitted = np.arange(7)[None, :] <= np.asarray(r.num_accepted)[:, None]
    assert np.all(out[emitted] >= 0) and np.all(out[emitted] < 5) and np.all(out[~emitted] == -1)
    nodes = np.asarray(r.accepted_nodes)
    assert np.all((nodes >= -1) & (nodes < 6))


def test_greedy_kernel_lowers_for_cuda():
    kernel = registry.implementation("accept_tree_greedy", "pallas")
    fn = functools.partial(kernel.run, max_depth=4, interpret=False)
    ids = jnp.zeros((3, 16), jnp.int32)
    text = jax.jit(fn).trace(ids, ids, jnp.zeros(3, jnp.int32), jnp.zeros((3, 17), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
