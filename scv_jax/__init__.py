"""scv-jax: the verification step of speculative decoding in JAX, with Pallas GPU kernels.

Public names are loaded on first use (``scv_jax.accept_greedy`` imports the acceptance op, and
``scv_jax.SpeculativeDecoder`` Flax and the decoder), so ``import scv_jax`` itself is cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    # ops
    "BACKENDS": "scv_jax.ops.registry",
    "AcceptResult": "scv_jax.ops.acceptance.result",
    "accept_greedy": "scv_jax.ops.acceptance.api",
    "accept_greedy_from_logits": "scv_jax.ops.acceptance.api",
    "rejection_sample": "scv_jax.ops.acceptance.api",
    "check_draft_batch": "scv_jax.ops.acceptance.host_checks",
    "PagedKVCache": "scv_jax.ops.commit.kv_cache",
    "commit_draft_kv": "scv_jax.ops.commit.api",
    "gather_kv": "scv_jax.ops.commit.api",
    "slots_from_block_table": "scv_jax.ops.commit.api",
    "check_slot_mapping": "scv_jax.ops.commit.host_checks",
    "paged_attention": "scv_jax.ops.attention.api",
    "tree_depths": "scv_jax.ops.attention.api",
    "filtered_probs": "scv_jax.ops.sampling.api",
    "token_logprobs": "scv_jax.ops.sampling.api",
    "TokenLogprobs": "scv_jax.ops.sampling.api",
    "TreeAcceptResult": "scv_jax.ops.tree.result",
    "accept_tree_greedy": "scv_jax.ops.tree.api",
    "tree_rejection_sample": "scv_jax.ops.tree.api",
    "accepted_path_slots": "scv_jax.ops.tree.commit_path",
    # per-request sampling parameters (no jax)
    "SamplingParams": "scv_jax.sampling_params",
    "StructuredOutputsParams": "scv_jax.sampling_params",
    "SamplingArrays": "scv_jax.sampling_params",
    "batch_sampling_arrays": "scv_jax.sampling_params",
    # graph mode
    "Buckets": "scv_jax.graph.buckets",
    "Pad": "scv_jax.graph.buckets",
    "BucketPlan": "scv_jax.graph.bucket_plan",
    "ExecutableCache": "scv_jax.graph.executable_cache",
    "GraphModeStats": "scv_jax.graph.stats",
    "WarmupReport": "scv_jax.graph.stats",
    "enable_persistent_cache": "scv_jax.graph.persistent_cache",
    "CompileCounter": "scv_jax.graph.compile_counter",
    # the fused verify step
    "verify_step": "scv_jax.verify.step",
    "VerifyStepOutput": "scv_jax.verify.step",
    "verify_step_cache": "scv_jax.verify.graph_mode",
    "StepSummary": "scv_jax.verify.summary",
    "HostStepResult": "scv_jax.verify.summary",
    "fetch_step_output": "scv_jax.verify.summary",
    "start_fetch": "scv_jax.verify.summary",
    # adaptive k
    "AdaptiveController": "scv_jax.adaptive.controller",
    "ControllerConfig": "scv_jax.adaptive.controller",
    # decoding
    "DecoderConfig": "scv_jax.decoding.config",
    "TreeConfig": "scv_jax.decoding.tree_config",
    "GenerateStats": "scv_jax.decoding.stats",
    "GenerateOutput": "scv_jax.decoding.decoder",
    "SpeculativeDecoder": "scv_jax.decoding.decoder",
    "Engine": "scv_jax.decoding.engine",
    "RequestOutput": "scv_jax.decoding.outputs",
    "TokenLogprob": "scv_jax.decoding.outputs",
    "HostDrafter": "scv_jax.decoding.proposers.base",
    "NgramDrafter": "scv_jax.decoding.proposers.ngram",
    "SuffixDrafter": "scv_jax.decoding.proposers.suffix",
    "generate_autoregressive": "scv_jax.decoding.decoder",
    "ShardingConfig": "scv_jax.decoding.placement",
    # many devices
    "decoder_mesh": "scv_jax.sharding.mesh",
}
_SUBMODULES = ("models",)

__all__ = sorted(_EXPORTS) + list(_SUBMODULES)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module 'scv_jax' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
