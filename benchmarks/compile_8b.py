"""Compile time of the decoder's steps at Llama-3.1-8B sizes, with no weights ever materialised.

    JAX_PLATFORMS=cpu python benchmarks/compile_8b.py [--batch 8] [--k 4] [--context 4096] [--append]

Everything is abstract (``nnx.eval_shape`` for the models, ``jax.eval_shape`` for the bfloat16 paged
caches, ``jax.ShapeDtypeStruct`` inputs); each step is ``jax.jit(...).trace(...).lower().compile()``d
exactly as graph mode compiles it (caches donated), and lowering and compile seconds are printed:

- ``autoregressive``: one decode step of the target alone (forward over the pending token + commit);
- ``speculative``: one speculative step, k drafts from a Llama-3.2-1B-shaped draft (catch-up forward
  and a scan of k - 1 draft forwards), the target's verify forward over k + 1 tokens, greedy
  acceptance and the no-write-on-reject commits of both caches.

Each is compiled with the layers as the decoder runs them (``per_layer``: each layer's weights inputs
of their own, the layers one after another) and as a ``jax.lax.scan`` over stacked weights (``scan``:
traced once), at 32 target layers and at 2 (how compile time grows with depth).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from harness import publish  # noqa: E402
from scv_jax.decoding.device_step import SplitModel, StepRow  # noqa: E402
from scv_jax.decoding.plan import SamplingColumn  # noqa: E402
from scv_jax.decoding.step_fn import make_decode_step  # noqa: E402
from scv_jax.decoding.verifiers import ChainVerifier  # noqa: E402
from scv_jax.models import Llama3RopeScaling, Transformer, TransformerConfig  # noqa: E402
from scv_jax.ops.commit.kv_cache import PagedKVCache  # noqa: E402

LLAMA3_ROPE = Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position_embeddings=8192)
LLAMA_31_8B = TransformerConfig(vocab_size=128256, num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8,
                                head_dim=128, ffn_dim=14336, rope_theta=500000.0, norm_eps=1e-5,
                                tie_embeddings=False, dtype="bfloat16", rope_scaling=LLAMA3_ROPE)
LLAMA_32_1B = TransformerConfig(vocab_size=128256, num_layers=16, d_model=2048, num_heads=32, num_kv_heads=8,
                                head_dim=64, ffn_dim=8192, rope_theta=500000.0, norm_eps=1e-5,
                                tie_embeddings=True, dtype="bfloat16", rope_scaling=LLAMA3_ROPE)
BLOCK_SIZE = 16


def abstract_model(config: TransformerConfig, layers: str):
    """(structure, abstract parameter leaves) of the model: no parameter allocated; ``layers``
    "per_layer" (as the decoder splits it) or "scan" (stacked weights, the layers under a scan)."""
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    if layers == "per_layer":
        return SplitModel.split(model)
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    return SplitModel(graphdef, treedef), leaves


def abstract_cache(config: TransformerConfig, num_blocks: int) -> PagedKVCache:
    return jax.eval_shape(lambda: PagedKVCache.create(config.num_layers, num_blocks, BLOCK_SIZE,
                                                      config.num_kv_heads, config.head_dim, dtype="bfloat16"))


def compile_step(target: TransformerConfig, draft: TransformerConfig | None, *, batch: int, k: int,
                 context: int, layers: str) -> tuple[float, float]:
    """(lowering seconds, compile seconds) of one decode step (``k`` drafts; no draft: k = 0)."""
    max_blocks = -(-context // BLOCK_SIZE)
    num_blocks = batch * max_blocks
    target_split, target_params = abstract_model(target, layers)
    draft_split, draft_params = abstract_model(draft, layers) if draft is not None else (None, None)
    step = jax.jit(make_decode_step(target_split, draft_split, BLOCK_SIZE, ChainVerifier()),
                   static_argnames=("k", "greedy", "backend"), donate_argnames=("target_cache", "draft_cache"))
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    start = time.perf_counter()
    lowered = step.trace(
        target_params=target_params, draft_params=draft_params, target_cache=abstract_cache(target, num_blocks),
        draft_cache=abstract_cache(draft, num_blocks) if draft is not None else None,
        block_tables=i32(batch, max_blocks), rows=i32(batch, StepRow.WIDTH),
        sampling=jax.ShapeDtypeStruct((batch, SamplingColumn.WIDTH), jnp.float32),
        request_mask=jax.ShapeDtypeStruct((batch,), jnp.bool_),
        k=k if draft is not None else 0, greedy=True, backend="xla").lower()
    lowered_at = time.perf_counter()
    lowered.compile()
    return lowered_at - start, time.perf_counter() - lowered_at


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--context", type=int, default=4096, help="tokens per request the block tables cover")
    parser.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    parser.add_argument("--layers", nargs="+", default=["per_layer", "scan"], choices=["per_layer", "scan"])
    args = parser.parse_args(argv)
    rows = ["| step | layers run | target layers | draft layers | lowering s | compile s |",
            "|---|---|---:|---:|---:|---:|"]
    for depth in (32, 2):
        target = dataclasses.replace(LLAMA_31_8B, num_layers=depth)
        draft = dataclasses.replace(LLAMA_32_1B, num_layers=min(depth, LLAMA_32_1B.num_layers))
        for name, draft_config in (("autoregressive", None), (f"speculative (k={args.k})", draft)):
            for layers in args.layers:
                lower_s, compile_s = compile_step(target, draft_config, batch=args.batch, k=args.k,
                                                  context=args.context, layers=layers)
                rows.append(f"| {name} | {layers} | {depth} | {draft_config.num_layers if draft_config else '-'} | "
                            f"{lower_s:.1f} | {compile_s:.1f} |")
                print(rows[-1], flush=True)
    publish(__file__, "Compile time at Llama-3.1-8B sizes (abstract shapes)",
            f"Batch {args.batch}, {args.context}-token block tables, bfloat16 model and caches, "
            "Llama-3.2-1B-shaped draft. ", "\n".join(rows), append=args.append)


if __name__ == "__main__":
    main()
