"""Rotary position embeddings (rotate-half form, as in Hugging Face Llama/Qwen2/Qwen3/Mistral checkpoints)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from scv_jax.models.config import Llama3RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: Llama3RopeScaling | None = None) -> np.ndarray:
    """float32[head_dim // 2]: the rotation speed of each pair of channels (computed in float64)."""
    half = head_dim // 2
    inv_freq = float(theta) ** (-np.arange(half, dtype=np.float64) / half)
    if scaling is not None:
        inv_freq = _llama3_scaled(inv_freq, scaling)
    return inv_freq.astype(np.float32)


def _llama3_scaled(inv_freq: np.ndarray, s: Llama3RopeScaling) -> np.ndarray:
    """Llama 3.1's scaling: long wavelengths slowed by ``factor``, short kept, the band between blended."""
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    return np.where(wavelen > low_freq_wavelen, inv_freq / s.factor,
                    np.where(wavelen < high_freq_wavelen, inv_freq, blended))


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotates x: [B, T, heads, head_dim] by positions int32[B, T] (in float32; returns x's dtype)."""
    half = x.shape[-1] // 2
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)     # [B, T, half]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
