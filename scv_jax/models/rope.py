"""Rotary position embeddings (rotate-half form, as in Hugging Face Llama/Qwen2/Qwen3/Mistral checkpoints)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from scv_jax.models.config import Llama3RopeScaling, RopeScaling, YarnRopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """float32[head_dim // 2]: the rotation speed of each pair of channels (computed in float64)."""
    half = head_dim // 2
    inv_freq = float(theta) ** (-np.arange(half, dtype=np.float64) / half)
    if isinstance(scaling, Llama3RopeScaling):
        inv_freq = _llama3_scaled(inv_freq, scaling)
    elif isinstance(scaling, YarnRopeScaling):
        inv_freq = _yarn_scaled(inv_freq, head_dim, float(theta), scaling)
    return inv_freq.astype(np.float32)


def attention_factor(scaling: RopeScaling | None) -> float:
    """What the rotated queries and keys are multiplied by: 1, or YaRN's attention factor."""
    if not isinstance(scaling, YarnRopeScaling):
        return 1.0
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)

    def mscale(m: float = 1.0) -> float:
        return 1.0 if scaling.factor <= 1 else 0.1 * m * math.log(scaling.factor) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return mscale(scaling.mscale) / mscale(scaling.mscale_all_dim)
    return mscale()


def _yarn_scaled(inv_freq: np.ndarray, head_dim: int, theta: float, s: YarnRopeScaling) -> np.ndarray:
    """YaRN: channels between the ``beta_fast`` and ``beta_slow`` rotation counts (over the original
    context) ramp from kept (fast) to divided by ``factor`` (slow)."""
    def channel(rotations: float) -> float:      # the channel pair index that rotates that many times
        return head_dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low, high = channel(s.beta_fast), channel(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(inv_freq.size, dtype=np.float64) - low) / (high - low), 0, 1)
    return inv_freq / s.factor * ramp + inv_freq * (1 - ramp)


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


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, scale: float = 1.0) -> jax.Array:
    """Rotates x: [B, T, heads, head_dim] by positions int32[B, T] and multiplies it by ``scale`` (YaRN's
    ``attention_factor``), in float32; returns x's dtype."""
    half = x.shape[-1] // 2
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)     # [B, T, half]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    if scale != 1.0:         # as transformers: cos and sin scaled (rounded to float32), then used
        cos, sin = cos * jnp.float32(scale), sin * jnp.float32(scale)
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
