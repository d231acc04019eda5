"""Random EAGLE-3 draft-head checkpoints in numpy (no jax, no torch): the tensors and config.json of
both public layouts. Used by tests/models/test_eagle3.py and by make_bin_fixture.py (which saves the
``BIN_HEAD`` tensors with torch)."""

from __future__ import annotations

import numpy as np

# The head make_bin_fixture.py writes as eagle3_head.bin (float16), for a target with hidden size 16
# and vocabulary 24 (test_eagle3.TARGET).
BIN_HEAD = dict(hidden=16, heads=2, kv_heads=1, head_dim=8, ffn=32, target_vocab=24, draft_vocab=12, seed=7)

LAYER_PREFIX = {"eagle3": "midlayer.", "speculators": "layers.0."}


def head_tensors(hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int, target_vocab: int,
                 draft_vocab: int, seed: int, *, layout: str = "eagle3", d2t: bool = True,
                 dtype=np.float32, fc_norm: bool = False, norm_before_fc: bool = False,
                 qk_norm: bool = False) -> dict[str, np.ndarray]:
    """{checkpoint tensor name: array} of a random head: projections ~ N(0, 1/fan_in), norm weights
    in [0.5, 1.5], d2t mapping draft id i to a random sorted subset of the target ids (t2d its mask);
    with ``fc_norm`` three per-feature norms ``fc_norm.{i}.weight``, with ``norm_before_fc`` one
    ``input_norm.weight`` [3 * hidden], with ``qk_norm`` the layer's ``self_attn.{q,k}_norm.weight``."""
    rng = np.random.default_rng(seed)

    def linear(fan_out: int, fan_in: int) -> np.ndarray:
        return (rng.standard_normal((fan_out, fan_in)) / np.sqrt(fan_in)).astype(dtype)

    def norm(size: int = hidden) -> np.ndarray:
        return rng.uniform(0.5, 1.5, size).astype(dtype)

    p = LAYER_PREFIX[layout]
    tensors = {
        "fc.weight": linear(hidden, 3 * hidden),
        f"{p}input_layernorm.weight": norm(),
        f"{p}hidden_norm.weight": norm(),
        f"{p}self_attn.q_proj.weight": linear(heads * head_dim, 2 * hidden),
        f"{p}self_attn.k_proj.weight": linear(kv_heads * head_dim, 2 * hidden),
        f"{p}self_attn.v_proj.weight": linear(kv_heads * head_dim, 2 * hidden),
        f"{p}self_attn.o_proj.weight": linear(hidden, heads * head_dim),
        f"{p}post_attention_layernorm.weight": norm(),
        f"{p}mlp.gate_proj.weight": linear(ffn, hidden),
        f"{p}mlp.up_proj.weight": linear(ffn, hidden),
        f"{p}mlp.down_proj.weight": linear(hidden, ffn),
        "norm.weight": norm(),
        "lm_head.weight": (3 * linear(draft_vocab, hidden)).astype(dtype),
    }
    if fc_norm:
        tensors.update({f"fc_norm.{i}.weight": norm() for i in range(3)})
    if norm_before_fc:
        tensors["input_norm.weight"] = norm(3 * hidden)
    if qk_norm:
        tensors.update({f"{p}self_attn.q_norm.weight": norm(head_dim), f"{p}self_attn.k_norm.weight": norm(head_dim)})
    if d2t:
        target_ids = np.sort(rng.choice(target_vocab, draft_vocab, replace=False))
        tensors["d2t"] = (target_ids - np.arange(draft_vocab)).astype(np.int64)
        tensors["t2d"] = np.isin(np.arange(target_vocab), target_ids)
    return tensors


def head_config(hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int, target_vocab: int,
                draft_vocab: int, *, layout: str = "eagle3", aux_layers=None, norm_before_residual=None,
                rope_theta: float = 10000.0, rope_scaling=None, eps: float = 1e-5, **_) -> dict:
    """config.json of a head in ``layout`` ("eagle3": SafeAILab/SpecForge, "speculators")."""
    llama = {"hidden_size": hidden, "intermediate_size": ffn, "num_attention_heads": heads,
             "num_key_value_heads": kv_heads, "head_dim": head_dim, "num_hidden_layers": 1,
             "rms_norm_eps": eps, "rope_theta": rope_theta, "rope_scaling": rope_scaling,
             "hidden_act": "silu", "vocab_size": target_vocab, "max_position_embeddings": 2048,
             "tie_word_embeddings": False}
    if layout == "eagle3":
        config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", **llama,
                  "draft_vocab_size": draft_vocab}
        if aux_layers is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layers)}
    else:
        config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                  "transformer_layer_config": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                               **llama},
                  "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                         "proposal_methods": [{"proposal_type": "greedy",
                                                               "speculative_tokens": 3}],
                                         "verifier": {"architectures": ["LlamaForCausalLM"],
                                                      "name_or_path": "tiny"}},
                  "draft_vocab_size": draft_vocab}
        if aux_layers is not None:
            config["eagle_aux_hidden_state_layer_ids"] = list(aux_layers)
    if norm_before_residual is not None:
        config["norm_before_residual"] = norm_before_residual
    return config
