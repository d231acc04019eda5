"""scv-jax: the verification step of speculative decoding in JAX, with Pallas GPU kernels."""

from scv_jax.accept_result import AcceptResult
from scv_jax.acceptance import accept_greedy, rejection_sample
from scv_jax.backends import BACKENDS
from scv_jax.buckets import Buckets, Pad
from scv_jax.commit import check_slot_mapping, commit_draft_kv, gather_kv, slots_from_block_table
from scv_jax.controller import AdaptiveController, ControllerConfig
from scv_jax.graph_mode import BucketPlan, ExecutableCache, GraphModeStats, WarmupReport, enable_persistent_cache
from scv_jax.kv_cache import PagedKVCache
from scv_jax.validation import check_draft_batch
from scv_jax.verify import HostStepResult, VerifyStepOutput, fetch_step_output, start_fetch, verify_step, verify_step_cache
from scv_jax import models
from scv_jax.decoder import DecoderConfig, GenerateOutput, GenerateStats, SpeculativeDecoder, generate_autoregressive

__version__ = "0.1.0"
