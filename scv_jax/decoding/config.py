"""``DecoderConfig``: the settings of ``SpeculativeDecoder``, checked on construction."""

from __future__ import annotations

import dataclasses

from scv_jax.adaptive.controller import ControllerConfig
from scv_jax.graph.buckets import Buckets


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Settings of ``SpeculativeDecoder``.

    Attributes:
      k: drafts per step when not adaptive (0 = no speculation).
      adaptive: choose k per step with ``AdaptiveController`` (goodput mode) from ``k_values``.
      k_values: the k an adaptive decoder may pick (one executable each).
      controller: optional ``ControllerConfig`` overriding the adaptive defaults.
      block_size, num_blocks: the paged caches' geometry (shared by target and draft).
      max_seq_len: most positions per request (prompt + generated + k); sets the block-table width.
      cache_dtype: dtype of both caches (see ``PagedKVCache``).
      prefill_chunk: prompt tokens per prefill call.
      batch_buckets: batch sizes steps are padded to (graph mode).
      context_buckets: block-table widths (in blocks) steps are padded to; None: multiples of 16
        blocks up to max_seq_len (fewer executables; attention masks the padding).
      backend: "auto", "pallas", "xla" or "interpret" for acceptance and commit.
    """

    k: int = 4
    adaptive: bool = False
    k_values: tuple[int, ...] = (0, 2, 4, 6, 8)
    controller: ControllerConfig | None = None
    block_size: int = 16
    num_blocks: int = 512
    max_seq_len: int = 1024
    cache_dtype: str = "float32"
    prefill_chunk: int = 64
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    context_buckets: tuple[int, ...] | None = None
    backend: str = "auto"

    def __post_init__(self):
        if not isinstance(self.k, int) or self.k < 0:
            raise ValueError(f"DecoderConfig.k must be an int >= 0, got {self.k!r}")
        if self.adaptive and (not self.k_values or min(self.k_values) < 0):
            raise ValueError(f"DecoderConfig.k_values must be non-empty ints >= 0, got {self.k_values!r}")
        for name in ("block_size", "num_blocks", "max_seq_len", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"DecoderConfig.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def allowed_k(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.k_values))) if self.adaptive else (self.k,)

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_seq_len // self.block_size)

    def block_buckets(self) -> Buckets:
        if self.context_buckets is not None:
            return Buckets(tuple(sorted(set(self.context_buckets) | {self.max_blocks_per_seq})))
        most = self.max_blocks_per_seq
        return Buckets.pow2_then_linear(most, linear_step=16, min_size=min(16, most))
