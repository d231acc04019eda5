"""Mosaic GPU kernel: the greedy walk down each request's draft tree.

One CTA (one warpgroup) per request walks from the root: at each depth it scans the nodes in index
order for the first valid child of the current node (index < num_nodes, parent == current, parent <
index) whose token equals the target's token there, moves to it, and stops where there is none.
Scalar work only (at most ``max_depth * N`` steps), like ``accept_scan``; every read index is the
current node + 1 in [0, N] or a loop index, so bad trees never read out of bounds.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.platform import interpret_params


def _walk_body(num_nodes_total: int, max_depth: int, tokens_ref, parents_ref, num_nodes_ref, target_ref,
               out_ref, num_accepted_ref, nodes_ref):
    n = num_nodes_total
    b = lax.axis_index("b")
    count = jnp.clip(num_nodes_ref[b], 0, n)

    def depth_step(depth, carry):
        current, alive, num_accepted = carry
        target = target_ref[b, current + 1]

        def node_step(j, best):
            parent = parents_ref[b, j]
            match = (best == n) & (j < count) & (parent == current) & (parent < j) & (tokens_ref[b, j] == target)
            return jnp.where(match, j, best)

        best = lax.fori_loop(0, n, node_step, jnp.int32(n))
        accepted = alive & (best < n)
        out_ref[b, depth] = jnp.where(alive, target, -1)
        nodes_ref[b, depth] = jnp.where(accepted, best, -1)
        return jnp.where(accepted, best, current), accepted, num_accepted + accepted.astype(jnp.int32)

    current, alive, num_accepted = lax.fori_loop(0, max_depth, depth_step,
                                                 (jnp.int32(-1), jnp.bool_(True), jnp.int32(0)))
    out_ref[b, max_depth] = jnp.where(alive, target_ref[b, current + 1], -1)
    num_accepted_ref[b] = num_accepted


def accept_tree_greedy_kernel(tree_token_ids: jax.Array, tree_parents: jax.Array, num_nodes: jax.Array,
                              target_token_ids: jax.Array, *, max_depth: int, interpret: bool = False):
    """Greedy tree acceptance. Inputs int32 [B, N], [B, N], [B], [B, N + 1] (N >= 1); see
    ``scv_jax.accept_tree_greedy``. Returns (output_token_ids int32[B, max_depth + 1], num_accepted
    int32[B], accepted_nodes int32[B, max_depth])."""
    batch, n = tree_token_ids.shape
    out_type = (jax.ShapeDtypeStruct((batch, max_depth + 1), jnp.int32),
                jax.ShapeDtypeStruct((batch,), jnp.int32),
                jax.ShapeDtypeStruct((batch, max(max_depth, 1)), jnp.int32))   # (no empty buffers)
    body = functools.partial(_walk_body, n, max_depth)
    out, num_accepted, nodes = plgpu.kernel(body, out_type=out_type, grid=(batch,), grid_names=("b",),
                                            interpret=interpret_params(interpret))(
        tree_token_ids, tree_parents, num_nodes, target_token_ids)
    return out, num_accepted, nodes[:, :max_depth]
