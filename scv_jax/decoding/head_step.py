"""An EAGLE head's device half: chains drafted from the target's own features (``HeadChainVerifier``)
and the prefill that feeds the head the prompt's (``make_head_prefill_step``).

A head row at position p pairs the target's feature of position p (its taps at ``head.aux_layers``,
combined by ``head.combine``) with the token at position p + 1, and predicts the token at p + 2. The
head's cache (``caches.HeadCache``) holds the K/V of rows [0, context - lag) (context: the target's
cache length, the pending token's position; lag >= 0: 0 after a prefill, whose rows reach the pending
token) and, for every verified position, its feature and accepted draft. Each step, k = 0 included:

1. ``propose``: the head's catch-up over its ``lag`` missing rows, at least one (features and tokens
   read from its cache, the pending token last; at lag 0 the last committed row, run again for its
   hidden state, not committed), then k - 1 one-row forwards, each feeding the head its own
   ``hidden_out`` and its last draft (``chain_verifier.draft_chain``). A request at position 0 (a one-token
   prompt: no feature yet) proposes nothing that step.
2. ``score``: the chain verifier's target forward, dense or packed (``chain_verifier.score_chain``), asking for
   the taps of every token it scores.
3. ``accept``: the chain verifier's.
4. ``commit_draft``: the catch-up rows' K/V (rows from the head's own hidden states are never
   committed: the next catch-up recomputes accepted ones from the target's features, as EAGLE does),
   the features of the pending token and the accepted drafts (a packed step's taken by request and
   offset from its packed tokens, ``ChainScored.grid``), and the accepted drafts' tokens. The new
   lag is the emitted count, ``num_accepted + 1`` (``proposers.draft_model.HeadChain``).

Nothing of a rejected draft reaches any cache.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from scv_jax.decoding.caches import HeadCache
from scv_jax.decoding.chain_verifier import (ChainScored, ChainVerifier, draft_chain, score_chain,
                                            swap_layers_and_batch)
from scv_jax.decoding.device_step import SplitModel, commit_positions
from scv_jax.decoding.tree_verifier import TreeScored, TreeVerifier, grow_tree, score_tree
from scv_jax.models.protocol import StagedKV
from scv_jax.ops.commit.api import slots_from_block_table
from scv_jax.sharding.mesh import REQUESTS, active_mesh, per_shard


def _per_data_shard(fn: Callable[..., Any], *arrays: jax.Array) -> Any:
    """``fn(*arrays)``, per data shard on the active mesh (each array's leading axis split over "data":
    the head cache's pages, and the batch's rows, whose block ids are local to their shard's blocks)."""
    if active_mesh() is None:
        return fn(*arrays)
    return per_shard(fn, in_specs=(REQUESTS,) * len(arrays), out_specs=REQUESTS)(*arrays)


def read_rows(cache: HeadCache, block_tables: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(features [B, T, d_model], tokens int32[B, T]) stored at int32[B, T] ``positions`` (zeros where none)."""
    def read(features, tokens, block_tables, positions):
        slots = slots_from_block_table(block_tables, positions, tokens.shape[1])
        flat, found = jnp.maximum(slots, 0), slots >= 0
        rows = features.reshape(-1, features.shape[-1])[flat]
        return jnp.where(found[..., None], rows, 0).astype(rows.dtype), jnp.where(found, tokens.reshape(-1)[flat], 0)

    return _per_data_shard(read, cache.features, cache.tokens, block_tables, positions)


def _write(pages: jax.Array, block_tables: jax.Array, positions: jax.Array, mask: jax.Array,
           values: jax.Array) -> jax.Array:
    """``pages`` [num_blocks, block_size, ...] with ``values`` [B, T, ...] at int32[B, T] ``positions``
    where bool[B, T] ``mask`` and the position has a block."""
    slots = slots_from_block_table(block_tables, positions, pages.shape[1])
    total = pages.shape[0] * pages.shape[1]
    where = jnp.where(mask & (slots >= 0), slots, total).reshape(-1)        # total: dropped
    rows = pages.shape[2:]
    flat = pages.reshape(total, *rows).at[where].set(values.reshape(-1, *rows).astype(pages.dtype), mode="drop")
    return flat.reshape(pages.shape)


def write_rows(cache: HeadCache, block_tables: jax.Array, positions: jax.Array, mask: jax.Array, *,
               after: Any, features: jax.Array | None = None, tokens: jax.Array | None = None) -> HeadCache:
    """The cache with ``features`` [B, T, d_model] and/or ``tokens`` int32[B, T] stored at int32[B, T]
    ``positions`` where bool[B, T] ``mask`` (and the position has a block). ``after`` (computed from
    what the step read of the cache) orders the write after those reads, so the donated pages update in
    place (as ``device_step.commit_positions``)."""
    (pages, mask), _ = jax.lax.optimization_barrier((((cache.features, cache.tokens), mask), after))
    cache = cache._replace(features=pages[0], tokens=pages[1])
    if features is not None:
        cache = cache._replace(features=_per_data_shard(_write, cache.features, block_tables, positions, mask,
                                                        features))
    if tokens is not None:
        cache = cache._replace(tokens=_per_data_shard(_write, cache.tokens, block_tables, positions, mask, tokens))
    return cache


class CatchUp(NamedTuple):
    """A head step's catch-up over its missing rows.

    Attributes:
      out: the head's ``Eagle3Output`` over the rows [B, W] (request b's first ``lag[b]`` valid, at
        positions ``start + row``): its K/V, the step's staged entries, of every row; its logits [B, 1, V]
        and hidden [B, 1, d_model] of row lag - 1 alone (the first draft's).
      lag, start: int32[B]; valid: bool[B] the request has a feature to draft from (a real request past
        position 0).
      read: (features, tokens) the rows read of the head cache (later writes are ordered after them).
      head: the merged head (its ``combine`` maps the scored taps).
    """

    out: Any
    lag: jax.Array
    start: jax.Array
    valid: jax.Array
    read: tuple[jax.Array, jax.Array]
    head: Any


def catch_up(head, cache: HeadCache, block_tables: jax.Array, inputs, width: int, backend: str) -> CatchUp:
    """The head over its ``lag`` missing rows (at most ``width``): features and tokens read from its cache,
    the pending token last."""
    lag = jnp.clip(inputs.lag, 1, width)
    head_lens = inputs.context_lens - lag
    start = jnp.maximum(head_lens, 0)
    rows = jnp.arange(width, dtype=jnp.int32)[None, :]
    features, _ = read_rows(cache, block_tables, start[:, None] + rows)
    _, tokens = read_rows(cache, block_tables, start[:, None] + rows + 1)
    tokens = jnp.where(rows == (lag - 1)[:, None], inputs.pending[:, None], tokens)
    out = head.forward_paged(tokens, features, cache.kv, block_tables, start, out_rows=lag - 1, backend=backend)
    return CatchUp(out, lag, start, (head_lens >= 0) & inputs.request_mask, (features, tokens), head)


def commit(cache: HeadCache, ran: CatchUp, features: jax.Array, drafts: jax.Array, num_accepted: jax.Array,
           block_tables: jax.Array, inputs, *, block_size: int, backend: str, after: jax.Array) -> HeadCache:
    """The head cache after a step: the catch-up rows' K/V, the combined taps ``features`` [B, D + 1,
    d_model] of positions context + d for d <= num_accepted (the pending token's, then the accepted
    drafts'), and the accepted ``drafts`` int32[B, D] at positions context + 1 + d, d < num_accepted."""
    # (a request at lag 0, its rows all in the cache after its prefill, ran its last row for its hidden state only)
    kv = commit_positions(cache.kv, ran.out.keys, ran.out.values, block_tables, ran.start,
                          jnp.where(ran.valid & (inputs.lag > 0), ran.lag, 0), block_size, backend, after=after)
    t = jnp.arange(features.shape[1], dtype=jnp.int32)[None, :]
    positions = inputs.context_lens[:, None] + t
    accepted, live = num_accepted[:, None], inputs.request_mask[:, None]
    # after the catch-up's reads and what consumed them (at k = 0 nothing else orders the writes after them)
    read = (ran.read, ran.out.keys, ran.out.values)
    cache = write_rows(cache._replace(kv=kv), block_tables, positions, live & (t <= accepted), after=read,
                       features=features)
    return write_rows(cache, block_tables, positions[:, :-1] + 1, live & (t[:, :-1] < accepted), after=read,
                      tokens=drafts)


class HeadProposal(NamedTuple):
    """A head chain step's drafts (``ChainProposal``'s fields, so the chain acceptance takes it) and its
    ``CatchUp``."""

    tokens: jax.Array
    probs: jax.Array | None
    ran: CatchUp


@dataclasses.dataclass(frozen=True)
class HeadChainVerifier(ChainVerifier):
    """Chains of drafts from an EAGLE head (see the module docstring): ``aux_layers`` the target layers
    whose inputs the head reads; ``width`` the catch-up's rows, the most a request may lag (k_max + 1)."""

    aux_layers: tuple[int, ...] = ()
    width: int = 1
    every_step = True

    def stages(self, k: int) -> "HeadChainVerifier":
        return self

    def prefill_step(self, target: SplitModel, draft: SplitModel, block_size: int):
        return make_head_prefill_step(target, draft, block_size, self.aux_layers)

    def propose(self, head, drafts, cache: HeadCache, block_tables, inputs, sampling, *, k, greedy, backend
                ) -> HeadProposal:
        ran = catch_up(head, cache, block_tables, inputs, self.width, backend)
        if k == 0:
            return HeadProposal(jnp.zeros((ran.lag.shape[0], 0), jnp.int32), None, ran)

        def forward(token, staged, hidden):
            o = head.forward_paged(token[:, None], hidden[:, None], cache.kv, block_tables, ran.start, staged,
                                   backend=backend)
            return o.logits[:, 0], o.keys, o.values, o.hidden[:, 0]

        chain = draft_chain(ran.out, ran.out.logits[:, 0], ran.lag, forward, ran.out.hidden[:, 0], inputs.keys,
                            sampling, k=k, greedy=greedy, controls=inputs.controls)
        return HeadProposal(chain.tokens, chain.probs, ran)

    def score(self, target, target_cache, block_tables, inputs, proposal: HeadProposal, *, k, packed_k, backend
              ) -> ChainScored:
        scored = score_chain(target, target_cache, block_tables, inputs, proposal.tokens,
                             jnp.where(proposal.ran.valid, inputs.num_drafts, 0), k=k, packed_k=packed_k,
                             backend=backend, aux_layers=self.aux_layers)
        return scored._replace(output=scored.output._replace(taps=proposal.ran.head.combine(scored.output.taps)))

    def passed(self, proposal: HeadProposal) -> HeadProposal:
        """Arrays only (the catch-up without the head), the catch-up's K/V batch-major."""
        return proposal._replace(ran=proposal.ran._replace(out=swap_layers_and_batch(proposal.ran.out), head=None))

    def received(self, passed: HeadProposal, head) -> HeadProposal:
        return passed._replace(ran=passed.ran._replace(out=swap_layers_and_batch(passed.ran.out), head=head))

    def commit_draft(self, cache: HeadCache, proposal: HeadProposal, scored: ChainScored, result, block_tables,
                     inputs, *, block_size, backend) -> HeadCache:
        return commit(cache, proposal.ran, scored.grid(scored.output.taps), proposal.tokens, result.num_accepted,
                      block_tables, inputs, block_size=block_size, backend=backend, after=result.summary.packed)


class HeadTreeProposal(NamedTuple):
    """A head tree step's tree (``TreeProposal``'s node fields) and its ``CatchUp``."""

    tokens: jax.Array
    parents: jax.Array
    ran: CatchUp


@dataclasses.dataclass(frozen=True)
class HeadTreeVerifier(TreeVerifier):
    """EAGLE-2 dynamic trees from an EAGLE head (``tree_verifier.grow_tree``, each node's hidden input its
    parent's ``hidden_out``); ``aux_layers``, ``width`` as ``HeadChainVerifier``'s (width: max_depth + 1)."""

    aux_layers: tuple[int, ...] = ()
    width: int = 1
    every_step = True

    def stages(self, k: int) -> "HeadTreeVerifier | HeadChainVerifier":
        """k = 0 (no tree this step): the head's catch-up alone, as a chain step at k = 0 runs it."""
        return self if k else HeadChainVerifier(self.aux_layers, self.width)

    def prefill_step(self, target: SplitModel, draft: SplitModel, block_size: int):
        return make_head_prefill_step(target, draft, block_size, self.aux_layers)

    def propose(self, head, drafts, cache: HeadCache, block_tables, inputs, sampling, *, k, greedy, backend
                ) -> HeadTreeProposal:
        ran = catch_up(head, cache, block_tables, inputs, self.width, backend)
        staged = StagedKV(ran.out.keys, ran.out.values, ran.lag)

        def expand(tokens, parents, hidden):
            o = head.forward_paged(tokens, hidden, cache.kv, block_tables, ran.start, staged, tree_parents=parents,
                                   backend=backend)
            return o.logits, o.hidden, o

        tree = grow_tree(ran.out, ran.out.logits[:, 0], ran.lag, expand, ran.out.hidden[:, 0], tree=self.tree,
                         controls=inputs.controls)
        return HeadTreeProposal(tree.tokens, tree.parents, ran)

    def score(self, target, target_cache, block_tables, inputs, proposal: HeadTreeProposal, *, k, packed_k, backend
              ) -> TreeScored:
        cap = jnp.where(proposal.ran.valid, jnp.minimum(inputs.num_drafts, self.tree.max_depth), 0)
        scored = score_tree(target, target_cache, block_tables, inputs, proposal, cap, backend=backend,
                            aux_layers=self.aux_layers)
        return scored._replace(output=scored.output._replace(taps=proposal.ran.head.combine(scored.output.taps)))

    def commit_draft(self, cache: HeadCache, proposal: HeadTreeProposal, scored: TreeScored, result, block_tables,
                     inputs, *, block_size, backend) -> HeadCache:
        path = jnp.maximum(result.accepted_nodes, 0)                                   # [B, max_depth]
        rows = jnp.concatenate([jnp.zeros_like(path[:, :1]), path + 1], axis=1)       # pending, then the path
        features = jnp.take_along_axis(scored.output.taps, rows[:, :, None], axis=1)
        drafts = jnp.take_along_axis(proposal.tokens, path, axis=1)
        return commit(cache, proposal.ran, features, drafts, result.num_accepted, block_tables, inputs,
                      block_size=block_size, backend=backend, after=result.output_token_ids)


def make_head_prefill_step(target: SplitModel, head: SplitModel, block_size: int, aux_layers: tuple[int, ...]):
    """``prefill_step(...)`` (``device_step.make_prefill_step``'s signature) for a target drafted by an EAGLE
    head, whose ``tokens`` are int32[B, C + 1]: the chunk's C tokens and one more, the token after each
    request's ``count`` (the next chunk's first, or the pending one). The target commits positions
    [start, start + count) with their taps; the head commits its rows of the same positions (position p's
    feature with token p + 1, so after a prefill of every token but the pending one the head lags by
    none, as a cached block of its rows, hashed one token further, needs), and every position's feature
    is stored. With ``target_params`` None (the top-up of a finished request's last rows, prefix caching)
    the features are the ones stored in the head cache."""

    def prefill_step(target_params, draft_params, target_cache, draft_cache: HeadCache, block_tables, tokens, start,
                     count, request_mask=None, *, backend: str = "auto"):
        if request_mask is not None:
            count = jnp.where(request_mask, count, 0)
        model = head.merge(draft_params)
        t = jnp.arange(tokens.shape[1] - 1, dtype=jnp.int32)[None, :]
        if target_params is None:
            features, _ = read_rows(draft_cache, block_tables, start[:, None] + t)
        else:
            out = target.merge(target_params).forward_paged(tokens[:, :-1], target_cache, block_tables, start,
                                                            aux_layers=aux_layers, backend=backend)
            target_cache = commit_positions(target_cache, out.keys, out.values, block_tables, start, count,
                                            block_size, backend, after=out.logits)
            features = model.combine(out.taps)                                       # [B, C, d_model]
        # only the rows' K/V are kept: one row per request computes an output (orders the commit after the reads)
        o = model.forward_paged(tokens[:, 1:], features, draft_cache.kv, block_tables, start,
                                out_rows=jnp.zeros_like(start), backend=backend)
        head_cache = draft_cache._replace(kv=commit_positions(draft_cache.kv, o.keys, o.values, block_tables, start,
                                                              count, block_size, backend, after=o.hidden))
        if target_params is not None:
            head_cache = write_rows(head_cache, block_tables, start[:, None] + t, t < count[:, None], after=o.hidden,
                                    features=features)
        return target_cache, head_cache

    return prefill_step
