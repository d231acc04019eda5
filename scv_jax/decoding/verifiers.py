"""The verifiers of the decode step (``step_fn.make_decode_step``): what a step proposes and how it
verifies it. Both supply the same four stages (``Verifier``) over the step's ``StepInputs`` (B requests,
static k): ``chain_verifier.ChainVerifier`` (chains of drafts) and ``tree_verifier.TreeVerifier`` (token
trees); ``row_at`` serves both.

No cache receives a rejected token's K/V.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp

from scv_jax.decoding.device_step import SplitModel, StepInputs
from scv_jax.ops.commit.kv_cache import PagedKVCache
from scv_jax.verify.summary import StepSummary


class Verifier(Protocol):
    """The stages of a decode step (``step_fn.make_decode_step``); the models are merged ones, ``inputs``
    the step's ``StepInputs``, ``k`` > 0 (a k = 0 step is always ``ChainVerifier``'s)."""

    name: str
    every_step: bool      # its drafter runs in every step, k = 0 included (an EAGLE head: ``head_step``)

    def stages(self, k: int) -> "Verifier":
        """The verifier whose stages a step at ``k`` runs (k = 0: plain decoding's, the chain verifier's)."""

    def drafts_shape(self, k: int) -> tuple[int, ...]:
        """The shape of host drafts past the batch axis."""

    def check(self, *, k: int, logprobs: bool, packed_k: int) -> None:
        """Raises ValueError (one line naming the argument) for what the verifier does not support."""

    def propose(self, draft, drafts: jax.Array | None, draft_cache: PagedKVCache, block_tables: jax.Array,
                inputs: StepInputs, sampling: jax.Array, *, k: int, greedy: bool, backend: str) -> Any:
        """Stage 1: the step's proposal, from the draft model (``drafts`` None) or from host ``drafts``."""

    def score(self, target, target_cache: PagedKVCache, block_tables: jax.Array, inputs: StepInputs, proposal,
              *, k: int, packed_k: int, backend: str) -> Any:
        """Stage 2: the target's forward over the pending token and the proposal (``.output``)."""

    def accept(self, target_cache: PagedKVCache, scored, proposal, inputs: StepInputs, sampling: jax.Array,
               block_tables: jax.Array, *, block_size: int, greedy: bool, backend: str
               ) -> tuple[PagedKVCache, StepSummary, Any]:
        """Stage 3: the acceptance and the commit of the target's K/V: (target_cache, summary, result)."""

    def commit_draft(self, draft_cache: PagedKVCache, proposal, scored, result, block_tables: jax.Array,
                     inputs: StepInputs, *, block_size: int, backend: str) -> PagedKVCache:
        """Stage 4: the draft's K/V the step ran and kept (the cache as it is without a draft model)."""

    def passed(self, proposal) -> Any:
        """A split step's proposal as its first call returns it: arrays only, each with the batch on axis 0
        (chain verifiers only; ``step_fn``'s ``draft_only``)."""

    def received(self, passed, draft) -> Any:
        """``passed`` as the second call of a split step takes it (``draft``: the merged drafter)."""

    def prefill_step(self, target: SplitModel, draft: SplitModel | None, block_size: int):
        """The prefill step that fills what this verifier's steps read (``device_step.make_prefill_step``)."""


def row_at(values: jax.Array, rows: jax.Array) -> jax.Array:
    """[B, ...] request b's row ``rows[b]`` (int32[B]) of ``values`` [B, W, ...]."""
    return jnp.take_along_axis(values, rows.reshape(-1, *(1,) * (values.ndim - 1)), axis=1)[:, 0]
