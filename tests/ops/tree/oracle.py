"""Plain-Python walks of the tree ops (one request at a time, as specified) and random trees for hypothesis."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

import jax.numpy as jnp

from pallas_kernels.sampling_math import race_scores, race_weights


def valid_nodes(parents, num_nodes: int) -> list[bool]:
    n = len(parents)
    return [i < min(max(num_nodes, 0), n) and -1 <= parents[i] < i for i in range(n)]


def padded(out: list[int], nodes: list[int], max_depth: int) -> tuple[list[int], int, list[int]]:
    return out + [-1] * (max_depth + 1 - len(out)), len(nodes), nodes + [-1] * (max_depth - len(nodes))


def greedy_walk(tokens, parents, num_nodes: int, target, max_depth: int):
    """(output_token_ids, num_accepted, accepted_nodes) of one request."""
    valid = valid_nodes(parents, num_nodes)
    current, out, nodes = -1, [], []
    while True:
        want = int(target[current + 1])
        out.append(want)
        child = next((i for i in range(len(tokens)) if valid[i] and parents[i] == current and tokens[i] == want), None)
        if child is None or len(nodes) == max_depth:
            return padded(out, nodes, max_depth)
        nodes.append(child)
        current = child


def sampling_walk(tokens, parents, num_nodes: int, probs, uniforms, seeds, max_depth: int):
    """One request of tree_rejection_sample with its per-node uniforms and per-depth seeds: the residual
    kept and updated child by child, as specified."""
    valid = valid_nodes(parents, num_nodes)
    vocab_size = probs.shape[1]
    current, out, nodes = -1, [], []
    while True:
        p = np.asarray(probs[current + 1], np.float32)
        p = np.where(p > 0, p, np.float32(0))
        residual = p.copy()
        child = None
        if len(nodes) < max_depth:
            for i in range(len(tokens)):
                if not (valid[i] and parents[i] == current and 0 <= tokens[i] < vocab_size):
                    continue
                if uniforms[i] * residual.sum(dtype=np.float32) < residual[tokens[i]]:
                    child = i
                    break
                residual[tokens[i]] = 0
        if child is None:
            weights = race_weights(jnp.asarray(p), jnp.asarray(p - residual))
            scores = np.asarray(race_scores(weights, jnp.uint32(seeds[len(nodes)]), jnp.arange(vocab_size)))
            scores = np.where(np.isnan(scores), -np.inf, scores)
            out.append(int(np.argmax(scores)))
            return padded(out, nodes, max_depth)
        out.append(int(tokens[child]))
        nodes.append(child)
        current = child


@st.composite
def trees(draw, *, vocab_size: int = 3, bad: bool | None = None, max_nodes: int = 10):
    """(tokens, parents, num_nodes, max_depth) of B requests: random trees, single chains, wide stars,
    duplicate sibling tokens (a vocabulary of 3), padding nodes, empty trees; ``bad``: also parents
    outside [-1, i), ids outside [0, V) and num_nodes outside [0, N]."""
    bad = draw(st.booleans()) if bad is None else bad
    batch = draw(st.sampled_from([1, 3]))
    n = draw(st.sampled_from([0, 1, 5, max_nodes]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    tokens = np.zeros((batch, n), np.int32)
    parents = np.zeros((batch, n), np.int32)
    num_nodes = np.zeros((batch,), np.int32)
    for b in range(batch):
        kind = draw(st.sampled_from(["random", "chain", "star", "padded"]))
        index = np.arange(n)
        parents[b] = {"chain": index - 1, "star": np.full(n, -1)}.get(kind, [rng.integers(-1, i) for i in index])
        tokens[b] = rng.integers(0, vocab_size, n)
        num_nodes[b] = rng.integers(0, n + 1) if kind == "padded" else n
        if bad:
            parents[b] = np.where(rng.random(n) < 0.3, rng.integers(-3, n + 3, n), parents[b])
            tokens[b] = np.where(rng.random(n) < 0.3, rng.integers(-3, vocab_size + 3, n), tokens[b])
            num_nodes[b] = rng.integers(-2, n + 3)
    max_depth = draw(st.sampled_from([0, 2, max_nodes]))
    return tokens, parents, num_nodes, max_depth
