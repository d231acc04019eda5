"""Loading Hugging Face checkpoints (Llama 2/3/3.1/3.2, Qwen2, Qwen3, Mistral, and the mixtures of
experts Qwen3-MoE, Mixtral and gpt-oss) from a local directory or the Hugging Face Hub
(``scv_jax.models.hub``).

    model = scv_jax.models.load_hf("/path/to/Llama-3.2-1B", dtype="bfloat16")
    model = scv_jax.models.load_hf("meta-llama/Llama-3.2-1B", revision="main")

The directory holds ``config.json`` and ``model.safetensors`` or a sharded
``model.safetensors.index.json``. Tensors are read one at a time (``safetensors``, memory-mapped),
cast to the model dtype and written into preallocated stacked arrays, so loading needs about the
model's size in memory. A config field or tensor the model cannot honour raises ``ValueError``
naming it: nothing is silently approximated.

Mixtures of experts (``Qwen3MoeForCausalLM``, ``MixtralForCausalLM``; ``scv_jax.models.moe``): the
router (Qwen3-MoE ``mlp.gate.weight``, Mixtral ``block_sparse_moe.gate.weight``, [E, hidden]) and
each expert's SwiGLU (Qwen3-MoE ``mlp.experts.{e}.{gate,up,down}_proj.weight``, Mixtral
``block_sparse_moe.experts.{e}.{w1,w3,w2}.weight``) are read, the experts of a layer stacked on a
leading [E] axis. Config fields read: ``num_experts`` (Qwen3-MoE) / ``num_local_experts``
(Mixtral), ``num_experts_per_tok``, the expert width ``moe_intermediate_size`` (Qwen3-MoE) /
``intermediate_size`` (Mixtral), ``norm_topk_prob`` (Qwen3-MoE, default false; Mixtral always
renormalises). Refused: Qwen3-MoE ``decoder_sparse_step`` other than 1 and a non-empty
``mlp_only_layers`` (dense layers among the MoE ones). Ignored, as they only matter in training:
``router_aux_loss_coef``, ``output_router_logits`` (the load-balancing loss) and Mixtral's
``router_jitter_noise`` (noise on the router input, applied by transformers in training mode only).
Qwen3-MoE's dense ``intermediate_size`` is kept as ``ffn_dim`` but unused (every layer is MoE).

gpt-oss (``GptOssForCausalLM``): q/k/v/o biases, a sink logit per head (``self_attn.sinks``), the
router's bias, every expert's projections in one tensor per layer (``mlp.experts.gate_up_proj``
[E, hidden, 2 * width], gate and up interleaved in its last axis, and ``down_proj`` [E, width,
hidden], stored [in, out], with ``*_bias``), the clamped SwiGLU (``swiglu_limit``, default 7), and
``layer_types`` alternating 128-token windows with full layers. Experts published in MXFP4
(``quantization_config`` ``quant_method: "mxfp4"``: ``*_blocks`` and ``*_scales`` tensors) are
dequantized on load (``scv_jax.models.mxfp4``) to ``dtype``: no kernel here reads MXFP4, and the
values are exact in bfloat16 (gpt-oss-20b then takes about 42 GB in bfloat16).

Sliding windows: Mistral and Mixtral window every layer (``sliding_window``); Qwen2 and Qwen3 with
``use_sliding_window`` window the layers ``layer_types`` names "sliding_attention" (derived as
transformers does when absent: the layers from ``max_window_layers`` on); Qwen3-MoE with
``use_sliding_window`` windows every layer (as transformers does); gpt-oss per ``layer_types``.
RoPE scaling: ``rope_scaling`` (or ``rope_parameters``) of type "llama3" or "yarn" (``type`` or
``rope_type``).
"""

from __future__ import annotations

import contextlib
import json
import pathlib
from typing import Any, Callable

import numpy as np

from scv_jax.arguments import is_int
from scv_jax.models.assemble import LAYER_PREFIX, assemble_transformer, parameter_shapes
from scv_jax.models.config import (Llama3RopeScaling, RopeScaling, TransformerConfig, YarnRopeScaling,
                                   canonical_dtype)
from scv_jax.models.hub import checkpoint_dir
from scv_jax.models.mxfp4 import BLOCK, dequantize_mxfp4
from scv_jax.models.transformer import Transformer

GPT_OSS = "GptOssForCausalLM"
ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                 "Qwen3MoeForCausalLM", "MixtralForCausalLM", GPT_OSS)
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", GPT_OSS)
SLIDING, FULL = "sliding_attention", "full_attention"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Our parameter name -> (Hugging Face tensor name, stored as [out, in] and so transposed). Layer
# tensors are named relative to "model.layers.{i}.".
_LAYER_TENSORS = {
    "attn_norm/scale": ("input_layernorm.weight", False),
    "mlp_norm/scale": ("post_attention_layernorm.weight", False),
    "attn/q/kernel": ("self_attn.q_proj.weight", True),
    "attn/k/kernel": ("self_attn.k_proj.weight", True),
    "attn/v/kernel": ("self_attn.v_proj.weight", True),
    "attn/q/bias": ("self_attn.q_proj.bias", False),
    "attn/k/bias": ("self_attn.k_proj.bias", False),
    "attn/v/bias": ("self_attn.v_proj.bias", False),
    "attn/o/kernel": ("self_attn.o_proj.weight", True),
    "attn/o/bias": ("self_attn.o_proj.bias", False),
    "attn/sinks": ("self_attn.sinks", False),
    "attn/q_norm/scale": ("self_attn.q_norm.weight", False),
    "attn/k_norm/scale": ("self_attn.k_norm.weight", False),
    "mlp/gate/kernel": ("mlp.gate_proj.weight", True),
    "mlp/up/kernel": ("mlp.up_proj.weight", True),
    "mlp/down/kernel": ("mlp.down_proj.weight", True),
}
# Mixture-of-experts layer tensors, per architecture: the router ([E, hidden], transposed to our
# [hidden, E]) and each expert's projections (our stacked "mlp/experts_*" [E, in, out] from E tensors
# "<experts>.{e}.<name>" stored [out, in]).
_MOE_TENSORS = {
    "Qwen3MoeForCausalLM": ("mlp.gate.weight", "mlp.experts",
                            {"experts_gate": "gate_proj", "experts_up": "up_proj", "experts_down": "down_proj"}),
    "MixtralForCausalLM": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts",
                           {"experts_gate": "w1", "experts_up": "w3", "experts_down": "w2"}),
    GPT_OSS: ("mlp.router.weight", "mlp.experts", {}),
}
# gpt-oss: one tensor per layer holds all experts, stored [E, in, out] (not transposed): our expert
# parameter -> (its tensor under "mlp.experts.", which interleaved half of the last axis: 0 = the even
# columns (gate), 1 = the odd (up), None = all). The weights may be MXFP4 ("<tensor>_blocks" and
# "<tensor>_scales", rows = the out axis, groups of 32 along the in axis).
_GPT_OSS_EXPERTS = {
    "experts_gate": ("gate_up_proj", 0), "experts_up": ("gate_up_proj", 1), "experts_down": ("down_proj", None),
    "experts_gate_bias": ("gate_up_proj_bias", 0), "experts_up_bias": ("gate_up_proj_bias", 1),
    "experts_down_bias": ("down_proj_bias", None),
}
_GLOBAL_TENSORS = {
    "embed/embedding": ("model.embed_tokens.weight", False),
    "final_norm/scale": ("model.norm.weight", False),
    "lm_head/kernel": ("lm_head.weight", True),
}


def hf_tensor_name(name: str, layer: int | None, architecture: str | None = None,
                   expert: int | None = None) -> tuple[str, bool]:
    """(Hugging Face tensor name, transposed?) of our parameter ``name`` (of ``layer``; of ``expert``
    for the stacked expert weights ``blocks/mlp/experts_*``, whose names ``architecture``, one of
    ``MOE_ARCHITECTURES``, decides, as it does the router's ``blocks/mlp/router/kernel``)."""
    if layer is None:
        return _GLOBAL_TENSORS[name]
    local = name[len(LAYER_PREFIX):]
    if local in _LAYER_TENSORS:
        hf_name, transposed = _LAYER_TENSORS[local]
        return f"model.layers.{layer}.{hf_name}", transposed
    router, experts, projections = _MOE_TENSORS[architecture]
    if local == "mlp/router/kernel":
        return f"model.layers.{layer}.{router}", True
    if local == "mlp/router/bias":
        return f"model.layers.{layer}.{router.removesuffix('weight')}bias", False
    return f"model.layers.{layer}.{experts}.{expert}.{projections[local[len('mlp/'):]]}.weight", True


def _is_expert(name: str) -> bool:
    """Whether parameter ``name`` is a stacked expert weight or bias ([layers, E, ...])."""
    return name.startswith(f"{LAYER_PREFIX}mlp/experts_")


def _gpt_oss_expert_tensors(config: TransformerConfig, layer: int, mxfp4: bool) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of one gpt-oss layer's expert tensors (MXFP4 blocks and scales for the
    weights when ``mxfp4``)."""
    e, d, f = config.num_experts, config.d_model, config.expert_ffn_dim
    prefix = f"model.layers.{layer}.mlp.experts."
    shapes = {"gate_up_proj_bias": (e, 2 * f), "down_proj_bias": (e, d)}
    for name, (rows, cols) in (("gate_up_proj", (2 * f, d)), ("down_proj", (d, f))):
        if mxfp4:
            shapes[f"{name}_blocks"] = (e, rows, cols // BLOCK, BLOCK // 2)
            shapes[f"{name}_scales"] = (e, rows, cols // BLOCK)
        else:
            shapes[name] = (e, cols, rows)
    return {prefix + name: shape for name, shape in shapes.items()}


def _read_gpt_oss_expert(name: str, layer: int, get: Callable[[str], np.ndarray], mxfp4: bool) -> np.ndarray:
    """Our stacked expert parameter ``name`` of ``layer`` ([E, in, out] or a bias [E, out]) from the
    gpt-oss tensors ``get(tensor name)`` returns (MXFP4 weights dequantized to float32)."""
    tensor, half = _GPT_OSS_EXPERTS[name[len(f"{LAYER_PREFIX}mlp/"):]]
    prefix = f"model.layers.{layer}.mlp.experts.{tensor}"
    if mxfp4 and not tensor.endswith("_bias"):    # [E, out, groups, 16]: pick the out rows, then transpose
        rows = slice(None) if half is None else slice(half, None, 2)
        blocks, scales = get(f"{prefix}_blocks")[:, rows], get(f"{prefix}_scales")[:, rows]
        return dequantize_mxfp4(blocks, scales).transpose(0, 2, 1)
    value = get(prefix)
    return value if half is None else value[..., half::2]


# ---------------------------------------------------------------------------------------- config
_YARN_FIELDS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate",
                "attention_factor", "mscale", "mscale_all_dim")


def _rope_scaling(value: Any, max_position_embeddings: Any = None) -> RopeScaling | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"rope_scaling must be null or an object, got {value!r}")
    kind = value.get("rope_type", value.get("type"))
    if kind == "default":
        return None
    if kind == "yarn":
        unknown = sorted(set(value) - {*_YARN_FIELDS, "rope_type", "type", "rope_theta"})
        if unknown:
            raise ValueError(f"rope_scaling of type 'yarn' has fields {unknown} this loader does not know")
        fields = {f: value[f] for f in _YARN_FIELDS if value.get(f) is not None}
        if "factor" not in fields:
            raise ValueError("rope_scaling of type 'yarn' lacks ['factor']")
        # transformers falls back to the model's max_position_embeddings
        fields.setdefault("original_max_position_embeddings", max_position_embeddings)
        return YarnRopeScaling(**fields)
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: 'llama3', 'yarn', 'default')")
    fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [f for f in fields if f not in value]
    if missing:
        raise ValueError(f"rope_scaling of type 'llama3' lacks {missing}")
    return Llama3RopeScaling(**{f: value[f] for f in fields})


def _rope(hf: dict) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling or None): from ``rope_parameters`` where the config has it (the
    transformers >= 5 form, ``rope_theta`` and ``rope_type`` inside one object, which then wins), else
    from the top-level ``rope_theta`` (default 10000) and ``rope_scaling``."""
    params = hf.get("rope_parameters")
    positions = hf.get("max_position_embeddings")
    if params is None:
        return _number(hf, "rope_theta", 10000.0), _rope_scaling(hf.get("rope_scaling"), positions)
    if not isinstance(params, dict) or "rope_theta" not in params:
        raise ValueError(f"rope_parameters must be an object with rope_theta (one set for all layers), got {params!r}")
    return _number(params, "rope_theta", 10000.0), _rope_scaling({"rope_type": "default", **params}, positions)


def _mxfp4(hf: dict, architecture: str) -> bool:
    """Whether the checkpoint's experts are MXFP4 (gpt-oss's ``quantization_config``); ValueError for
    any other quantization."""
    quantization = hf.get("quantization_config")
    if quantization is None:
        return False
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if architecture != GPT_OSS or method != "mxfp4":
        raise ValueError(f"quantization_config with quant_method {method!r} is not supported for {architecture} "
                         "(only gpt-oss's 'mxfp4' experts)")
    return True


def _sliding(hf: dict, architecture: str, num_layers: int) -> tuple[int | None, tuple[bool, ...] | None]:
    """(sliding_window, sliding_layers) as ``TransformerConfig`` takes them, from the architecture's
    fields (see the module docstring); ValueError naming a field it cannot honour."""
    # transformers' default window where the field is absent (Mixtral's is null; Llama has none)
    default = {"MistralForCausalLM": 4096, "Qwen2ForCausalLM": 4096, "Qwen3ForCausalLM": 4096,
               "Qwen3MoeForCausalLM": 4096, GPT_OSS: 128}.get(architecture)
    window = None
    if architecture != "LlamaForCausalLM" and (hf.get("use_sliding_window") or architecture not in (
            "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")):
        window = _optional({"sliding_window": default, **hf}, "sliding_window", None)
    types = hf.get("layer_types")
    if types is None:
        if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and window is not None:
            first = _optional({"max_window_layers": 28, **hf}, "max_window_layers", 28)
            types = [SLIDING if i >= first else FULL for i in range(num_layers)]
        elif architecture == GPT_OSS:
            types = [SLIDING if i % 2 == 0 else FULL for i in range(num_layers)]
        else:
            types = [SLIDING if window is not None else FULL] * num_layers
    if not (isinstance(types, list) and len(types) == num_layers and set(types) <= {SLIDING, FULL}):
        raise ValueError(f"layer_types must be a list of num_hidden_layers ({num_layers}) entries "
                         f"'{SLIDING}' or '{FULL}', got {types!r}")
    if SLIDING in types and architecture == "LlamaForCausalLM":
        raise ValueError(f"layer_types names '{SLIDING}' layers, which {architecture} does not have")
    if SLIDING in types and window is None:
        raise ValueError(f"layer_types names '{SLIDING}' layers but the config has no sliding window "
                         "(sliding_window null, or use_sliding_window false)")
    if SLIDING in types and architecture in ("MistralForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM") \
            and FULL in types:
        raise ValueError(f"layer_types mixing '{SLIDING}' and '{FULL}' layers is not supported for {architecture} "
                         "(transformers windows all of its layers)")
    if SLIDING not in types:
        return None, None
    return window, None if FULL not in types else tuple(t == SLIDING for t in types)


def _reject_unsupported(hf: dict, architecture: str) -> None:
    """Raises ValueError naming the first config field the model cannot honour."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
    _mxfp4(hf, architecture)
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor {hf['partial_rotary_factor']!r} is not supported (only 1.0)")
    # biases the model has no place for (Qwen3's attention_bias would add one to o_proj too)
    for field in {"LlamaForCausalLM": ("attention_bias", "mlp_bias"),
                  "Qwen3ForCausalLM": ("attention_bias",)}.get(architecture, ()):
        if hf.get(field):
            raise ValueError(f"{field}: true is not supported for {architecture}")
    if architecture == "Qwen3MoeForCausalLM":
        if hf.get("attention_bias"):
            raise ValueError(f"attention_bias: true is not supported for {architecture}")
        if hf.get("decoder_sparse_step", 1) != 1:
            raise ValueError(f"decoder_sparse_step {hf['decoder_sparse_step']!r} is not supported (only 1: "
                             "every layer a mixture of experts)")
        if hf.get("mlp_only_layers"):
            raise ValueError(f"mlp_only_layers {hf['mlp_only_layers']!r} is not supported (only []: every layer "
                             "a mixture of experts)")
    if architecture == GPT_OSS and hf.get("attention_bias", True) is not True:
        raise ValueError(f"attention_bias {hf['attention_bias']!r} is not supported for {architecture} (always true)")


def _required(hf: dict, field: str) -> int:
    value = hf.get(field)
    if not is_int(value, 1):
        raise ValueError(f"{field} must be an int >= 1, got {value!r}")
    return value


def _optional(hf: dict, field: str, default: int | None) -> int | None:
    """``hf[field]``, an int >= 1, or ``default`` where it is absent or null."""
    return default if hf.get(field) is None else _required(hf, field)


def _number(hf: dict, field: str, default: float) -> float:
    value = hf.get(field, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{field} must be a number, got {value!r}")
    return float(value)


def config_from_hf(hf: dict, *, dtype: str = "bfloat16") -> TransformerConfig:
    """The ``TransformerConfig`` of a Hugging Face ``config.json`` (as a dict), in ``dtype``.

    Raises ValueError naming the field for an unsupported architecture or setting.
    """
    if not isinstance(hf, dict):
        raise ValueError(f"must hold a JSON object (the model's config), got {type(hf).__name__}")
    architectures = hf.get("architectures")
    if not isinstance(architectures, list) or len(architectures) != 1 or architectures[0] not in ARCHITECTURES:
        raise ValueError(f"architectures {architectures!r} is not supported (supported: one of {ARCHITECTURES})")
    architecture = architectures[0]
    _reject_unsupported(hf, architecture)
    hidden, heads = _required(hf, "hidden_size"), _required(hf, "num_attention_heads")
    rope_theta, rope_scaling = _rope(hf)
    window, sliding_layers = _sliding(hf, architecture, _required(hf, "num_hidden_layers"))
    moe = {}
    if architecture == GPT_OSS:
        moe = dict(num_experts=_required(hf, "num_local_experts"), num_experts_per_tok=_required(hf, "num_experts_per_tok"),
                   moe_ffn_dim=_required(hf, "intermediate_size"), norm_topk_prob=True, moe_bias=True,
                   swiglu_limit=_number(hf, "swiglu_limit", 7.0))
        if _mxfp4(hf, architecture) and (hf["hidden_size"] % BLOCK or moe["moe_ffn_dim"] % BLOCK):
            raise ValueError(f"MXFP4 experts need hidden_size and intermediate_size multiples of {BLOCK}")
    elif architecture == "MixtralForCausalLM":
        moe = dict(num_experts=_required(hf, "num_local_experts"),
                   num_experts_per_tok=_required(hf, "num_experts_per_tok"),
                   moe_ffn_dim=_required(hf, "intermediate_size"), norm_topk_prob=True)
    elif architecture == "Qwen3MoeForCausalLM":
        norm = hf.get("norm_topk_prob", False)
        if not isinstance(norm, bool):
            raise ValueError(f"norm_topk_prob must be true or false, got {norm!r}")
        moe = dict(num_experts=_required(hf, "num_experts"), num_experts_per_tok=_required(hf, "num_experts_per_tok"),
                   moe_ffn_dim=_required(hf, "moe_intermediate_size"), norm_topk_prob=norm)
    if moe and moe["num_experts_per_tok"] > moe["num_experts"]:
        raise ValueError(f"num_experts_per_tok ({moe['num_experts_per_tok']}) must be at most the number of experts "
                         f"({moe['num_experts']})")
    return TransformerConfig(
        vocab_size=_required(hf, "vocab_size"), num_layers=_required(hf, "num_hidden_layers"), d_model=hidden,
        num_heads=heads, num_kv_heads=_optional(hf, "num_key_value_heads", heads),
        head_dim=_optional(hf, "head_dim", hidden // heads), ffn_dim=_required(hf, "intermediate_size"),
        rope_theta=rope_theta, norm_eps=_number(hf, "rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), dtype=dtype,
        qkv_bias=architecture in ("Qwen2ForCausalLM", GPT_OSS),
        qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        attention_out_bias=architecture == GPT_OSS, attention_sinks=architecture == GPT_OSS,
        rope_scaling=rope_scaling, sliding_window=window, sliding_layers=sliding_layers,
        max_position_embeddings=_optional(hf, "max_position_embeddings", None), **moe)


# ---------------------------------------------------------------------------------------- tensors
def open_safetensors(file: pathlib.Path, caller: str = "load_hf"):
    """``safe_open`` (numpy) of a weights file; a file it cannot read (empty, truncated, not safetensors)
    raises a ValueError naming it, prefixed with ``caller``."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(file, framework="numpy")
    except SafetensorError as e:
        raise ValueError(f"{caller}: {file} is not a readable safetensors file ({e}): re-download it") from None


def _weight_files(directory: pathlib.Path) -> dict[str, pathlib.Path]:
    """{tensor name: safetensors file holding it}, from the index file or the single file's header."""
    index = directory / INDEX_FILE
    if index.exists():
        data = read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise ValueError(f"load_hf: {index} has no 'weight_map' object")
        files = {name: directory / file for name, file in weight_map.items()}
        missing = sorted({str(f) for f in files.values() if not f.exists()})
        if missing:
            raise FileNotFoundError(f"load_hf: {missing[0]} (listed in {index}) not found")
        return files
    single = directory / SINGLE_FILE
    if not single.exists():
        raise FileNotFoundError(f"load_hf: {directory} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    with open_safetensors(single) as f:
        return {name: single for name in f.keys()}


def _expected_shapes(config: TransformerConfig, architecture: str, mxfp4: bool) -> dict[str, tuple[int, ...]]:
    """{Hugging Face tensor name: its shape in the checkpoint} for every parameter of the model (one
    tensor per expert for the stacked expert weights; gpt-oss: one per layer, MXFP4 when ``mxfp4``)."""
    expected = {}
    for name, spec in parameter_shapes(config).items():
        if architecture == GPT_OSS and _is_expert(name):
            for layer in range(config.num_layers):
                expected.update(_gpt_oss_expert_tensors(config, layer, mxfp4))
            continue
        stacked = name.startswith(LAYER_PREFIX)
        shape = spec.shape[1:] if stacked else spec.shape
        experts = range(shape[0]) if _is_expert(name) else [None]
        shape = shape[1:] if _is_expert(name) else shape
        for layer in range(spec.shape[0]) if stacked else [None]:
            for expert in experts:
                hf_name, transposed = hf_tensor_name(name, layer, architecture, expert)
                expected[hf_name] = tuple(reversed(shape)) if transposed else tuple(shape)
    return expected


def _check_tensors(directory: pathlib.Path, expected: dict[str, tuple[int, ...]],
                   files: dict[str, pathlib.Path], handles: dict, config: TransformerConfig) -> None:
    """Raises ValueError naming the first missing, misshapen or unexpected tensor."""
    for hf_name, shape in expected.items():
        if hf_name not in files:
            raise ValueError(f"load_hf: tensor {hf_name} is missing from the checkpoint in {directory}")
        found = tuple(handles[files[hf_name]].get_slice(hf_name).get_shape())
        if found != shape:
            raise ValueError(f"load_hf: tensor {hf_name} in {files[hf_name]} has shape {list(found)}, "
                             f"config.json implies {list(shape)}")
    ignored = {"lm_head.weight"} if config.tie_embeddings else set()   # tied: the embedding is the head
    extra = sorted(n for n in files
                   if n not in expected and n not in ignored and not n.endswith("rotary_emb.inv_freq"))
    if extra:
        raise ValueError(f"load_hf: tensor {extra[0]} in {files[extra[0]]} is not used by the model "
                         "config.json describes")


def load_hf(path: str | pathlib.Path, *, dtype: str = "bfloat16", revision: str | None = None) -> Transformer:
    """A ``Transformer`` (a ``PagedModel``) with a Hugging Face checkpoint's config and weights.

    Args:
      path: a local model directory with ``config.json`` and ``model.safetensors`` or
        ``model.safetensors.index.json`` plus its shards, or a Hugging Face Hub id (``org/name``) of
        one. Architectures: LlamaForCausalLM (incl. ``rope_scaling`` type "llama3"), Qwen2ForCausalLM,
        Qwen3ForCausalLM (q/k norms), MistralForCausalLM (sliding window honoured),
        Qwen3MoeForCausalLM, MixtralForCausalLM and GptOssForCausalLM (mixtures of experts,
        ``scv_jax.models.moe``; gpt-oss's MXFP4 experts dequantized), sliding-window layers and YaRN.
      dtype: parameter and activation dtype, "bfloat16" (default), "float16" or "float32"; the
        checkpoint's tensors are cast one at a time.
      revision: a Hub id's branch, tag or commit hash (None: its default branch).
    Returns:
      The model: ``model(tokens int32[B, T])`` gives float32 logits [B, T, vocab].
    Raises:
      FileNotFoundError: a missing directory, config.json or weights file, an unknown Hub id or
        revision, an id not cached while offline (``scv_jax.models.hub.checkpoint_dir``).
      ValueError: an unsupported architecture or config field, a missing, unexpected or misshapen
        tensor (the message names it).
    """
    dtype = canonical_dtype(dtype, "load_hf: dtype")
    directory = checkpoint_dir(path, revision=revision)
    config_file = directory / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"load_hf: {config_file} not found")
    hf = read_json(config_file)
    try:
        config = config_from_hf(hf, dtype=dtype)
    except ValueError as e:
        raise ValueError(f"load_hf: {config_file}: {e}") from None
    files = _weight_files(directory)
    with contextlib.ExitStack() as stack:
        handles = {file: stack.enter_context(open_safetensors(file)) for file in sorted(set(files.values()))}
        architecture = hf["architectures"][0]
        mxfp4 = _mxfp4(hf, architecture)
        _check_tensors(directory, _expected_shapes(config, architecture, mxfp4), files, handles, config)

        def get(hf_name: str) -> np.ndarray:
            return handles[files[hf_name]].get_tensor(hf_name)

        def read_one(name: str, layer: int | None, expert: int | None = None) -> tuple[np.ndarray, str]:
            hf_name, transposed = hf_tensor_name(name, layer, architecture, expert)
            tensor = get(hf_name)
            return (tensor.T if transposed else tensor), f"load_hf: tensor {hf_name} in {files[hf_name]}"

        def read(name: str, layer: int | None) -> tuple[np.ndarray, str]:
            if not _is_expert(name):
                return read_one(name, layer)
            if architecture == GPT_OSS:
                return (_read_gpt_oss_expert(name, layer, get, mxfp4),
                        f"load_hf: layer {layer}'s gpt-oss expert tensors for {name}")
            # one layer's experts stacked [E, in, out]
            hf_name = hf_tensor_name(name, layer, architecture, "{e}")[0]    # type: ignore[arg-type]
            return (np.stack([read_one(name, layer, e)[0] for e in range(config.num_experts)]),
                    f"load_hf: tensors {hf_name} (e < {config.num_experts})")

        return assemble_transformer(config, read)


def read_json(file: pathlib.Path, caller: str = "load_hf") -> Any:
    """The JSON value in ``file``; ValueError naming the file (prefixed with ``caller``) when it is not
    UTF-8 JSON."""
    try:
        return json.loads(file.read_bytes())
    except ValueError as e:      # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{caller}: {file} is not valid JSON ({e})") from None


def eos_token_ids(path: str | pathlib.Path, *, revision: str | None = None) -> list[int]:
    """The end-of-sequence ids a model directory (or Hub id at ``revision``) declares
    (``generation_config.json``, else ``config.json``; ``eos_token_id`` may be one id or a list, e.g.
    Llama-3-Instruct's three); [] when it declares none. Raises ValueError naming the file for ids that
    are not ints >= 0."""
    directory = checkpoint_dir(path, revision=revision)
    for name in ("generation_config.json", "config.json"):
        file = directory / name
        if file.is_file():
            data = read_json(file)
            eos = data.get("eos_token_id") if isinstance(data, dict) else None
            if eos is not None:
                ids = eos if isinstance(eos, list) else [eos]
                if not all(is_int(i, 0) for i in ids):
                    raise ValueError(f"{file}: eos_token_id must be an int or a list of ints >= 0, got {eos!r}")
                return [int(i) for i in ids]
    return []
