"""The tree decode step (``DecoderConfig.tree``): each request verifies a token tree instead of a chain.

Same inputs as the chain step (``device_step.make_decode_step``: ``rows``, ``sampling``, per-request keys,
stop ids) with the static k the tree's node count N; ``StepRow.NUM_DRAFTS`` is each request's depth cap
(the most nodes it may accept: its budget - 1, at most ``TreeConfig.max_depth``). Stages:

1. ``propose``: a draft model's EAGLE-2 tree (``draft_tree``) or a tree given from the host
   (``drafts`` int32[B, 2, N]: node tokens, then parents; an n-gram trie, ``scv_jax.decoding.proposers.ngram_trie``).
2. ``score``: the target over ``[pending, node 0 .. node N - 1]`` with tree attention (pending = root).
3. ``accept``: ``accept_tree_greedy`` (an all-greedy step) or ``tree_rejection_sample`` on each request's
   filtered target distribution (a greedy request's is its one-hot); nodes deeper than the request's cap
   or below one of its stop tokens are never accepted.
4. ``commit``: the target K/V of the pending token and the accepted path (``accepted_path_slots``); the
   draft's catch-up tokens and the accepted nodes it ran (every accepted node but the last: the draft's
   lag after a step is then 1, or 2 after an accepted node, ``tree_lag_after_step``).

The summary is the chain step's ``StepSummary`` (``max_depth + 1`` token columns). A k = 0 step is the
chain step's (plain autoregressive).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.sampling_math import argmax_ignoring_nan
from pallas_kernels.tree_mask import ancestor_mask, depths
from scv_jax.decoding.device_step import (_ACCEPT, SplitModel, StepRow, _filters, _flatten_rows, _tagged,
                                          make_decode_step, request_keys)
from scv_jax.decoding.positions import MAX_CATCH_UP
from scv_jax.decoding.tree_config import TreeConfig
from scv_jax.models.protocol import PagedForwardOutput, StagedKV
from scv_jax.ops.commit.api import slots_from_block_table
from scv_jax.ops.commit.kv_cache import PagedKVCache
from scv_jax.ops.commit.sharded import sharded_commit_draft_kv
from scv_jax.ops.sampling.api import filtered_probs
from scv_jax.ops.tree.api import accept_tree_greedy, tree_rejection_sample
from scv_jax.ops.tree.commit_path import accepted_path_slots
from scv_jax.ops.tree.result import TreeAcceptResult
from scv_jax.verify.summary import StepSummary


def tree_lag_after_step(num_accepted):
    """The draft's lag after a tree step with a draft model: 1, or 2 when a node was accepted (the last
    accepted node's K/V is not committed: the draft may never have run it)."""
    return 1 + (num_accepted > 0)


class DraftTree(NamedTuple):
    """A draft model's tree and what its commit needs.

    Attributes:
      tokens, parents: int32[B, N] the nodes (rank order: parents before children; parent -1 = the root).
      expanded: int32[B, E] the node of each token of the last expansion forward (-1: not in the tree).
      catch_up: the draft's catch-up forward (its K/V: ``[layers, B, MAX_CATCH_UP, kv_heads, head_dim]``).
      last: the last expansion forward's K/V ``[layers, B, E, ...]`` (E = (max_depth - 1) * branching), or None.
    """

    tokens: jax.Array
    parents: jax.Array
    expanded: jax.Array
    catch_up: PagedForwardOutput
    last: PagedForwardOutput | None


def _top_children(logits: jax.Array, scores: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
    """The top ``width`` tokens of float[B, M, V] logits and their cumulative log-probabilities (``scores``
    float32[B, M] plus their own): int32[B, M, width], float32[B, M, width]."""
    logp, tokens = jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), width)
    return tokens.astype(jnp.int32), scores[:, :, None] + logp


def draft_tree(draft, draft_cache: PagedKVCache, block_tables: jax.Array, lag_tokens: jax.Array, lag: jax.Array,
               draft_lens: jax.Array, *, tree: TreeConfig, backend: str) -> DraftTree:
    """EAGLE-2's dynamic tree: after the catch-up forward the root's top ``branching`` children; then per
    level the ``branching`` frontier nodes with the best cumulative draft log-probability expand their
    top ``branching`` children (one draft forward of every expanded node so far, tree attention, over
    the staged catch-up tokens); the ``draft_nodes()`` best candidates by cumulative log-probability
    (ties: the earlier candidate), in rank order. Children are the draft's top-k: deterministic."""
    width, batch = tree.branching, lag_tokens.shape[0]
    out = draft.forward_paged(lag_tokens, draft_cache, block_tables, draft_lens, backend=backend)
    staged = StagedKV(out.keys, out.values, lag)
    root = jnp.take_along_axis(out.logits, (lag - 1)[:, None, None], axis=1)         # [B, 1, V]
    tokens, scores = _top_children(root, jnp.zeros((batch, 1), jnp.float32), width)
    pool_tokens, pool_scores = [tokens[:, 0]], [scores[:, 0]]
    pool_parents = [jnp.full((batch, width), -1, jnp.int32)]
    frontier = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))   # pool indices
    frontier_tokens, frontier_scores = tokens[:, 0], scores[:, 0]
    expanded, expanded_tokens, expanded_parents, last = [], [], [], None
    rows = jnp.arange(batch)[:, None]
    parents = jnp.full((batch, width), -1, jnp.int32)      # the frontier's parents among the expanded nodes
    for level in range(1, tree.max_depth):
        expanded.append(frontier)
        expanded_tokens.append(frontier_tokens)
        expanded_parents.append(parents)
        last = draft.forward_paged(jnp.concatenate(expanded_tokens, axis=1), draft_cache, block_tables, draft_lens,
                                   staged, tree_parents=jnp.concatenate(expanded_parents, axis=1), backend=backend)
        tokens, scores = _top_children(last.logits[:, -width:], frontier_scores, width)   # [B, W, W]
        offset = sum(t.shape[1] for t in pool_tokens)
        pool_tokens.append(tokens.reshape(batch, -1))
        pool_scores.append(scores.reshape(batch, -1))
        pool_parents.append(jnp.repeat(frontier, width, axis=1))
        frontier_scores, chosen = jax.lax.top_k(scores.reshape(batch, -1), width)      # ties: lower index
        frontier, frontier_tokens = offset + chosen, tokens.reshape(batch, -1)[rows, chosen]
        parents = (level - 1) * width + chosen // width       # the expanding frontier slot's place
    all_tokens, all_scores, all_parents = (jnp.concatenate(x, axis=1) for x in (pool_tokens, pool_scores, pool_parents))
    _, picked = jax.lax.top_k(all_scores, tree.draft_nodes())      # rank order; a parent ranks before its child
    parent_pool = all_parents[rows, picked]
    is_parent = parent_pool[:, :, None] == picked[:, None, :]     # [B, N, N]
    node_parents = jnp.where(jnp.any(is_parent, axis=2), jnp.argmax(is_parent, axis=2), -1).astype(jnp.int32)
    if expanded:
        pool_of = jnp.concatenate(expanded, axis=1)                                    # [B, E]
        match = pool_of[:, :, None] == picked[:, None, :]
        node_of = jnp.where(jnp.any(match, axis=2), jnp.argmax(match, axis=2), -1).astype(jnp.int32)
    else:
        node_of = jnp.zeros((batch, 0), jnp.int32)
    return DraftTree(all_tokens[rows, picked], node_parents, node_of, out, last)


def tree_inputs(tokens: jax.Array, parents: jax.Array, cap: jax.Array, stop_ids: jax.Array
                ) -> tuple[jax.Array, jax.Array]:
    """(the target forward's ``tree_parents`` int32[B, N + 1] over [pending, nodes]; the acceptance's node
    parents int32[B, N]): nodes whose parent is not in [-1, i) hang off the root in the forward and are
    never accepted, nor are nodes deeper than ``cap`` int32[B] or below a node whose token is one of the
    request's ``stop_ids`` int32[B, S] (-1 = none), nor their descendants."""
    batch, n = tokens.shape
    index = jnp.arange(n, dtype=jnp.int32)[None, :]
    in_range = (parents >= -1) & (parents < index)
    forward_parents = jnp.concatenate([jnp.full((batch, 1), -1, jnp.int32),
                                       jnp.where(in_range, parents + 1, 0).astype(jnp.int32)], axis=1)
    full_mask = ancestor_mask(forward_parents)
    mask = full_mask[:, 1:, 1:]                                              # [B, N, N] node j is i or above i
    is_stop = jnp.any((tokens[:, :, None] == stop_ids[:, None, :]) & (stop_ids[:, None, :] >= 0), axis=2)
    below_stop = jnp.any(mask & ~jnp.eye(n, dtype=jnp.bool_)[None] & is_stop[:, None, :], axis=2)
    bad_above = jnp.any(mask & ~in_range[:, None, :], axis=2)
    too_deep = depths(full_mask)[:, 1:] > cap[:, None]
    keep = ~(below_stop | bad_above | too_deep)
    return forward_parents, jnp.where(keep, parents, index).astype(jnp.int32)   # parent = itself: ignored


def accept_tree(logits: jax.Array, tokens: jax.Array, parents: jax.Array, keys: jax.Array, sampling: jax.Array,
                request_mask: jax.Array, *, max_depth: int, greedy: bool, backend: str) -> TreeAcceptResult:
    """Stage 3: the acceptance of each request's tree against the target's logits float32[B, N + 1, V]
    (padding requests: nothing accepted, tokens -1)."""
    batch, n = tokens.shape
    num_nodes = jnp.full((batch,), n, jnp.int32)
    if greedy:
        result = accept_tree_greedy(tokens, parents, num_nodes, argmax_ignoring_nan(logits), max_depth=max_depth,
                                    backend=backend)
    else:
        probs = filtered_probs(logits, *_filters(sampling), backend="xla")
        result = tree_rejection_sample(tokens, parents, num_nodes, probs, key=_tagged(keys, _ACCEPT),
                                       max_depth=max_depth, backend="xla")
    live = request_mask[:, None]
    return TreeAcceptResult(jnp.where(live, result.output_token_ids, -1),
                            jnp.where(request_mask, result.num_accepted, 0),
                            jnp.where(live, result.accepted_nodes, -1))


def _commit(cache: PagedKVCache, keys: jax.Array, values: jax.Array, slots: jax.Array, mask: jax.Array,
            backend: str) -> PagedKVCache:
    """Commits rows of [layers, B, T, ...] K/V to ``slots`` int32[B, T] where ``mask`` bool[B, T]."""
    return sharded_commit_draft_kv(cache, _flatten_rows(keys), _flatten_rows(values), slots.reshape(-1),
                                   (mask & (slots >= 0)).reshape(-1), backend=backend)


def commit_draft_tree(draft_cache: PagedKVCache, proposal: DraftTree, result: TreeAcceptResult,
                      block_tables: jax.Array, draft_lens: jax.Array, lag: jax.Array, request_mask: jax.Array, *,
                      block_size: int, backend: str) -> PagedKVCache:
    """Stage 4: the draft's catch-up tokens (positions ``draft_lens + s``, s < lag) and the accepted nodes at
    depths d < num_accepted - 1 (expanded, so in the last expansion forward) at ``draft_lens + lag + d``."""
    s = jnp.arange(MAX_CATCH_UP, dtype=jnp.int32)[None, :]
    positions = [draft_lens[:, None] + s]
    masks = [s < lag[:, None]]
    keys, values = [proposal.catch_up.keys], [proposal.catch_up.values]
    if proposal.last is not None:
        depth = jnp.arange(result.accepted_nodes.shape[1], dtype=jnp.int32)[None, :]
        node = proposal.expanded[:, :, None]                                   # [B, E, 1]
        on_path = ((node == result.accepted_nodes[:, None, :]) & (node >= 0)
                   & (depth[:, None, :] < (result.num_accepted - 1)[:, None, None]))   # [B, E, depth]
        positions.append(draft_lens[:, None] + lag[:, None] + jnp.argmax(on_path, axis=2).astype(jnp.int32))
        masks.append(jnp.any(on_path, axis=2))
        keys.append(proposal.last.keys)
        values.append(proposal.last.values)
    positions, mask = jnp.concatenate(positions, axis=1), jnp.concatenate(masks, axis=1) & request_mask[:, None]
    slots = slots_from_block_table(block_tables, positions, block_size)
    return _commit(draft_cache, jnp.concatenate(keys, axis=2), jnp.concatenate(values, axis=2), slots, mask, backend)


def make_tree_decode_step(target: SplitModel, draft: SplitModel | None, block_size: int, tree: TreeConfig):
    """``decode_step(...)`` of a tree decoder: the chain step's signature (``device_step.make_decode_step``),
    k the node count (0: the chain step's autoregressive one), ``drafts`` a host tree int32[B, 2, k]."""
    chain = make_decode_step(target, draft, block_size)

    def decode_step(target_params, draft_params, target_cache, draft_cache, block_tables, rows, sampling,
                    drafts=None, request_mask=None, *, k: int, greedy: bool, logprobs: bool = False,
                    backend: str = "auto", packed_k: int = 0):
        """One tree step of B requests; returns (target_cache, draft_cache, ``StepSummary``)."""
        if logprobs or packed_k:
            raise ValueError("tree decode_step: logprobs and packed_k need a chain step (DecoderConfig.tree=None)")
        if k == 0:
            return chain(target_params, draft_params, target_cache, draft_cache, block_tables, rows, sampling,
                         None, request_mask, k=0, greedy=greedy, backend=backend)
        if (drafts is None) == (draft_params is None):
            raise ValueError("tree decode_step: give either draft_params (a draft model) or drafts (a host tree)")
        if drafts is not None and drafts.shape[1:] != (2, k):
            raise ValueError(f"tree decode_step: drafts must be int32[B, 2, k={k}], got shape {drafts.shape}")
        lag, context_lens, cap = rows[:, StepRow.LAG], rows[:, StepRow.CONTEXT], rows[:, StepRow.NUM_DRAFTS]
        tail = rows[:, StepRow.TOKENS:]
        catch_up = jnp.arange(MAX_CATCH_UP, dtype=jnp.int32)[None, :] + MAX_CATCH_UP - lag[:, None]
        lag_tokens = jnp.take_along_axis(tail, jnp.clip(catch_up, 0, MAX_CATCH_UP - 1), axis=1)
        if request_mask is None:
            request_mask = jnp.ones((rows.shape[0],), jnp.bool_)
        keys = request_keys(rows[:, StepRow.KEY:StepRow.KEY + 2], context_lens)
        draft_lens = context_lens + 1 - lag
        proposal = None
        if drafts is None:
            proposal = draft_tree(draft.merge(draft_params), draft_cache, block_tables, lag_tokens, lag, draft_lens,
                                  tree=tree, backend=backend)
            tokens, parents = proposal.tokens, proposal.parents
        else:
            tokens, parents = drafts[:, 0].astype(jnp.int32), drafts[:, 1].astype(jnp.int32)
        forward_parents, accept_parents = tree_inputs(tokens, parents, jnp.minimum(cap, tree.max_depth),
                                                      rows[:, StepRow.STOP:StepRow.TOKENS])
        scored = target.merge(target_params).forward_paged(
            jnp.concatenate([tail[:, -1:], tokens], axis=1), target_cache, block_tables, context_lens,
            tree_parents=forward_parents, backend=backend)
        result = accept_tree(scored.logits, tokens, accept_parents, keys, sampling, request_mask,
                             max_depth=tree.max_depth, greedy=greedy, backend=backend)
        slots = accepted_path_slots(result, block_tables, context_lens, tree_size=tokens.shape[1],
                                    block_size=block_size)
        target_cache = _commit(target_cache, scored.keys, scored.values, slots, request_mask[:, None], backend)
        if proposal is not None:
            draft_cache = commit_draft_tree(draft_cache, proposal, result, block_tables, draft_lens, lag, request_mask,
                                            block_size=block_size, backend=backend)
        return target_cache, draft_cache, StepSummary.pack(result.output_token_ids, result.num_accepted)

    return decode_step
