"""scv-jax: the verification step of speculative decoding in JAX, with Pallas GPU kernels."""

from scv_jax.ops.acceptance.result import AcceptResult
from scv_jax.ops.acceptance.api import accept_greedy, rejection_sample
from scv_jax.ops.registry import BACKENDS
from scv_jax.graph.buckets import Buckets, Pad
from scv_jax.ops.commit.api import check_slot_mapping, commit_draft_kv, gather_kv, slots_from_block_table
from scv_jax.adaptive.controller import AdaptiveController, ControllerConfig
from scv_jax.graph.executable_cache import BucketPlan, ExecutableCache, GraphModeStats, WarmupReport, enable_persistent_cache
from scv_jax.ops.commit.kv_cache import PagedKVCache
from scv_jax.checks import check_draft_batch
from scv_jax.verify.step import HostStepResult, VerifyStepOutput, fetch_step_output, start_fetch, verify_step, verify_step_cache
from scv_jax import models
from scv_jax.decoding.decoder import DecoderConfig, GenerateOutput, GenerateStats, SpeculativeDecoder, generate_autoregressive

__version__ = "0.1.0"
