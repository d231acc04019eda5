"""Makes the tiny Hugging Face checkpoints the loader tests use, with what transformers computes.

For each architecture (``llama``: Llama 2 style, sharded float32; ``llama3_scaled``: Llama 3.2
style, GQA, explicit head_dim, rope_scaling "llama3", tied embeddings, bfloat16 on disk; ``qwen2``:
q/k/v biases, tied embeddings; ``mistral``: GQA, sliding window shorter than the sequences,
bfloat16 on disk; ``qwen3``: q/k RMS norms, GQA, head_dim 16 (not hidden / heads), tied embeddings,
bfloat16 on disk; ``qwen3_moe``: Qwen3-MoE, every layer 4 experts of width 32 (the dense
intermediate_size 64 unused), top-2 without renormalisation (norm_topk_prob false), q/k norms,
untied, sharded bfloat16; ``mixtral``: 4 experts of width 32, top-2 (renormalised), GQA (1 KV head),
sliding window 12, bfloat16 on disk; ``qwen2_window``: Qwen2 with ``use_sliding_window``, window 8
from layer 1 on (``max_window_layers`` 1) and YaRN rope scaling spelled ``"type": "yarn"``, bfloat16 on disk;
``gpt_oss``: gpt-oss, 4 experts of width 32, top-2, layer 0 a 6-token window and layer 1 full
(``layer_types``), q/k/v/o biases, sinks, router and expert biases, expert weights scaled up so
the SwiGLU clamp (7) bites, YaRN as gpt-oss publishes it (factor 32, ``truncate`` false), bfloat16
on disk; ``gpt_oss_mxfp4``: the same architecture with its experts stored as published, MXFP4
``*_blocks`` / ``*_scales`` and ``quantization_config`` mxfp4, the logits computed from the dequantized
weights and checked against transformers' own MXFP4 load) it writes ``<name>/`` with

- ``config.json``, ``generation_config.json``, ``model.safetensors`` (or shards + index),
- ``tokenizer.json``: a tiny BPE tokenizer (``tokenizers``) whose vocabulary is the model's,
- ``expected.json``: the prompts, transformers' 32-token greedy continuation of each (``generate``,
  with its KV cache) and tokenizer round-trip samples,
- ``logits.npz``: transformers' float32 logits over each prompt + continuation (``logits_<i>``),
- ``hidden_states.npz``: its float32 ``output_hidden_states`` over each (``hidden_<i>``,
  [num_layers + 1, T, hidden]: entry l < num_layers is the input of layer l, 0 the embeddings; the
  last is the final norm's output).

Every parameter (norm weights and biases too) is random, so a tensor mapped to the wrong place
shows. The script checks that transformers' full forward agrees with its own greedy continuation
(no near-ties) before writing anything.

CI does not install torch; the files are committed. To regenerate them (the output is
deterministic for a given torch/transformers version), from the repository root:

    PYENV_VERSION=3.11.7 python3 -m venv /tmp/fixture-venv
    /tmp/fixture-venv/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu  # or a CPU wheel
    /tmp/fixture-venv/bin/pip install transformers==4.57.6 safetensors tokenizers numpy
    /tmp/fixture-venv/bin/python tests/models/hf_fixtures/make_fixtures.py [NAME ...]

(NAMEs: make only those fixtures; each has its own seeds, so the others stay as they are).
``make_fixtures.py --hidden-states [NAME ...]`` only (re)writes ``hidden_states.npz`` from the
committed checkpoint and ``expected.json``, after checking that the logits of that forward are
``logits.npz``'s (how those files were added, with torch 2.13.0+cpu). Made with
torch 2.13.0+cpu, transformers 4.57.6, tokenizers 0.22.2; ``qwen3`` later, alone, with torch
2.14.1+cu130 (PyPI's wheel, run on the CPU, Python 3.12), transformers 4.57.6, tokenizers 0.22.2;
``qwen3_moe`` and ``mixtral`` later, with torch 2.14.1 (Python 3.11), transformers 4.57.6
(each fixture's ``expected.json`` records its versions).
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

OUT = pathlib.Path(__file__).resolve().parent
NEW_TOKENS = 32
VOCAB = 96
MIN_MARGIN = 1e-3     # smallest gap between the top two logits at any greedy step
MIN_DISTINCT = 8      # fewest distinct tokens in a continuation (no degenerate repetition)
CORPUS = """Speculative decoding lets a small draft model propose several tokens that the large target
model then verifies in one forward pass. The target accepts the longest prefix it agrees with and
adds one token of its own, so every step emits at least one token and the output is exactly what
the target alone would have produced. A paged key value cache keeps the attention state of many
requests in fixed size blocks; only the accepted tokens are written back. The quick brown fox jumps
over the lazy dog while the scheduler batches requests of different lengths together."""
TEXTS = ["The quick brown fox", "the target model verifies the draft tokens"]

COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=512, initializer_range=0.25,
              bos_token_id=1, eos_token_id=2, pad_token_id=None)

GPT_OSS_SIZES = dict(intermediate_size=32, max_position_embeddings=131072)      # YaRN: 32 x 4096
FIXTURES = {
    "llama": dict(
        config=transformers.LlamaConfig(**COMMON, num_key_value_heads=4, rope_theta=10000.0, rms_norm_eps=1e-5,
                                        tie_word_embeddings=False),
        dtype=torch.float32, shard_size="40KB", style="metaspace"),
    "llama3_scaled": dict(
        config=transformers.LlamaConfig(**COMMON, num_key_value_heads=2, head_dim=16, rope_theta=500000.0,
                                        rms_norm_eps=1e-5, tie_word_embeddings=True,
                                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 256}),
        dtype=torch.bfloat16, shard_size=None, style="metaspace"),
    "qwen2": dict(
        config=transformers.Qwen2Config(**COMMON, num_key_value_heads=2, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                        tie_word_embeddings=True),
        dtype=torch.float32, shard_size=None, style="bytelevel"),
    "mistral": dict(
        config=transformers.MistralConfig(**COMMON, num_key_value_heads=1, rope_theta=10000.0, rms_norm_eps=1e-5,
                                          sliding_window=12, tie_word_embeddings=False),
        dtype=torch.bfloat16, shard_size=None, style="metaspace"),
    "qwen3": dict(
        config=transformers.Qwen3Config(**COMMON, num_key_value_heads=2, head_dim=16, rope_theta=1000000.0,
                                        rms_norm_eps=1e-6, attention_bias=False, tie_word_embeddings=True),
        dtype=torch.bfloat16, shard_size=None, style="bytelevel"),
    "qwen3_moe": dict(
        config=transformers.Qwen3MoeConfig(**COMMON, num_key_value_heads=2, head_dim=16, rope_theta=1000000.0,
                                           rms_norm_eps=1e-6, attention_bias=False, tie_word_embeddings=False,
                                           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                           norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[]),
        dtype=torch.bfloat16, shard_size="40KB", style="bytelevel"),
    "qwen2_window": dict(
        config=transformers.Qwen2Config(**{**COMMON, "max_position_embeddings": 256}, num_key_value_heads=2,
                                        rope_theta=1000000.0, rms_norm_eps=1e-6,
                                        tie_word_embeddings=False, use_sliding_window=True, sliding_window=8,
                                        max_window_layers=1,
                                        rope_scaling={"type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 64}),
        dtype=torch.bfloat16, shard_size=None, style="bytelevel"),
    "gpt_oss": dict(
        config=transformers.GptOssConfig(**{**COMMON, **GPT_OSS_SIZES}, num_key_value_heads=2, head_dim=16,
                                         rms_norm_eps=1e-5, sliding_window=6, tie_word_embeddings=False,
                                         num_local_experts=4, num_experts_per_tok=2,
                                         layer_types=["sliding_attention", "full_attention"]),
        dtype=torch.bfloat16, shard_size="40KB", style="bytelevel", scale={"gate_up_proj": 1.0}),
    "gpt_oss_mxfp4": dict(
        config=transformers.GptOssConfig(**{**COMMON, **GPT_OSS_SIZES}, num_key_value_heads=2, head_dim=16,
                                         rms_norm_eps=1e-5, sliding_window=6, tie_word_embeddings=False,
                                         num_local_experts=4, num_experts_per_tok=2,
                                         layer_types=["sliding_attention", "full_attention"]),
        dtype=torch.bfloat16, shard_size=None, style="bytelevel", mxfp4=True),
    "mixtral": dict(
        config=transformers.MixtralConfig(**{**COMMON, "intermediate_size": 32}, num_key_value_heads=1,
                                          rope_theta=10000.0, rms_norm_eps=1e-5, sliding_window=12,
                                          tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2),
        dtype=torch.bfloat16, shard_size=None, style="metaspace"),
}


def make_tokenizer(style: str) -> Tokenizer:
    """A BPE tokenizer with exactly VOCAB ids: sentencepiece-like (Metaspace, BOS added: Llama,
    Mistral) or byte-level pre-tokenisation without BOS (Qwen2, Qwen3)."""
    specials = ["<unk>", "<s>", "</s>"]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>" if style == "metaspace" else None))
    if style == "metaspace":
        tokenizer.normalizer = normalizers.Sequence([])
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
        tokenizer.decoder = decoders.Metaspace()
        tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials, show_progress=False)
    tokenizer.train_from_iterator([CORPUS], trainer)
    assert tokenizer.get_vocab_size() == VOCAB, tokenizer.get_vocab_size()
    assert [tokenizer.token_to_id(t) for t in specials] == [0, 1, 2]
    return tokenizer


def randomize(model: torch.nn.Module, seed: int, scale: dict[str, float] | None = None) -> None:
    """Every parameter random (norm weights around 1, biases small, weights 0.25 N(0, 1) unless
    ``scale`` names a larger factor for parameters ending in a name), so no mapping error hides."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_(1.0 + 0.3 * noise)
            elif name.endswith("bias"):
                param.copy_(0.3 * noise)
            else:
                factor = next((f for suffix, f in (scale or {}).items() if name.endswith(suffix)), 0.25)
                param.copy_(factor * noise)


MXFP4_TENSORS = ("gate_up_proj", "down_proj")


def mxfp4_experts(model, seed: int) -> dict[str, np.ndarray]:
    """Replaces every gpt-oss expert weight by the dequantization of random MXFP4 blocks and scales
    (transformers' ``convert_moe_packed_tensors``); returns the packed tensors by checkpoint name."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(seed)
    packed = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            base = name.rsplit(".", 1)[-1]
            if base not in MXFP4_TENSORS:
                continue
            experts, cols, rows = param.shape                  # stored [E, in, out]; packed [E, out, in / 32, 16]
            blocks = rng.integers(0, 256, (experts, rows, cols // 32, 16), dtype=np.uint8)
            scales = rng.integers(122, 128, (experts, rows, cols // 32), dtype=np.uint8)
            param.copy_(convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                                   dtype=torch.float32))
            packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
    return packed


def pack_experts(directory: pathlib.Path, packed: dict[str, np.ndarray]) -> None:
    """Rewrites the single-file checkpoint in ``directory`` with the expert weights as MXFP4 blocks and
    scales (``packed``) and ``quantization_config`` as gpt-oss publishes it."""
    from safetensors.torch import load_file, save_file

    tensors = {n: t for n, t in load_file(directory / "model.safetensors").items()
               if n.rsplit(".", 1)[-1] not in MXFP4_TENSORS}
    save_file({**tensors, **{n: torch.from_numpy(t) for n, t in packed.items()}},
              str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                         min_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True)
    return out[0, len(prompt):].tolist()


def load(directory: pathlib.Path):
    """The checkpoint on disk, computed in float32 (a bfloat16 checkpoint is upcast exactly)."""
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def write_hidden_states(directory: pathlib.Path, model, sequences: list[list[int]]) -> list[np.ndarray]:
    """Writes ``hidden_states.npz`` (float32 ``hidden_<i>``: [num_layers + 1, T, hidden]) over each
    sequence; returns the float32 logits [T, vocab] of the same forwards."""
    hidden, logits = {}, []
    for i, seq in enumerate(sequences):
        with torch.no_grad():
            out = model(torch.tensor([seq]), output_hidden_states=True)
        hidden[f"hidden_{i}"] = torch.stack(out.hidden_states)[:, 0].float().numpy()
        logits.append(out.logits[0].float().numpy())
    np.savez_compressed(directory / "hidden_states.npz", **hidden)
    return logits


def make(name: str, spec: dict, seed: int) -> dict | None:
    """Writes fixture ``name`` from ``seed``; None (try another seed) if a greedy step is a near-tie
    or a continuation repeats a few tokens."""
    directory = OUT / name
    shutil.rmtree(directory, ignore_errors=True)
    torch.manual_seed(seed)
    config = spec["config"]
    config.architectures = [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                             "mistral": "MistralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                             "mixtral": "MixtralForCausalLM", "gpt_oss": "GptOssForCausalLM"}[config.model_type]]
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    randomize(model, seed, spec.get("scale"))
    packed = mxfp4_experts(model, seed) if spec.get("mxfp4") else None
    model.generation_config.eos_token_id = None       # always 32 new tokens
    model.generation_config.pad_token_id = 0
    save = dict(safe_serialization=True)
    if spec["shard_size"]:
        save["max_shard_size"] = spec["shard_size"]
    model.to(spec["dtype"]).save_pretrained(directory, **save)
    tokenizer = make_tokenizer(spec["style"])
    tokenizer.save(str(directory / "tokenizer.json"))

    model = load(directory)
    rng = np.random.default_rng(seed)
    prompts = [tokenizer.encode(TEXTS[0]).ids, rng.integers(3, VOCAB, 9).tolist()]
    continuations, logits = [], {}
    for i, prompt in enumerate(prompts):
        continuation = greedy(model, prompt)
        with torch.no_grad():
            full = model(torch.tensor([prompt + continuation])).logits[0].float().numpy()
        # transformers' full forward agrees with its cached generation, by a clear margin
        steps = full[len(prompt) - 1:-1]
        assert steps.argmax(-1).tolist() == continuation, (name, i)
        top2 = np.sort(steps, axis=-1)[:, -2:]
        if (top2[:, 1] - top2[:, 0]).min() < MIN_MARGIN or len(set(continuation)) < MIN_DISTINCT:
            return None
        continuations.append(continuation)
        logits[f"logits_{i}"] = full.astype(np.float32)
    np.savez_compressed(directory / "logits.npz", **logits)
    write_hidden_states(directory, model, [p + c for p, c in zip(prompts, continuations)])
    if packed is not None:        # the packed checkpoint, as transformers reads it, computes the same logits
        pack_experts(directory, packed)
        packed_model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.float32, attn_implementation="eager",
            quantization_config=transformers.Mxfp4Config(dequantize=True)).float().eval()  # its experts bf16 (exact)
        for i, prompt in enumerate(prompts):
            with torch.no_grad():
                got = packed_model(torch.tensor([prompt + continuations[i]])).logits[0].float().numpy()
            np.testing.assert_allclose(got, logits[f"logits_{i}"], rtol=1e-5, atol=1e-5, err_msg=name)
    expected = {
        "prompts": prompts, "continuations": continuations,
        "tokenizer": [{"text": t, "ids": tokenizer.encode(t).ids,
                       "ids_without_special": tokenizer.encode(t, add_special_tokens=False).ids} for t in TEXTS],
        "made_with": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    (directory / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    size = sum(p.stat().st_size for p in directory.iterdir())
    print(f"{name}: seed {seed}, {size / 1024:.0f} KiB; continuations {continuations}")
    return expected


def add_hidden_states(name: str) -> None:
    """Writes ``hidden_states.npz`` of committed fixture ``name``, changing none of its other files."""
    directory = OUT / name
    expected = json.loads((directory / "expected.json").read_text())
    sequences = [p + c for p, c in zip(expected["prompts"], expected["continuations"])]
    logits = write_hidden_states(directory, load(directory), sequences)
    with np.load(directory / "logits.npz") as committed:
        for i, got in enumerate(logits):
            np.testing.assert_allclose(got, committed[f"logits_{i}"], rtol=1e-4, atol=1e-4, err_msg=name)
    print(f"{name}: hidden_states.npz, {(directory / 'hidden_states.npz').stat().st_size / 1024:.0f} KiB")


def main(names: list[str]) -> None:
    hidden_only = names[:1] == ["--hidden-states"]
    names = names[hidden_only:]
    unknown = sorted(set(names) - set(FIXTURES))
    if unknown:
        raise SystemExit(f"make_fixtures.py: unknown fixtures {unknown} (known: {list(FIXTURES)})")
    for index, (name, spec) in enumerate(FIXTURES.items()):
        if names and name not in names:
            continue
        if hidden_only:
            add_hidden_states(name)
            continue
        seed = 100 * index
        while make(name, spec, seed) is None:
            seed += 1
    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"total {total / 1024:.0f} KiB in {OUT}")


if __name__ == "__main__":
    main(sys.argv[1:])
