"""Settings of the Llama-style decoder-only transformer: sizes, dtype and attention variants."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from scv_jax.arguments import is_int

DTYPES = ("float32", "bfloat16", "float16")


def canonical_dtype(dtype, argument: str) -> str:
    """The name in ``DTYPES`` of ``dtype`` (any spelling ``jnp.dtype`` accepts); ValueError naming
    ``argument`` otherwise."""
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        name = None
    if name not in DTYPES:
        raise ValueError(f"{argument} must be one of {DTYPES}, got {dtype!r}")
    return name


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's RoPE frequency scaling (Hugging Face ``rope_scaling`` with ``rope_type: "llama3"``).

    Frequencies whose wavelength exceeds ``original_max_position_embeddings / low_freq_factor`` are
    divided by ``factor``, those below ``original_max_position_embeddings / high_freq_factor`` are
    kept, and the band in between is interpolated.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"Llama3RopeScaling.{name} must be a number > 0, got {value!r}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"Llama3RopeScaling: high_freq_factor ({self.high_freq_factor}) must exceed "
                             f"low_freq_factor ({self.low_freq_factor})")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """A Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU).

    ``num_heads`` query heads share ``num_kv_heads`` K/V heads (``num_heads % num_kv_heads == 0``).
    ``dtype`` ("float32", "bfloat16" or "float16"; any spelling ``jnp.dtype`` accepts) is the dtype of
    the parameters and activations; norms, the attention softmax and the logits are float32 whatever
    it is. ``qkv_bias``: biases on the q/k/v projections (Qwen2). ``qk_norm``: an RMSNorm over each
    query and key head (a ``head_dim`` scale shared by the heads, ``norm_eps``) before RoPE (Qwen3).
    ``rope_scaling``: None or ``Llama3RopeScaling``. ``sliding_window``: None (full causal attention)
    or W, a query at position i sees keys at positions i - W < j <= i (Mistral). ``tie_embeddings``:
    the LM head is the embedding matrix. ``max_position_embeddings``: None or the most positions
    (prompt + generated) the model was trained for (Hugging Face's field of that name); ``generate``
    refuses longer requests.

    Mixture of experts (Qwen3-MoE, Mixtral; ``scv_jax.models.moe``): ``num_experts`` 0 (default) is
    the dense SwiGLU of ``ffn_dim`` units; E >= 1 replaces it in every layer by E SwiGLU experts of
    ``moe_ffn_dim`` units (None: ``ffn_dim``), of which each token uses ``num_experts_per_tok`` (k,
    1 <= k <= E) chosen by a softmax router; ``norm_topk_prob``: the k weights are renormalised to
    sum to 1 (Mixtral always; Qwen3-MoE's field of that name).
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
    dtype: str = "float32"
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling: Llama3RopeScaling | None = None
    sliding_window: int | None = None
    max_position_embeddings: int | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_ffn_dim: int | None = None
    norm_topk_prob: bool = True

    def __post_init__(self):
        for name in ("vocab_size", "num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim",
                     "ffn_dim"):
            if not is_int(getattr(self, name), 1):
                raise ValueError(f"TransformerConfig.{name} must be an int >= 1, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"TransformerConfig: num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"TransformerConfig.head_dim must be even for RoPE, got {self.head_dim}")
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype, "TransformerConfig.dtype"))
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, Llama3RopeScaling):
            raise ValueError(f"TransformerConfig.rope_scaling must be None or a Llama3RopeScaling, got "
                             f"{self.rope_scaling!r}")
        for name in ("sliding_window", "max_position_embeddings"):
            if getattr(self, name) is not None and not is_int(getattr(self, name), 1):
                raise ValueError(f"TransformerConfig.{name} must be None or an int >= 1, got {getattr(self, name)!r}")
        if not is_int(self.num_experts, 0):
            raise ValueError(f"TransformerConfig.num_experts must be an int >= 0, got {self.num_experts!r}")
        k = self.num_experts_per_tok
        if not is_int(k, 1) or (self.num_experts and k > self.num_experts):
            raise ValueError(f"TransformerConfig.num_experts_per_tok must be an int in [1, num_experts "
                             f"({self.num_experts})], got {k!r}")
        if self.moe_ffn_dim is not None and not is_int(self.moe_ffn_dim, 1):
            raise ValueError(f"TransformerConfig.moe_ffn_dim must be None or an int >= 1, got {self.moe_ffn_dim!r}")
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(f"TransformerConfig.norm_topk_prob must be a bool, got {self.norm_topk_prob!r}")

    @property
    def jnp_dtype(self) -> jnp.dtype:
        """The parameter and activation dtype as a ``jnp.dtype``."""
        return jnp.dtype(self.dtype)

    @property
    def expert_ffn_dim(self) -> int:
        """Each expert's SwiGLU width: ``moe_ffn_dim``, or ``ffn_dim`` when that is None."""
        return self.ffn_dim if self.moe_ffn_dim is None else self.moe_ffn_dim

    def to_dict(self) -> dict:
        """A JSON-serialisable dict; ``TransformerConfig.from_dict`` reads it back."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: dict) -> "TransformerConfig":
        """The config ``to_dict`` wrote (missing fields take their defaults)."""
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"TransformerConfig.from_dict: unknown fields {unknown}")
        scaling = fields.get("rope_scaling")
        return cls(**{**fields, "rope_scaling": None if scaling is None else Llama3RopeScaling(**scaling)})
