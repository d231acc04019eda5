"""scv-jax: the verification step of speculative decoding in JAX, with Pallas GPU kernels."""

from scv_jax.accept_result import AcceptResult
from scv_jax.acceptance import accept_greedy, rejection_sample
from scv_jax.backends import BACKENDS
from scv_jax.validation import check_draft_batch

__version__ = "0.1.0"
