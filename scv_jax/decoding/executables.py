"""The prefill and decode steps in graph mode: one ``ExecutableCache`` each, bucketed by batch size,
block-table width and (for decode steps) k, with both caches (and the decode step's logit-control
state and carry) donated, for the placement's devices
(decode steps are also compiled per ``packed_k``, the packed verify's mean drafts per request, and
per ``draft_only``: a split step's first call).
With ``backend="auto"`` a bucket whose kernels fail to compile or run is served by the XLA reference
(counted in ``GenerateStats.fallbacks``); with "pallas" or "interpret" the failure is raised."""

from __future__ import annotations

from scv_jax.decoding.carry import LagRule
from scv_jax.decoding.config import DecoderConfig
from scv_jax.decoding.device_step import SplitModel
from scv_jax.decoding.placement import SingleDevice
from scv_jax.decoding.step_fn import make_decode_step
from scv_jax.decoding.verifiers import Verifier
from scv_jax.graph.buckets import Buckets, Pad
from scv_jax.graph.executable_cache import ExecutableCache

_TABLE_PADS = (Pad("batch", axis=0, fill=-1), Pad("blocks", axis=1, fill=-1))
# While buckets compile in the background, a sampled step runs an all-greedy batch (its greedy rows take
# the argmax) and a step with logprobs one without (the caller drops them): a server listens once the
# sampled steps with logprobs are compiled.
_DECODE_STAND_INS = {"greedy": {True: False}, "logprobs": {False: True}}


def step_executables(config: DecoderConfig, target: SplitModel, draft: SplitModel | None, k_values: tuple[int, ...],
                     placement: SingleDevice, verifier: Verifier, lag_rule: LagRule, max_lag: int
                     ) -> tuple[ExecutableCache, ExecutableCache]:
    """(prefill, decode) ``ExecutableCache``s for a target (and optional draft) model; decode steps
    (verified by ``verifier``: ``chain_verifier.ChainVerifier`` or ``tree_verifier.TreeVerifier``) are compiled
    per k in ``k_values``; the placement (one device or a mesh) wraps the step functions and sets the batch
    buckets; ``lag_rule``, ``max_lag``: the proposer's, for the carry (``decoding.carry``)."""
    dims = {"batch": Buckets(placement.batch_buckets(config.batch_buckets)), "blocks": config.block_buckets()}
    common = dict(dims=dims, masks={"request_mask": "batch"},
                  fallback={"backend": "xla"} if config.backend == "auto" else None)
    prefill = ExecutableCache(
        placement.step(verifier.prefill_step(target, draft, config.block_size)),
        pads={"block_tables": _TABLE_PADS, "tokens": Pad("batch"), "start": Pad("batch"), "count": Pad("batch")},
        static_argnames=("backend",), name="prefill_step", donate_argnames=("target_cache", "draft_cache"),
        split_dims=placement.prefill_split_dims, **common)
    decode = ExecutableCache(
        placement.step(make_decode_step(target, draft, config.block_size, verifier, lag_rule, max_lag)),
        pads={"block_tables": _TABLE_PADS, "rows": Pad("batch"), "sampling": Pad("batch"), "drafts": Pad("batch"),
              "grammar": Pad("batch", fill=-1), "draft_states": Pad("batch", fill=-1), "proposal": Pad("batch")},
        bucketed_statics={"k": k_values},
        static_argnames=("greedy", "logprobs", "backend", "packed_k", "draft_only"),
        stand_ins=_DECODE_STAND_INS, name="decode_step", donate_argnames=("target_cache", "draft_cache", "controls", "carry"),
        **common)
    return prefill, decode
