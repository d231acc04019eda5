"""An EAGLE head's device half: chains drafted from the target's own features (``HeadChainVerifier``)
and the prefill that feeds the head the prompt's (``make_head_prefill_step``).

A head row at position p pairs the target's feature of position p (its taps at ``head.aux_layers``,
combined by ``head.combine``) with the token at position p + 1, and predicts the token at p + 2. The
head's cache (``caches.HeadCache``) holds the K/V of rows [0, context - lag) (context: the target's
cache length, the pending token's position; lag >= 1) and, for every verified position, its feature
and accepted draft. Each step, k = 0 included:

1. ``propose``: the head's catch-up over its ``lag`` missing rows (features and tokens read from its
   cache, the pending token last), then k - 1 one-row forwards, each feeding the head its own
   ``hidden_out`` and its last draft (``verifiers.draft_chain``). A request at position 0 (a one-token
   prompt: no feature yet) proposes nothing that step.
2. ``score``: the chain verifier's dense target forward, asking for the taps of every scored token.
3. ``accept``: the chain verifier's.
4. ``commit_draft``: the catch-up rows' K/V (rows from the head's own hidden states are never
   committed: the next catch-up recomputes accepted ones from the target's features, as EAGLE does),
   the features of the pending token and the accepted drafts, and the accepted drafts' tokens. The new
   lag is the emitted count, ``num_accepted + 1`` (``proposers.draft_model.HeadChain``).

Nothing of a rejected draft reaches any cache.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from scv_jax.decoding.caches import HeadCache
from scv_jax.decoding.device_step import SplitModel, commit_positions
from scv_jax.decoding.verifiers import ChainScored, ChainVerifier, draft_chain, drafts_before_stop, score
from scv_jax.models.protocol import StagedKV
from scv_jax.ops.commit.api import slots_from_block_table


def _slots(cache: HeadCache, block_tables: jax.Array, positions: jax.Array) -> jax.Array:
    """int32[B, T] flat slots of ``positions`` in the head cache's feature and token pages (-1: none)."""
    return slots_from_block_table(block_tables, positions, cache.tokens.shape[1])


def read_rows(cache: HeadCache, block_tables: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(features [B, T, d_model], tokens int32[B, T]) stored at int32[B, T] ``positions`` (zeros where none)."""
    slots = _slots(cache, block_tables, positions)
    flat = jnp.maximum(slots, 0)
    features = cache.features.reshape(-1, cache.features.shape[-1])[flat]
    tokens = cache.tokens.reshape(-1)[flat]
    return jnp.where((slots >= 0)[..., None], features, 0).astype(features.dtype), jnp.where(slots >= 0, tokens, 0)


def write_rows(cache: HeadCache, block_tables: jax.Array, positions: jax.Array, mask: jax.Array, *,
               after: jax.Array, features: jax.Array | None = None, tokens: jax.Array | None = None) -> HeadCache:
    """The cache with ``features`` [B, T, d_model] and/or ``tokens`` int32[B, T] stored at int32[B, T]
    ``positions`` where bool[B, T] ``mask`` (and the position has a block). ``after`` (computed from
    what the step read of the cache) orders the write after those reads, so the donated pages update in
    place (as ``device_step.commit_positions``)."""
    mask, _ = jax.lax.optimization_barrier((mask, after))
    slots = _slots(cache, block_tables, positions)
    total = cache.tokens.size
    where = jnp.where(mask & (slots >= 0), slots, total).reshape(-1)        # total: dropped
    if features is not None:
        flat = cache.features.reshape(total, -1).at[where].set(
            features.reshape(-1, features.shape[-1]).astype(cache.features.dtype), mode="drop")
        cache = cache._replace(features=flat.reshape(cache.features.shape))
    if tokens is not None:
        flat = cache.tokens.reshape(-1).at[where].set(tokens.reshape(-1).astype(jnp.int32), mode="drop")
        cache = cache._replace(tokens=flat.reshape(cache.tokens.shape))
    return cache


class HeadProposal(NamedTuple):
    """A head step's drafts (``ChainProposal``'s fields, so the chain acceptance takes it), whether each
    request could draft (``valid`` bool[B]: it has a feature), what the catch-up read of the head cache
    (``read``: its rows' features and tokens) and the merged head (its ``combine`` maps the scored taps)."""

    tokens: jax.Array
    probs: jax.Array | None
    staged: StagedKV
    valid: jax.Array
    read: tuple[jax.Array, jax.Array]
    head: Any


@dataclasses.dataclass(frozen=True)
class HeadChainVerifier(ChainVerifier):
    """Chains of drafts from an EAGLE head (see the module docstring): ``aux_layers`` the target layers
    whose inputs the head reads; ``width`` the catch-up's rows, the most a request may lag (k_max + 1)."""

    aux_layers: tuple[int, ...] = ()
    width: int = 1
    every_step = True

    def check(self, *, k: int, logprobs: bool, packed_k: int) -> None:
        super().check(k=k, logprobs=logprobs, packed_k=packed_k)
        if packed_k:
            raise ValueError(f"decode_step: an EAGLE head's steps verify dense chains (packed_k 0), got {packed_k}")

    def propose(self, head, drafts, cache: HeadCache, block_tables, inputs, sampling, *, k, greedy, backend
                ) -> HeadProposal:
        lag = jnp.clip(inputs.lag, 1, self.width)
        head_lens = inputs.context_lens - lag
        valid = (head_lens >= 0) & inputs.request_mask
        start = jnp.maximum(head_lens, 0)
        rows = jnp.arange(self.width, dtype=jnp.int32)[None, :]
        features, _ = read_rows(cache, block_tables, start[:, None] + rows)
        _, tokens = read_rows(cache, block_tables, start[:, None] + rows + 1)
        tokens = jnp.where(rows == (lag - 1)[:, None], inputs.pending[:, None], tokens)
        out = head.forward_paged(tokens, features, cache.kv, block_tables, start, backend=backend)
        if k == 0:
            return HeadProposal(jnp.zeros((lag.shape[0], 0), jnp.int32), None, StagedKV(out.keys, out.values, lag),
                                valid, (features, tokens), head)

        def forward(token, staged, hidden):
            o = head.forward_paged(token[:, None], hidden[:, None], cache.kv, block_tables, start, staged,
                                   backend=backend)
            return o.logits[:, 0], o.keys, o.values, o.hidden[:, 0]

        hidden = jnp.take_along_axis(out.hidden, (lag - 1)[:, None, None], axis=1)[:, 0]
        chain = draft_chain(out, lag, forward, hidden, inputs.keys, sampling, k=k, greedy=greedy,
                            controls=inputs.controls)
        return HeadProposal(chain.tokens, chain.probs, chain.staged, valid, (features, tokens), head)

    def score(self, target, target_cache, block_tables, inputs, proposal: HeadProposal, *, k, packed_k, backend
              ) -> ChainScored:
        num_drafts = jnp.where(proposal.valid, inputs.num_drafts, 0)
        if k:
            num_drafts = drafts_before_stop(proposal.tokens, num_drafts, inputs.stop_ids)
        out = score(target, target_cache, block_tables, inputs.pending, proposal.tokens, inputs.context_lens,
                    backend=backend, aux_layers=self.aux_layers)
        return ChainScored(out._replace(taps=proposal.head.combine(out.taps)), num_drafts, None)

    def prefill_step(self, target: SplitModel, draft: SplitModel, block_size: int):
        return make_head_prefill_step(target, draft, block_size, self.aux_layers)

    def commit_draft(self, cache: HeadCache, proposal: HeadProposal, scored: ChainScored, result, block_tables,
                     inputs, *, block_size, backend) -> HeadCache:
        lag = jnp.clip(inputs.lag, 1, self.width)
        start = jnp.maximum(inputs.context_lens - lag, 0)
        staged = proposal.staged
        kv = commit_positions(cache.kv, staged.keys[:, :, :self.width], staged.values[:, :, :self.width],
                              block_tables, start, jnp.where(proposal.valid, lag, 0), block_size, backend,
                              after=result.summary.packed)
        # the pending token's and the accepted drafts' features; the accepted drafts' tokens
        t = jnp.arange(scored.output.taps.shape[1], dtype=jnp.int32)[None, :]
        positions = inputs.context_lens[:, None] + t
        accepted = result.num_accepted[:, None]
        live = inputs.request_mask[:, None]
        cache = write_rows(cache._replace(kv=kv), block_tables, positions, live & (t <= accepted),
                           after=proposal.read[0], features=scored.output.taps)
        return write_rows(cache, block_tables, positions[:, :-1] + 1, live & (t[:, :-1] < accepted),
                          after=proposal.read[1], tokens=proposal.tokens)


def make_head_prefill_step(target: SplitModel, head: SplitModel, block_size: int, aux_layers: tuple[int, ...]):
    """``prefill_step(...)`` (``device_step.make_prefill_step``'s signature) for a target drafted by an EAGLE
    head: the target's chunk commits with its taps; the head's rows of the chunk (position p's feature
    with token p + 1; the chunk's first row takes the feature of the position before it from the head
    cache) commit up to the chunk's second-to-last token (its last row's token is the next chunk's first
    or the pending one), and every position's feature is stored."""

    def prefill_step(target_params, draft_params, target_cache, draft_cache: HeadCache, block_tables, tokens, start,
                     count, request_mask=None, *, backend: str = "auto"):
        if request_mask is not None:
            count = jnp.where(request_mask, count, 0)
        out = target.merge(target_params).forward_paged(tokens, target_cache, block_tables, start,
                                                        aux_layers=aux_layers, backend=backend)
        target_cache = commit_positions(target_cache, out.keys, out.values, block_tables, start, count, block_size,
                                        backend, after=out.logits)
        model, head_cache = head.merge(draft_params), draft_cache
        features = model.combine(out.taps)                                           # [B, C, d_model]
        before, _ = read_rows(head_cache, block_tables, (start - 1)[:, None])
        shift = (start == 0).astype(jnp.int32)        # a first chunk has no row before its first token
        rows = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :] + shift[:, None]
        hidden = jnp.take_along_axis(jnp.concatenate([before.astype(features.dtype), features], axis=1),
                                     rows[:, :, None], axis=1)
        head_tokens = jnp.take_along_axis(jnp.pad(tokens, ((0, 0), (0, 1))), rows, axis=1)
        head_start = start - 1 + shift
        o = model.forward_paged(head_tokens, hidden, head_cache.kv, block_tables, head_start, backend=backend)
        kv = commit_positions(head_cache.kv, o.keys, o.values, block_tables, head_start,
                              jnp.maximum(count - shift, 0), block_size, backend, after=o.hidden)
        t = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
        head_cache = write_rows(head_cache._replace(kv=kv), block_tables, start[:, None] + t, t < count[:, None],
                                after=o.hidden, features=features)
        return target_cache, head_cache

    return prefill_step
