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
class YarnRopeScaling:
    """YaRN's RoPE scaling (Hugging Face ``rope_scaling`` with ``rope_type`` or ``type`` "yarn": gpt-oss,
    Qwen2.5 / Qwen3 long-context configs), as transformers computes it.

    Frequencies rotating fewer than ``beta_slow`` times over ``original_max_position_embeddings``
    positions are divided by ``factor`` (interpolated), those rotating more than ``beta_fast`` times
    are kept, with a linear ramp between the two channel indices (rounded outward when ``truncate``).
    ``attention_factor`` multiplies the rotated queries and keys (so the scores by its square); None:
    ``0.1 * ln(factor) + 1`` (or, with ``mscale`` and ``mscale_all_dim``, the ratio of that form for
    the two).
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None

    def __post_init__(self):
        for name in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"YarnRopeScaling.{name} must be a number > 0, got {value!r}")
        for name in ("attention_factor", "mscale", "mscale_all_dim"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
                raise ValueError(f"YarnRopeScaling.{name} must be None or a number >= 0, got {value!r}")
        if not isinstance(self.truncate, bool):
            raise ValueError(f"YarnRopeScaling.truncate must be a bool, got {self.truncate!r}")
        if self.beta_fast < self.beta_slow:
            raise ValueError(f"YarnRopeScaling: beta_fast ({self.beta_fast}) must be at least beta_slow "
                             f"({self.beta_slow})")


RopeScaling = Llama3RopeScaling | YarnRopeScaling
ROPE_SCALINGS = {"llama3": Llama3RopeScaling, "yarn": YarnRopeScaling}


def rope_scaling_type(scaling: RopeScaling) -> str:
    """The Hugging Face ``rope_type`` of ``scaling`` ("llama3" or "yarn")."""
    return next(name for name, cls in ROPE_SCALINGS.items() if isinstance(scaling, cls))


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """A Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU).

    ``num_heads`` query heads share ``num_kv_heads`` K/V heads (``num_heads % num_kv_heads == 0``).
    ``dtype`` ("float32", "bfloat16" or "float16"; any spelling ``jnp.dtype`` accepts) is the dtype of
    the parameters and activations; norms, the attention softmax and the logits are float32 whatever
    it is. ``qkv_bias``: biases on the q/k/v projections (Qwen2). ``qk_norm``: an RMSNorm over each
    query and key head (a ``head_dim`` scale shared by the heads, ``norm_eps``) before RoPE (Qwen3).
    ``rope_scaling``: None, ``Llama3RopeScaling`` or ``YarnRopeScaling``. ``sliding_window``: None (full
    causal attention) or W, a query at position i sees keys at positions i - W < j <= i (Mistral);
    ``sliding_layers``: None (every layer, when ``sliding_window`` is set) or a tuple of ``num_layers``
    bools, the layers that attend within the window (gpt-oss alternates; Qwen2's ``use_sliding_window``
    windows the layers from ``max_window_layers`` on), the others attending to every earlier
    position. ``attention_sinks``: each query head has a learned logit (``attn/sinks`` [heads],
    float32) that joins every query's softmax as one more key with a zero value (gpt-oss).
    ``attention_out_bias``: a bias on the output projection too (gpt-oss). ``tie_embeddings``:
    the LM head is the embedding matrix. ``max_position_embeddings``: None or the most positions
    (prompt + generated) the model was trained for (Hugging Face's field of that name); ``generate``
    refuses longer requests.

    Mixture of experts (Qwen3-MoE, Mixtral; ``scv_jax.models.moe``): ``num_experts`` 0 (default) is
    the dense SwiGLU of ``ffn_dim`` units; E >= 1 replaces it in every layer by E SwiGLU experts of
    ``moe_ffn_dim`` units (None: ``ffn_dim``), of which each token uses ``num_experts_per_tok`` (k,
    1 <= k <= E) chosen by a softmax router; ``norm_topk_prob``: the k weights are renormalised to
    sum to 1 (Mixtral always; Qwen3-MoE's field of that name). ``moe_bias``: the router and every
    expert projection have biases (gpt-oss). ``swiglu_limit``: None (SwiGLU, ``silu(gate) * up``) or
    L, gpt-oss's clamped form, ``g * sigmoid(1.702 g) * (u + 1)`` with g = min(gate, L) and u = up
    clipped to [-L, L] (the experts only).
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
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] | None = None
    attention_sinks: bool = False
    attention_out_bias: bool = False
    max_position_embeddings: int | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_ffn_dim: int | None = None
    norm_topk_prob: bool = True
    moe_bias: bool = False
    swiglu_limit: float | None = None

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
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, tuple(ROPE_SCALINGS.values())):
            raise ValueError(f"TransformerConfig.rope_scaling must be None, a Llama3RopeScaling or a YarnRopeScaling, "
                             f"got {self.rope_scaling!r}")
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
        if isinstance(self.sliding_layers, list):        # as to_dict writes it
            object.__setattr__(self, "sliding_layers", tuple(self.sliding_layers))
        if self.sliding_layers is not None:
            layers = self.sliding_layers
            if not (isinstance(layers, tuple) and len(layers) == self.num_layers
                    and all(isinstance(b, bool) for b in layers)):
                raise ValueError(f"TransformerConfig.sliding_layers must be None or a tuple of num_layers "
                                 f"({self.num_layers}) bools, got {layers!r}")
            if self.sliding_window is None:
                raise ValueError("TransformerConfig.sliding_layers needs sliding_window")
        for name in ("norm_topk_prob", "attention_sinks", "attention_out_bias", "moe_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"TransformerConfig.{name} must be a bool, got {getattr(self, name)!r}")
        limit = self.swiglu_limit
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0):
            raise ValueError(f"TransformerConfig.swiglu_limit must be None or a number > 0, got {limit!r}")

    @property
    def jnp_dtype(self) -> jnp.dtype:
        """The parameter and activation dtype as a ``jnp.dtype``."""
        return jnp.dtype(self.dtype)

    @property
    def expert_ffn_dim(self) -> int:
        """Each expert's SwiGLU width: ``moe_ffn_dim``, or ``ffn_dim`` when that is None."""
        return self.ffn_dim if self.moe_ffn_dim is None else self.moe_ffn_dim

    def layer_window(self, layer: int) -> int | None:
        """The sliding window layer ``layer`` attends within (None: every earlier position)."""
        if self.sliding_layers is not None and not self.sliding_layers[layer]:
            return None
        return self.sliding_window

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """``layer_window(i)`` of every layer."""
        return tuple(self.layer_window(i) for i in range(self.num_layers))

    def to_dict(self) -> dict:
        """A JSON-serialisable dict; ``TransformerConfig.from_dict`` reads it back (``rope_scaling``
        carries its ``rope_type``)."""
        fields = dataclasses.asdict(self)
        if self.rope_scaling is not None:
            fields["rope_scaling"] = {"rope_type": rope_scaling_type(self.rope_scaling), **fields["rope_scaling"]}
        if self.sliding_layers is not None:
            fields["sliding_layers"] = list(self.sliding_layers)
        return fields

    @classmethod
    def from_dict(cls, fields: dict) -> "TransformerConfig":
        """The config ``to_dict`` wrote (missing fields take their defaults)."""
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"TransformerConfig.from_dict: unknown fields {unknown}")
        fields = dict(fields)
        scaling = fields.get("rope_scaling")
        if scaling is not None:       # written before YaRN: no rope_type, llama3
            scaling = dict(scaling)
            kind = scaling.pop("rope_type", "llama3")
            if kind not in ROPE_SCALINGS:
                raise ValueError(f"TransformerConfig.from_dict: rope_scaling's rope_type {kind!r} is not one of "
                                 f"{sorted(ROPE_SCALINGS)}")
            fields["rope_scaling"] = ROPE_SCALINGS[kind](**scaling)
        return cls(**fields)
