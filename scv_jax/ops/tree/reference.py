"""Pure-JAX references of the tree acceptance ops (also the ``backend="xla"`` implementation).

Both walk the tree from the root one depth at a time (``walk``): at the current node (-1 = the root,
i.e. the pending token) a rule picks the accepted child among its valid children or stops and names
the token emitted there. A node i is valid when i < num_nodes and -1 <= parents[i] < i; invalid
nodes (padding, bad parents) are never children, so every read stays in bounds.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.sampling_math import argmax_ignoring_nan, race_scores, race_weights
from scv_jax.ops.tree.result import TreeAcceptResult

# (current node int32[B], its valid children bool[B, N], depth) -> (accepted child int32[B] (N: none),
# the token emitted when no child is accepted int32[B])
Rule = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


def valid_nodes(tree_parents: jax.Array, num_nodes: jax.Array) -> jax.Array:
    """bool[B, N]: real nodes (index < num_nodes, clamped to [0, N]) whose parent is -1 or an earlier node."""
    index = jnp.arange(tree_parents.shape[1], dtype=jnp.int32)[None, :]
    count = jnp.clip(num_nodes, 0, tree_parents.shape[1])[:, None]
    return (index < count) & (tree_parents >= -1) & (tree_parents < index)


def first_true(mask: jax.Array) -> jax.Array:
    """int32[B]: the index of the first True of bool[B, N] in each row, N when there is none."""
    n = mask.shape[1]
    index = jnp.arange(n, dtype=jnp.int32)[None, :]
    return jnp.min(jnp.where(mask, index, n), axis=1).astype(jnp.int32)


def walk(rule: Rule, tree_token_ids: jax.Array, tree_parents: jax.Array, num_nodes: jax.Array, *,
         max_depth: int) -> TreeAcceptResult:
    """Walks every request's tree from the root with ``rule``, accepting at most ``max_depth`` nodes
    (N >= 1 nodes; the op pads an empty tree with one invalid node)."""
    batch, n = tree_token_ids.shape
    valid = valid_nodes(tree_parents, num_nodes)
    rows = jnp.arange(batch)

    def step(depth, carry):
        current, alive, out, nodes = carry
        children = valid & (tree_parents == current[:, None]) & (depth < max_depth)
        child, emitted = rule(current, children, depth)
        accepted = alive & (child < n)
        token = jnp.where(accepted, tree_token_ids[rows, jnp.minimum(child, n - 1)], emitted)
        out = out.at[:, depth].set(jnp.where(alive, token, -1))
        if max_depth:   # (an empty axis cannot be indexed, even with mode="drop")
            nodes = nodes.at[:, depth].set(jnp.where(accepted, child, -1), mode="drop")
        return jnp.where(accepted, child, current), accepted, out, nodes

    carry = (jnp.full((batch,), -1, jnp.int32), jnp.ones((batch,), jnp.bool_),
             jnp.full((batch, max_depth + 1), -1, jnp.int32), jnp.full((batch, max_depth), -1, jnp.int32))
    _, _, out, nodes = lax.fori_loop(0, max_depth + 1, step, carry)
    return TreeAcceptResult(out, jnp.sum(nodes >= 0, axis=1, dtype=jnp.int32), nodes)


def accept_tree_greedy_reference(tree_token_ids: jax.Array, tree_parents: jax.Array, num_nodes: jax.Array,
                                 target_token_ids: jax.Array, *, max_depth: int) -> TreeAcceptResult:
    """Greedy: accept the first child whose token is the target's token at the current node
    (``target_token_ids[b, node + 1]``); stop where none is and emit the target's token there."""
    rows = jnp.arange(tree_token_ids.shape[0])

    def rule(current, children, _):
        target = target_token_ids[rows, current + 1]
        return first_true(children & (tree_token_ids == target[:, None])), target

    return walk(rule, tree_token_ids, tree_parents, num_nodes, max_depth=max_depth)


def tree_rejection_sample_reference(tree_token_ids: jax.Array, tree_parents: jax.Array, num_nodes: jax.Array,
                                    target_probs: jax.Array, uniforms: jax.Array, seeds: jax.Array, *,
                                    max_depth: int) -> TreeAcceptResult:
    """Lossless sampling of deterministic candidates (SGLang's target-only tree sampling).

    At a node with residual r (initially the target's distribution there, ``target_probs[b, node + 1]``)
    the children are tried in index order: child c is accepted with probability r(c) / sum(r) (uniform
    ``uniforms[b, c]``), else r(c) = 0. When none is accepted, a sample of r / sum(r) is emitted (the
    exponential race with seed ``seeds[b, depth]``). All children's trials are computed at once: child
    j sees r with the tokens of the earlier children zeroed, so a repeated token is always rejected.

    Args:
      target_probs: float[B, N + 1, V] (negative and NaN entries read as 0).
      uniforms: float32[B, N] in (0, 1); seeds: uint32[B, max_depth + 1].
    """
    batch, n = tree_token_ids.shape
    vocab_size = target_probs.shape[2]
    rows = jnp.arange(batch)
    in_vocab = (tree_token_ids >= 0) & (tree_token_ids < vocab_size)
    safe_ids = jnp.clip(tree_token_ids, 0, vocab_size - 1)
    earlier = jnp.arange(n)[None, :] < jnp.arange(n)[:, None]                    # [j, k]: k < j
    same_token = tree_token_ids[:, :, None] == tree_token_ids[:, None, :]        # [B, j, k]
    token_ids = jnp.arange(vocab_size, dtype=jnp.int32)[None, :]

    def rule(current, children, depth):
        p = target_probs[rows, current + 1].astype(jnp.float32)
        p = jnp.where(p > 0, p, 0.0)                                              # NaN and negatives: 0
        tried = children & in_vocab
        p_child = jnp.where(tried, jnp.take_along_axis(p, safe_ids, axis=1), 0.0)
        repeated = jnp.any(tried[:, None, :] & same_token & earlier[None], axis=2)
        first = tried & ~repeated
        removed_before = jnp.cumsum(jnp.where(first, p_child, 0.0), axis=1) - jnp.where(first, p_child, 0.0)
        remaining = jnp.sum(p, axis=1, keepdims=True) - removed_before
        accepted = first & (uniforms * remaining < p_child)
        hit = jnp.zeros(p.shape, jnp.bool_).at[rows[:, None], safe_ids].max(tried)
        weights = race_weights(p, jnp.where(hit, p, 0.0))          # r with the children's tokens zeroed
        emitted = argmax_ignoring_nan(race_scores(weights, seeds[rows, depth][:, None], token_ids))
        return first_true(accepted), emitted

    return walk(rule, tree_token_ids, tree_parents, num_nodes, max_depth=max_depth)
