"""Size settings of the Llama-style decoder-only transformer."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Sizes of a Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU).

    ``num_heads`` query heads share ``num_kv_heads`` K/V heads (``num_heads % num_kv_heads == 0``).
    """

    vocab_size: int = 256
    num_layers: int = 2
    d_model: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    ffn_dim: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True

    def __post_init__(self):
        for name in ("vocab_size", "num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim",
                     "ffn_dim"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"TransformerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"TransformerConfig: num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"TransformerConfig.head_dim must be even for RoPE, got {self.head_dim}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
