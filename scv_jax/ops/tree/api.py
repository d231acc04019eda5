"""Public tree acceptance ops and their dispatch: greedy exact match and lossless sampling down a draft tree.

A request's tree: ``tree_token_ids int32[B, N]``, ``tree_parents int32[B, N]`` (the parent node's index,
-1 = a child of the root, i.e. of the pending token; ``parents[b, i] < i``) and ``num_nodes int32[B]``
(nodes >= num_nodes are padding). Siblings are tried in index order.

Implementations (``scv_jax.ops.registry``): ``accept_tree_greedy``: "pallas" =
``pallas_kernels.tree_walk``, "xla" = ``reference``; ``tree_rejection_sample``: "xla" only.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from scv_jax.arguments import require_int
from scv_jax.checks import as_array, require_floating, require_int_vector, require_integer, require_rank
from scv_jax.ops import registry
from scv_jax.ops.acceptance.randomness import normalize_keys
from scv_jax.ops.tree import reference
from scv_jax.ops.tree.result import TreeAcceptResult
from pallas_kernels.sampling_math import bits_to_unit_interval


def _greedy_kernel(tree_token_ids, tree_parents, num_nodes, target_token_ids, *, max_depth: int,
                   interpret: bool) -> TreeAcceptResult:
    from pallas_kernels.tree_walk import accept_tree_greedy_kernel
    return TreeAcceptResult(*accept_tree_greedy_kernel(tree_token_ids, tree_parents, num_nodes, target_token_ids,
                                                       max_depth=max_depth, interpret=interpret))


registry.register("accept_tree_greedy", registry.Implementation("pallas", _greedy_kernel),
                  registry.Implementation("xla", reference.accept_tree_greedy_reference))
registry.register("tree_rejection_sample", registry.Implementation("xla", reference.tree_rejection_sample_reference))


def _check_tree(op: str, tree_token_ids, tree_parents, num_nodes, max_depth) -> tuple[int, int, int]:
    """Static checks shared by both ops; returns (B, N, max_depth)."""
    depth = require_int(op, "max_depth", max_depth, minimum=0, static=True)
    require_rank(op, "tree_token_ids", tree_token_ids, 2, "int32[B, N]")
    require_integer(op, "tree_token_ids", tree_token_ids, "int32[B, N]")
    shape = tuple(np.shape(tree_token_ids))
    require_rank(op, "tree_parents", tree_parents, 2, "int32[B, N]")
    require_integer(op, "tree_parents", tree_parents, "int32[B, N]")
    if tuple(np.shape(tree_parents)) != shape:
        raise ValueError(f"{op}: tree_parents must be int32[B, N] like tree_token_ids {shape}, "
                         f"got shape {tuple(np.shape(tree_parents))}")
    require_int_vector(op, "num_nodes", num_nodes, shape[0], "int32[B]")
    return shape[0], shape[1], depth


def _check_per_node(op: str, name: str, x, batch: int, n: int, doc: str) -> None:
    if tuple(np.shape(x)[:2]) != (batch, n + 1):
        raise ValueError(f"{op}: {name} must be {doc} with B={batch}, N + 1={n + 1}, got shape {tuple(np.shape(x))}")


def _int32(*xs) -> tuple[jax.Array, ...]:
    return tuple(jnp.asarray(x, jnp.int32) for x in xs)


def _padded(tree_token_ids, tree_parents, per_node):
    """An empty tree (N = 0) as one invalid node (parent 0 is not < its index 0, whatever num_nodes says; the walk
    needs N >= 1); also pads the [B, N + 1, ...] input."""
    if tree_token_ids.shape[1]:
        return tree_token_ids, tree_parents, per_node
    widths = [(0, 0), (0, 1)] + [(0, 0)] * (per_node.ndim - 2)
    node = jnp.zeros((tree_token_ids.shape[0], 1), jnp.int32)
    return node, node, jnp.pad(per_node, widths)


def accept_tree_greedy(tree_token_ids, tree_parents, num_nodes, target_token_ids, *, max_depth: int,
                       backend: str = "auto") -> TreeAcceptResult:
    """Greedy verification of a draft tree: follow the children that equal the target's tokens.

    From the root, accept the first child (in index order) whose token equals the target's token there
    and move to it; stop at the first node where no child matches and emit the target's token there
    (after a leaf, or after ``max_depth`` accepted nodes: its bonus token). Emitted tokens are the
    target's ids as given.

    Args:
      tree_token_ids: int32[B, N]; tree_parents: int32[B, N] (-1 = a child of the root; nodes whose parent
        is not in [-1, i) are ignored); num_nodes: int32[B] (clamped to [0, N]).
      target_token_ids: int32[B, N + 1], the target's token after the root (column 0) and after node i
        (column i + 1).
      max_depth: the most nodes accepted (static, >= 0).
      backend: "auto", "pallas", "xla" or "interpret" (``scv_jax.ops.registry``).
    Returns:
      ``TreeAcceptResult``.
    """
    op = "accept_tree_greedy"
    args = [as_array(op, name, x) for name, x in (
        ("tree_token_ids", tree_token_ids), ("tree_parents", tree_parents), ("num_nodes", num_nodes),
        ("target_token_ids", target_token_ids))]
    batch, n, depth = _check_tree(op, *args[:3], max_depth)
    require_rank(op, "target_token_ids", args[3], 2, "int32[B, N + 1]")
    require_integer(op, "target_token_ids", args[3], "int32[B, N + 1]")
    _check_per_node(op, "target_token_ids", args[3], batch, n, "int32[B, N + 1]")
    impl = registry.select(op, backend)
    return _accept_tree_greedy(*_int32(*args), max_depth=depth, impl=impl)


@functools.partial(jax.jit, static_argnames=("max_depth", "impl"))
def _accept_tree_greedy(tree_token_ids, tree_parents, num_nodes, target_token_ids, *, max_depth: int,
                        impl: registry.Selected) -> TreeAcceptResult:
    tree_token_ids, tree_parents, target_token_ids = _padded(tree_token_ids, tree_parents, target_token_ids)
    if tree_token_ids.shape[0] == 0:   # no requests: no kernel launch
        impl = reference.accept_tree_greedy_reference
    return impl(tree_token_ids, tree_parents, num_nodes, target_token_ids, max_depth=max_depth)


def tree_rejection_sample(tree_token_ids, tree_parents, num_nodes, target_probs, *, key: Any, max_depth: int,
                          backend: str = "auto") -> TreeAcceptResult:
    """Lossless sampling verification of a draft tree whose candidates are a deterministic function of
    their prefix (a draft model's top-k children, n-gram continuations), as SGLang's target-only tree
    sampling.

    At a node with residual r (initially the target's distribution there), its children are tried in
    index order: child c is accepted with probability r(c) / sum(r) (then the walk moves to it), else
    r(c) = 0; when no child is accepted, a sample of r / sum(r) is emitted and the walk stops. The
    emitted sequence is distributed exactly as autoregressive sampling from the target. Emitted ids
    are always in [0, V); children with ids outside [0, V) are rejected.

    Args:
      tree_token_ids, tree_parents, num_nodes: the tree, as for ``accept_tree_greedy``.
      target_probs: float[B, N + 1, V], the target's distribution after the root (row 0) and after
        node i (row i + 1), already filtered by the request's sampling parameters.
      key: one PRNG key or B keys (typed or legacy uint32); request b's numbers depend only on its key.
      max_depth: the most nodes accepted (static, >= 0).
      backend: "auto" or "xla" (no kernel yet).
    Returns:
      ``TreeAcceptResult``.
    """
    op = "tree_rejection_sample"
    args = [as_array(op, name, x) for name, x in (
        ("tree_token_ids", tree_token_ids), ("tree_parents", tree_parents), ("num_nodes", num_nodes),
        ("target_probs", target_probs))]
    batch, n, depth = _check_tree(op, *args[:3], max_depth)
    require_rank(op, "target_probs", args[3], 3, "float[B, N + 1, V]")
    require_floating(op, "target_probs", args[3], "float[B, N + 1, V]")
    _check_per_node(op, "target_probs", args[3], batch, n, "float[B, N + 1, V]")
    if np.shape(args[3])[2] < 1:
        raise ValueError(f"{op}: target_probs must be float[B, N + 1, V] with V >= 1, got shape {np.shape(args[3])}")
    impl = registry.select(op, backend)
    return _tree_rejection_sample(*_int32(*args[:3]), jnp.asarray(args[3]), key, max_depth=depth, impl=impl)


def node_randomness(keys: jax.Array, num_nodes_total: int, max_depth: int) -> tuple[jax.Array, jax.Array]:
    """float32[B, N] acceptance uniforms in (0, 1) (node i: ``fold_in(key_b, i)``) and uint32[B, max_depth + 1]
    seeds of the emitted sample at each depth (``fold_in(key_b, N + depth)``)."""
    def bits(key, count, offset):
        fold = jax.vmap(lambda i: jax.random.bits(jax.random.fold_in(key, i), (), jnp.uint32))
        return fold(offset + jnp.arange(count, dtype=jnp.uint32))

    uniforms = jax.vmap(lambda k: bits(k, num_nodes_total, 0))(keys)
    seeds = jax.vmap(lambda k: bits(k, max_depth + 1, num_nodes_total))(keys)
    return bits_to_unit_interval(uniforms), seeds


@functools.partial(jax.jit, static_argnames=("max_depth", "impl"))
def _tree_rejection_sample(tree_token_ids, tree_parents, num_nodes, target_probs, key, *, max_depth: int,
                           impl: registry.Selected) -> TreeAcceptResult:
    keys = normalize_keys("tree_rejection_sample", key, tree_token_ids.shape[0])   # static checks at trace time
    tree_token_ids, tree_parents, target_probs = _padded(tree_token_ids, tree_parents, target_probs)
    uniforms, seeds = node_randomness(keys, tree_token_ids.shape[1], max_depth)
    return impl(tree_token_ids, tree_parents, num_nodes, target_probs, uniforms, seeds, max_depth=max_depth)
