"""The tree verifier of the decode step (a ``verifiers.Verifier``) over the step's ``StepInputs`` (B
requests, static k).

``TreeVerifier(tree)``: each request verifies a token tree of k = N nodes; ``num_drafts`` is its depth
cap (the most nodes it may accept, at most ``TreeConfig.max_depth``). No logprobs, no packed step.

1. ``propose``: a draft model's EAGLE-2 tree (``draft_tree``) or a host tree int32[B, 2, N] (node tokens,
   then parents; an n-gram trie, ``scv_jax.decoding.ngram_trie``), as a ``TreeProposal``.
2. ``score``: the target over ``[pending, node 0 .. node N - 1]`` (``[B, N + 1]``) with tree attention
   (pending = root; ``tree_inputs``).
3. ``accept``: ``accept_tree_greedy`` (an all-greedy step) or ``tree_rejection_sample`` on each request's
   filtered target distribution (a greedy request's is its one-hot); nodes deeper than the request's cap
   or below one of its stop tokens are never accepted; then the commit of the target K/V of the pending
   token and the accepted path (``accepted_path_slots``). The summary has ``max_depth + 1`` token columns.
4. ``commit_draft``: the draft's catch-up tokens and the accepted nodes it ran (every accepted node but
   the last: the draft's lag after a step is then 1, or 2 after an accepted node: ``proposers.draft_model.DraftModelTree``).

No cache receives a rejected token's K/V.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.sampling_math import argmax_ignoring_nan
from pallas_kernels.tree_mask import ancestor_mask, depths
from scv_jax.decoding.chain_verifier import DraftModelVerifier
from scv_jax.decoding.device_step import (ACCEPT_TAG, LogitControls, StepInputs, controlled, flatten_rows,
                                          sampling_filters, tagged_keys)
from scv_jax.decoding.positions import MAX_CATCH_UP
from scv_jax.decoding.tree_config import TreeConfig
from scv_jax.decoding.verifiers import row_at
from scv_jax.models.protocol import PagedForwardOutput, StagedKV
from scv_jax.ops.commit.api import slots_from_block_table
from scv_jax.ops.commit.kv_cache import PagedKVCache
from scv_jax.ops.commit.sharded import sharded_commit_draft_kv
from scv_jax.ops.sampling.api import filtered_probs
from scv_jax.ops.tree.api import accept_tree_greedy, tree_rejection_sample
from scv_jax.ops.tree.commit_path import accepted_path_slots
from scv_jax.ops.tree.result import TreeAcceptResult
from scv_jax.verify.summary import StepSummary


class TreeProposal(NamedTuple):
    """A tree step's tree and, from a draft model, what its commit needs.

    Attributes:
      tokens, parents: int32[B, N] the nodes (rank order: parents before children; parent -1 = the root).
      expanded: int32[B, E] the node of each token of the last expansion forward (-1: not in the tree).
      catch_up: the draft's catch-up forward (its K/V: ``[layers, B, MAX_CATCH_UP, kv_heads, head_dim]``).
      last: the last expansion forward's K/V ``[layers, B, E, ...]`` (E = (max_depth - 1) * branching), or None.
      A host tree has tokens and parents only (the rest None: no draft cache to commit).
    """

    tokens: jax.Array
    parents: jax.Array
    expanded: jax.Array | None = None
    catch_up: PagedForwardOutput | None = None
    last: PagedForwardOutput | None = None


def _top_children(logits: jax.Array, scores: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
    """The top ``width`` tokens of float[B, M, V] logits and their cumulative log-probabilities (``scores``
    float32[B, M] plus their own): int32[B, M, width], float32[B, M, width]."""
    logp, tokens = jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), width)
    return tokens.astype(jnp.int32), scores[:, :, None] + logp


def draft_tree(draft, draft_cache: PagedKVCache, block_tables: jax.Array, lag_tokens: jax.Array, lag: jax.Array,
               draft_lens: jax.Array, *, tree: TreeConfig, backend: str,
               controls: LogitControls | None = None) -> TreeProposal:
    """A draft model's EAGLE-2 tree (``grow_tree``) after its catch-up forward over the lag tokens."""
    out = draft.forward_paged(lag_tokens, draft_cache, block_tables, draft_lens, backend=backend)
    staged = StagedKV(out.keys, out.values, lag)

    def expand(tokens, parents, carry):
        last = draft.forward_paged(tokens, draft_cache, block_tables, draft_lens, staged, tree_parents=parents,
                                   backend=backend)
        return last.logits, carry, last

    return grow_tree(out, row_at(out.logits, lag - 1), lag, expand, None, tree=tree, controls=controls)


def grow_tree(catch_up, root_logits: jax.Array, lag: jax.Array, expand, root_carry, *, tree: TreeConfig,
              controls: LogitControls | None = None) -> TreeProposal:
    """EAGLE-2's dynamic tree: after the catch-up forward (``root_logits`` [B, V]: its logits at request
    b's root, row lag[b] - 1) the root's top ``branching`` children; then per level the ``branching``
    frontier nodes with the best cumulative draft log-probability expand their top ``branching`` children
    (``expand(tokens int32[B, E], tree_parents int32[B, E], carry) -> (logits [B, E, V], carry_out, out)``:
    one draft forward of every expanded node so far, tree attention, over the staged catch-up tokens;
    ``carry`` the drafter's own per-node input, each node taking its parent's ``carry_out``: an EAGLE head's
    hidden state, ``root_carry`` [B, ...] the root's; None for a draft model); the ``draft_nodes()`` best
    candidates by cumulative log-probability (ties: the earlier candidate), in rank order. Children are
    the draft's top-k: deterministic. With ``controls`` every node's logits take them over the committed
    history (not the node's path: the target's verification alone decides what is accepted; a level's
    children take the grammar's masks of its row, the root's only at the root), and with
    ``controls.automaton`` each request's drafting automaton at the node's path."""
    width, batch = tree.branching, lag.shape[0]
    automaton = None if controls is None else controls.automaton
    root = controlled(controls, root_logits[:, None])                                                # [B, 1, V]
    if automaton is not None:
        root = automaton.mask(root, automaton.states[:, None])
    tokens, scores = _top_children(root, jnp.zeros((batch, 1), jnp.float32), width)
    frontier_states = None if automaton is None else \
        automaton.advance(jnp.repeat(automaton.states[:, None], width, axis=1), tokens[:, 0])         # [B, width]
    pool_tokens, pool_scores = [tokens[:, 0]], [scores[:, 0]]
    pool_parents = [jnp.full((batch, width), -1, jnp.int32)]
    frontier = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))   # pool indices
    frontier_tokens, frontier_scores = tokens[:, 0], scores[:, 0]
    frontier_carry = jax.tree.map(lambda c: jnp.repeat(c[:, None], width, axis=1), root_carry)
    expanded, expanded_tokens, expanded_parents, expanded_carry, last = [], [], [], [], None
    rows = jnp.arange(batch)[:, None]
    parents = jnp.full((batch, width), -1, jnp.int32)      # the frontier's parents among the expanded nodes
    for level in range(1, tree.max_depth):
        expanded.append(frontier)
        expanded_tokens.append(frontier_tokens)
        expanded_parents.append(parents)
        expanded_carry.append(frontier_carry)
        logits, carry_out, last = expand(jnp.concatenate(expanded_tokens, axis=1),
                                         jnp.concatenate(expanded_parents, axis=1),
                                         jax.tree.map(lambda *c: jnp.concatenate(c, axis=1), *expanded_carry))
        children = controlled(controls, logits[:, -width:], grammar_rows=jnp.full((batch, width), level, jnp.int32))
        if automaton is not None:
            children = automaton.mask(children, frontier_states)
        tokens, scores = _top_children(children, frontier_scores, width)               # [B, width, width]
        offset = sum(t.shape[1] for t in pool_tokens)
        pool_tokens.append(tokens.reshape(batch, -1))
        pool_scores.append(scores.reshape(batch, -1))
        pool_parents.append(jnp.repeat(frontier, width, axis=1))
        frontier_scores, chosen = jax.lax.top_k(scores.reshape(batch, -1), width)      # ties: lower index
        frontier, frontier_tokens = offset + chosen, tokens.reshape(batch, -1)[rows, chosen]
        if automaton is not None:
            frontier_states = automaton.advance(
                jnp.repeat(frontier_states, width, axis=1)[rows, chosen], frontier_tokens)
        parents = (level - 1) * width + chosen // width       # the expanding frontier slot's place
        frontier_carry = jax.tree.map(lambda c: jnp.take_along_axis(
            c, parents.reshape(batch, width, *(1,) * (c.ndim - 2)), axis=1), carry_out)
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
    return TreeProposal(all_tokens[rows, picked], node_parents, node_of, catch_up, last)


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


def path_previous(recent: jax.Array, tokens: jax.Array, forward_parents: jax.Array, depth: jax.Array) -> jax.Array:
    """int32[B, N + 1, W]: after the pending token (0) and after each node i, the last W output tokens
    of the history: the path down to i (its ancestors and itself, ``depth`` int32[B, N + 1] of them)
    after the committed tokens' last (``recent`` int32[B, W]); ``tokens`` int32[B, N] the nodes',
    ``forward_parents`` int32[B, N + 1] the forward's parents (-1: the pending token's)."""
    width = recent.shape[1]
    tokens = jnp.concatenate([jnp.full((tokens.shape[0], 1), -1, jnp.int32), tokens.astype(jnp.int32)], axis=1)
    node = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    columns = []
    for back in range(width):                   # the latest token first: the node's, its parent's, ...
        committed = jnp.take_along_axis(recent, jnp.clip(width - 1 - (back - depth), 0, width - 1), axis=1)
        columns.append(jnp.where(back < depth, jnp.take_along_axis(tokens, node, axis=1), committed))
        node = jnp.maximum(jnp.take_along_axis(forward_parents, node, axis=1), 0)
    return jnp.stack(columns[::-1], axis=-1)


def accept_tree(logits: jax.Array, tokens: jax.Array, parents: jax.Array, keys: jax.Array, sampling: jax.Array,
                request_mask: jax.Array, *, max_depth: int, greedy: bool, backend: str,
                controls: LogitControls | None = None, forward_parents: jax.Array | None = None) -> TreeAcceptResult:
    """Stage 3: the acceptance of each request's tree against the target's logits float32[B, N + 1, V]
    (padding requests: nothing accepted, tokens -1). With ``controls`` (and the forward's
    ``forward_parents`` int32[B, N + 1]) the logits after node i take them with the path down to i
    (its ancestors and itself) in the history: what autoregressive decoding would see there."""
    batch, n = tokens.shape
    if controls is not None:
        full_mask = ancestor_mask(forward_parents)                                  # [B, N + 1, N + 1]
        # the nodes on each node's path (the pending token is committed): [B, N + 1, N]
        seen = jnp.where(full_mask[:, :, 1:], tokens[:, None, :], -1)
        depth = depths(full_mask)
        logits = controls.apply(logits, seen=seen, offsets=depth,
                                previous=path_previous(controls.recent, tokens, forward_parents, depth),
                                grammar_rows=jnp.broadcast_to(jnp.arange(n + 1, dtype=jnp.int32), (batch, n + 1)))
    num_nodes = jnp.full((batch,), n, jnp.int32)
    if greedy:
        result = accept_tree_greedy(tokens, parents, num_nodes, argmax_ignoring_nan(logits), max_depth=max_depth,
                                    backend=backend)
    else:
        probs = filtered_probs(logits, *sampling_filters(sampling), backend="xla")
        result = tree_rejection_sample(tokens, parents, num_nodes, probs, key=tagged_keys(keys, ACCEPT_TAG),
                                       max_depth=max_depth, backend="xla")
    live = request_mask[:, None]
    return TreeAcceptResult(jnp.where(live, result.output_token_ids, -1),
                            jnp.where(request_mask, result.num_accepted, 0),
                            jnp.where(live, result.accepted_nodes, -1))


def _commit(cache: PagedKVCache, keys: jax.Array, values: jax.Array, slots: jax.Array, mask: jax.Array,
            backend: str) -> PagedKVCache:
    """Commits rows of [layers, B, T, ...] K/V to ``slots`` int32[B, T] where ``mask`` bool[B, T]."""
    return sharded_commit_draft_kv(cache, flatten_rows(keys), flatten_rows(values), slots.reshape(-1),
                                   (mask & (slots >= 0)).reshape(-1), backend=backend)


def commit_draft_tree(draft_cache: PagedKVCache, proposal: TreeProposal, result: TreeAcceptResult,
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


def score_tree(target, target_cache: PagedKVCache, block_tables: jax.Array, inputs: StepInputs, proposal,
               cap: jax.Array, *, backend: str, aux_layers: tuple[int, ...] | None = None) -> "TreeScored":
    """Stage 2 of a tree step: the target over ``[pending, nodes]`` with tree attention, each request
    accepting at most ``cap`` int32[B] nodes (``tree_inputs``); with the taps of ``aux_layers`` when given."""
    forward_parents, accept_parents = tree_inputs(proposal.tokens, proposal.parents, cap, inputs.stop_ids)
    taps = {} if aux_layers is None else dict(aux_layers=aux_layers)
    out = target.forward_paged(jnp.concatenate([inputs.pending[:, None], proposal.tokens], axis=1), target_cache,
                               block_tables, inputs.context_lens, tree_parents=forward_parents, backend=backend,
                               **taps)
    return TreeScored(out, accept_parents, forward_parents)


class TreeScored(NamedTuple):
    """A tree step's target forward over [pending, nodes] and the acceptance's node parents (a node that
    may not be accepted is its own parent, ``tree_inputs``)."""

    output: PagedForwardOutput
    accept_parents: jax.Array
    forward_parents: jax.Array


@dataclasses.dataclass(frozen=True)
class TreeVerifier(DraftModelVerifier):
    """Token trees of ``tree``'s shape: host trees int32[B, 2, N] or a draft model's (``draft_tree``), see
    the module docstring. k is the node count N."""

    tree: TreeConfig
    name = "tree"

    def drafts_shape(self, k: int) -> tuple[int, ...]:
        return (2, k)

    def check(self, *, k: int, logprobs: bool, packed_k: int) -> None:
        if logprobs:
            raise ValueError("tree decode_step: logprobs needs a chain step (DecoderConfig.tree=None)")
        if packed_k:
            raise ValueError(f"tree decode_step: packed_k needs a chain step (DecoderConfig.tree=None), got {packed_k}")

    def propose(self, draft, drafts, draft_cache, block_tables, inputs, sampling, *, k, greedy, backend
                ) -> TreeProposal:
        if drafts is None:
            return draft_tree(draft, draft_cache, block_tables, inputs.lag_tokens, inputs.lag, inputs.draft_lens,
                              tree=self.tree, backend=backend, controls=inputs.controls)
        return TreeProposal(drafts[:, 0].astype(jnp.int32), drafts[:, 1].astype(jnp.int32))

    def score(self, target, target_cache, block_tables, inputs, proposal, *, k, packed_k, backend) -> TreeScored:
        return score_tree(target, target_cache, block_tables, inputs, proposal,
                          jnp.minimum(inputs.num_drafts, self.tree.max_depth), backend=backend)

    def accept(self, target_cache, scored, proposal, inputs, sampling, block_tables, *, block_size, greedy,
               backend) -> tuple[PagedKVCache, StepSummary, Any]:
        result = accept_tree(scored.output.logits, proposal.tokens, scored.accept_parents, inputs.keys, sampling,
                             inputs.request_mask, max_depth=self.tree.max_depth, greedy=greedy, backend=backend,
                             controls=inputs.controls, forward_parents=scored.forward_parents)
        slots = accepted_path_slots(result, block_tables, inputs.context_lens, tree_size=proposal.tokens.shape[1],
                                    block_size=block_size)
        target_cache = _commit(target_cache, scored.output.keys, scored.output.values, slots,
                               inputs.request_mask[:, None], backend)
        verified = jnp.where(inputs.request_mask, jnp.clip(inputs.num_drafts, 0, self.tree.max_depth), 0)
        return target_cache, StepSummary.pack(result.output_token_ids, result.num_accepted, verified), result

    def commit_draft(self, draft_cache, proposal, scored, result, block_tables, inputs, *, block_size, backend
                     ) -> PagedKVCache:
        if proposal.catch_up is None:
            return draft_cache
        return commit_draft_tree(draft_cache, proposal, result, block_tables, inputs.draft_lens, inputs.lag,
                                 inputs.request_mask, block_size=block_size, backend=backend)
