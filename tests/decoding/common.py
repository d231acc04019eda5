"""Settings and prompts shared by the decoder tests."""

from __future__ import annotations

import numpy as np

from scv_jax import DecoderConfig
from tests.models.fixtures import TINY

# One bucket per dimension keeps the number of executables (and the test time) small.
SMALL = DecoderConfig(block_size=8, num_blocks=64, max_seq_len=64, prefill_chunk=16, batch_buckets=(4,),
                      context_buckets=(8,))
MAX_NEW = 14


def prompts(seed: int, batch: int, alphabet: int = TINY.vocab_size) -> list[list[int]]:
    """``batch`` random prompts of 1 to 19 tokens from the first ``alphabet`` token ids."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, alphabet, rng.integers(1, 20)).tolist() for _ in range(batch)]


def ran_packed_steps(decoder) -> bool:
    """Whether a ``SpeculativeDecoder`` or ``Engine`` compiled (so ran) a packed verify step (``packed_k`` > 0)."""
    executable = decoder.runner.decode_executable
    return any("packed_k=0" not in executable.describe(key) for key in executable.compiled_keys)
