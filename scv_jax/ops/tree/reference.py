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

# (current node int32[B], its valid children bool[B, N]) -> the accepted child int32[B] (N: none)
Rule = Callable[[jax.Array, jax.Array], jax.Array]


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
         max_depth: int) -> tuple[TreeAcceptResult, jax.Array, jax.Array]:
    """Walks every request's tree from the root with ``rule``, accepting at most ``max_depth`` nodes (N >= 1
    nodes; the op pads an empty tree with one invalid node).

    Returns (the result with the accepted nodes' tokens only, -1 from column ``num_accepted`` on; the last
    node reached int32[B] (-1 = the root); bool[B, N] the children tried there, i.e. rejected: none when
    the walk stopped at ``max_depth``). The caller emits its token at column ``num_accepted`` (``finish``).
    """
    batch, n = tree_token_ids.shape
    valid = valid_nodes(tree_parents, num_nodes)
    rows = jnp.arange(batch)

    def children_of(current):
        return valid & (tree_parents == current[:, None])

    def step(depth, carry):
        current, alive, out, nodes = carry
        child = rule(current, children_of(current))
        accepted = alive & (child < n)
        out = out.at[:, depth].set(jnp.where(accepted, tree_token_ids[rows, jnp.minimum(child, n - 1)], -1))
        nodes = nodes.at[:, depth].set(jnp.where(accepted, child, -1))
        return jnp.where(accepted, child, current), accepted, out, nodes

    carry = (jnp.full((batch,), -1, jnp.int32), jnp.ones((batch,), jnp.bool_),
             jnp.full((batch, max_depth + 1), -1, jnp.int32), jnp.full((batch, max_depth), -1, jnp.int32))
    if max_depth:   # (an empty axis cannot be indexed, not even in a loop that never runs)
        carry = lax.fori_loop(0, max_depth, step, carry)
    final, _, out, nodes = carry
    num_accepted = jnp.sum(nodes >= 0, axis=1, dtype=jnp.int32)
    rejected = children_of(final) & (num_accepted < max_depth)[:, None]
    return TreeAcceptResult(out, num_accepted, nodes), final, rejected


def finish(partial: TreeAcceptResult, emitted: jax.Array) -> TreeAcceptResult:
    """``partial`` with ``emitted`` int32[B] (the token after the last accepted node) at column num_accepted."""
    rows = jnp.arange(emitted.shape[0])
    return partial._replace(output_token_ids=partial.output_token_ids.at[rows, partial.num_accepted].set(emitted))


def accept_tree_greedy_reference(tree_token_ids: jax.Array, tree_parents: jax.Array, num_nodes: jax.Array,
                                 target_token_ids: jax.Array, *, max_depth: int) -> TreeAcceptResult:
    """Greedy: accept the first child whose token is the target's token at the current node
    (``target_token_ids[b, node + 1]``); stop where none is and emit the target's token there."""
    rows = jnp.arange(tree_token_ids.shape[0])

    def rule(current, children):
        return first_true(children & (tree_token_ids == target_token_ids[rows, current + 1][:, None]))

    partial, final, _ = walk(rule, tree_token_ids, tree_parents, num_nodes, max_depth=max_depth)
    return finish(partial, target_token_ids[rows, final + 1])


def tree_rejection_sample_reference(tree_token_ids: jax.Array, tree_parents: jax.Array, num_nodes: jax.Array,
                                    target_probs: jax.Array, uniforms: jax.Array, seeds: jax.Array, *,
                                    max_depth: int) -> TreeAcceptResult:
    """Lossless sampling of deterministic candidates (SGLang's target-only tree sampling).

    At a node with residual r (initially the target's distribution there, ``target_probs[b, node + 1]``)
    the children are tried in index order: child c is accepted with probability r(c) / sum(r) (uniform
    ``uniforms[b, c]``), else r(c) = 0. When none is accepted, a sample of r / sum(r) is emitted (the
    exponential race with seed ``seeds[b, num_accepted]``). All children's trials at a node are computed
    at once: child j sees r with the tokens of the earlier children zeroed, so a repeated token is always
    rejected. A step reads one [V] row per request (its sum); only the last node's row is raced.

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

    def probs_at(node, token_ids):
        """float32 target probabilities after ``node`` int32[B] of ``token_ids`` int32[B, M] (NaN, < 0: 0)."""
        p = target_probs[rows[:, None], (node + 1)[:, None], token_ids].astype(jnp.float32)
        return jnp.where(p > 0, p, 0.0)

    def rule(current, children):
        tried = children & in_vocab
        p_child = jnp.where(tried, probs_at(current, safe_ids), 0.0)
        repeated = jnp.any(tried[:, None, :] & same_token & earlier[None], axis=2)
        first = tried & ~repeated
        removed_before = jnp.cumsum(jnp.where(first, p_child, 0.0), axis=1) - jnp.where(first, p_child, 0.0)
        row = target_probs[rows, current + 1].astype(jnp.float32)
        remaining = jnp.sum(jnp.where(row > 0, row, 0.0), axis=1, keepdims=True) - removed_before
        return first_true(first & (uniforms * remaining < p_child))

    partial, final, rejected = walk(rule, tree_token_ids, tree_parents, num_nodes, max_depth=max_depth)
    token_ids = jnp.arange(vocab_size, dtype=jnp.int32)[None, :]
    p = probs_at(final, jnp.broadcast_to(token_ids, (batch, vocab_size)))
    hit = jnp.zeros(p.shape, jnp.bool_).at[rows[:, None], safe_ids].max(rejected & in_vocab)
    weights = race_weights(p, jnp.where(hit, p, 0.0))                 # r with the rejected children's tokens zeroed
    return finish(partial, argmax_ignoring_nan(race_scores(weights, seeds[rows, partial.num_accepted][:, None],
                                                           token_ids)))
