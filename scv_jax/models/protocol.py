"""The model interface the speculative decoder needs (target and draft alike)."""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

import jax


class StagedKV(NamedTuple):
    """K/V of in-flight tokens that are not committed to the paged cache.

    Attributes:
      keys, values: [layers, B, S, kv_heads, head_dim]; entry s of request b is the token at
        position ``context_lens[b] + s``.
      lengths: int32[B]; entries s < lengths[b] are valid.
    """

    keys: jax.Array
    values: jax.Array
    lengths: jax.Array


class PackedTokens(NamedTuple):
    """Where the N tokens of a packed forward (``forward_packed``) sit in their batch.

    Attributes:
      rows: int32[N] each token's request (a row of ``block_tables``).
      offsets: int32[N] its place among its request's tokens of the call: the token is at position
        ``context_lens[rows[i]] + offsets[i]`` and attends to its request's earlier tokens of the
        call. A request's tokens have offsets 0, 1, ..., in any order of i; offsets outside
        [0, width) mark padding tokens (their outputs are junk and reach no other token).
      width: the most tokens of any request (static).
    """

    rows: jax.Array
    offsets: jax.Array
    width: int


class PagedForwardOutput(NamedTuple):
    """What one paged forward returns.

    Attributes:
      logits: float32[B, T, vocab_size] (``forward_packed``: float32[N, vocab_size]).
      keys, values: the new tokens' K/V, [layers, B, T, kv_heads, head_dim] (``forward_packed``:
        [layers, N, kv_heads, head_dim]), to stage, then commit.
      taps: None unless the call passed ``aux_layers`` (i, j, ...): the inputs of layers i, j, ...
        (the residual stream entering each; 0: the embeddings) concatenated, in the model dtype,
        [B, T, len(aux_layers) * d_model] (``forward_packed``: [N, len(aux_layers) * d_model]),
        what an EAGLE-3 head reads.
    """

    logits: jax.Array
    keys: jax.Array
    values: jax.Array
    taps: jax.Array | None = None


@runtime_checkable
class PagedModel(Protocol):
    """A decoder-only LM the decoder can drive (an ``nnx.Module``; the decoder splits it once).

    ``config`` must expose ``vocab_size``, ``num_layers``, ``num_kv_heads`` and ``head_dim``
    (the paged caches are sized from them). A target that also has ``forward_packed`` (as
    ``scv_jax.models.Transformer`` does) can be verified with packed tokens
    (``DecoderConfig.packed_verify``): each request scores only its own drafts. A target for EAGLE-3
    heads also takes ``aux_layers: tuple[int, ...] | None = None`` (keyword) in ``forward_paged``
    and ``forward_packed`` and returns the taps of every token it scores in ``PagedForwardOutput.taps``
    (None when not asked; ``Transformer`` does); a model without it is still a ``PagedModel``.
    """

    config: object

    def forward_paged(self, tokens: jax.Array, cache, block_tables: jax.Array, context_lens: jax.Array,
                      staged: StagedKV | None = None, *, tree_parents: jax.Array | None = None,
                      backend: str = "auto") -> PagedForwardOutput:
        """Run ``tokens`` int32[B, T] at positions ``context_lens + staged.lengths + t``.

        Attention reads the committed K/V (positions < ``context_lens[b]``) from ``cache`` through
        ``block_tables`` int32[B, max_blocks], then ``staged`` entries, then the new tokens causally
        (``scv_jax.paged_attention`` does exactly that). Must not write ``cache``: the decoder commits
        the accepted K/V. ``backend`` ("auto", "pallas", "xla", "interpret") is the decoder's
        ``DecoderConfig.backend``, for the model's own ops (e.g. its attention). ``tree_parents``
        int32[B, T] (only a tree decoder passes it; ``DecoderConfig.tree``): the new tokens form a tree,
        t's parent new token (-1 = none): each attends to its ancestors and itself among them, at
        position ``context_lens + staged.lengths + depth`` (``paged_attention(new_token_parents=...)``).
        """
        ...
