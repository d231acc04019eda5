"""The demo's byte-level models (trained on Python source, vocab 256) as Hugging Face checkpoints, to
try ``scv-jax serve`` / ``generate`` without downloading a model (and for the server's tests):

    python -m scv_jax.demo.hf_export /tmp/demo-target --which target
    python -m scv_jax.demo.hf_export /tmp/demo-draft --which draft

Each directory gets ``config.json`` (LlamaForCausalLM), ``model.safetensors`` (float32), a byte-level
``tokenizer.json`` whose id i is byte i (so a multi-byte character spans tokens) and a
``tokenizer_config.json`` with a small chat template (``### role`` headers)."""

from __future__ import annotations

import json
import pathlib

import numpy as np

CHAT_TEMPLATE = ("{% for message in messages %}"
                 "{{ '### ' + message['role'] + '\\n' + message['content'] + '\\n' }}"
                 "{% endfor %}"
                 "{% if add_generation_prompt %}{{ '### assistant\\n' }}{% endif %}")
MAX_POSITION_EMBEDDINGS = 512


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what the ByteLevel pre-tokenizer and decoder use)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def write_tokenizer(directory: pathlib.Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(directory / "tokenizer.json"))


def write_checkpoint(directory: str | pathlib.Path, *, which: str = "draft", chat_template: bool = True) -> pathlib.Path:
    """The demo ``which`` model ("target": 6 layers, "draft": 1 layer) as a checkpoint in ``directory``
    (created); returns it."""
    from flax import nnx
    from safetensors.numpy import save_file

    from scv_jax.models import load_demo
    from scv_jax.models.assemble import LAYER_PREFIX
    from scv_jax.models.hf import hf_tensor_name

    if which not in ("target", "draft"):
        raise ValueError(f"write_checkpoint: which must be 'target' or 'draft', got {which!r}")
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model = load_demo()[which == "draft"]
    c = model.config
    tensors = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name, value = "/".join(map(str, path)), np.asarray(var.get_value(), np.float32)
        for layer in range(value.shape[0]) if name.startswith(LAYER_PREFIX) else [None]:
            hf_name, transposed = hf_tensor_name(name, layer)
            tensor = value if layer is None else value[layer]
            tensors[hf_name] = np.ascontiguousarray(tensor.T if transposed else tensor)
    save_file(tensors, str(directory / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size,
              "hidden_size": c.d_model, "intermediate_size": c.ffn_dim, "num_hidden_layers": c.num_layers,
              "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
              "rope_theta": c.rope_theta, "rms_norm_eps": c.norm_eps, "tie_word_embeddings": c.tie_embeddings,
              "max_position_embeddings": MAX_POSITION_EMBEDDINGS, "hidden_act": "silu", "torch_dtype": "float32"}
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer(directory)
    if chat_template:
        (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return directory


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m scv_jax.demo.hf_export", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", help="where to write the checkpoint")
    parser.add_argument("--which", choices=("target", "draft"), default="target", help="which demo model")
    args = parser.parse_args(argv)
    print(write_checkpoint(args.directory, which=args.which))


if __name__ == "__main__":
    main()
