"""The commit of a tree's accepted path: slots that write only the accepted root-to-leaf path's K/V."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from scv_jax.arguments import require_int
from scv_jax.checks import as_array, require_int_vector, require_integer, require_rank
from scv_jax.ops.commit.api import slots_from_block_table
from scv_jax.ops.tree.result import TreeAcceptResult


def accepted_path_slots(result: TreeAcceptResult, block_tables, first_positions, *, tree_size: int,
                        block_size: int) -> jax.Array:
    """Commit slots of a tree verify forward's new tokens ``[pending, node 0, ..., node N - 1]``.

    The pending token goes to position ``first_positions[b]`` and the node accepted at depth d to
    ``first_positions[b] + 1 + d`` (consecutive positions after the pending token); every other node
    gets slot -1, which ``commit_draft_kv`` skips, so nothing else is written (NWOR). Pass the result,
    flattened to ``[B * (N + 1)]``, as ``slot_mapping`` with the [layers, B * (N + 1), ...] K/V of the
    forward (target and draft caches alike).

    Args:
      result: the ``TreeAcceptResult`` of ``accept_tree_greedy`` / ``tree_rejection_sample``
        (``accepted_nodes`` int32[B, max_depth]; entries outside [0, N) are ignored).
      block_tables: int32[B, max_blocks]; first_positions: int32[B], the pending token's position.
      tree_size: N, the tree's node count (static).
      block_size: tokens per cache block (static).
    Returns:
      int32[B, N + 1] slots (-1 = not written).
    """
    op = "accepted_path_slots"
    if not isinstance(result, TreeAcceptResult):
        raise TypeError(f"{op}: result must be a scv_jax.TreeAcceptResult, got {type(result).__name__}")
    n = require_int(op, "tree_size", tree_size, minimum=0, static=True)
    nodes, block_tables, first_positions = (as_array(op, name, x) for name, x in (
        ("result.accepted_nodes", result.accepted_nodes), ("block_tables", block_tables),
        ("first_positions", first_positions)))
    require_rank(op, "result.accepted_nodes", nodes, 2, "int32[B, max_depth]")
    require_integer(op, "result.accepted_nodes", nodes, "int32[B, max_depth]")
    batch, depth = np.shape(nodes)
    require_int_vector(op, "first_positions", first_positions, batch, "int32[B]")
    nodes, first_positions = jnp.asarray(nodes, jnp.int32), jnp.asarray(first_positions, jnp.int32)
    valid = (nodes >= 0) & (nodes < n)
    columns = jnp.where(valid, nodes + 1, n + 1)                      # n + 1: out of range, dropped
    positions = jnp.full((batch, n + 1), -1, jnp.int32).at[:, 0].set(first_positions)
    path = first_positions[:, None] + 1 + jnp.arange(depth, dtype=jnp.int32)[None, :]
    positions = positions.at[jnp.arange(batch)[:, None], columns].set(path, mode="drop")
    return slots_from_block_table(block_tables, positions, block_size)
