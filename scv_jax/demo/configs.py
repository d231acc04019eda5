"""Sizes of the demo pair: a byte-level target and a much cheaper draft (same vocabulary)."""

from scv_jax.models.config import TransformerConfig

TARGET_CONFIG = TransformerConfig(vocab_size=256, num_layers=6, d_model=384, num_heads=6, num_kv_heads=2,
                                  head_dim=64, ffn_dim=896)
DRAFT_CONFIG = TransformerConfig(vocab_size=256, num_layers=1, d_model=128, num_heads=2, num_kv_heads=1,
                                 head_dim=64, ffn_dim=384)
