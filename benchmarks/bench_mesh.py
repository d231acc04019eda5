"""The speculative decoder by mesh shape: tokens/s, time per step and the bytes each device holds.

    JAX_PLATFORMS=cpu python benchmarks/bench_mesh.py [--devices 8] [--batch 8] [--append]
    JAX_PLATFORMS=cpu python benchmarks/bench_mesh.py --dry-run          # tiny models, 4 devices (CI)

Runs the demo pair (greedy, fixed k) on one device and on every (data, model) mesh of the CPU devices
(``--xla_force_host_platform_device_count``), plus the placement choices at (2, devices / 2): the
embeddings and LM head replicated instead of vocabulary-parallel, and the draft tensor-parallel
instead of replicated.
Each configuration is warmed up first (compilation excluded), then every configuration decodes the
same prompts ``--rounds`` times, round-robin, and the medians are reported; the tokens are checked
against the one device's. On CPU all "devices" share the host's cores, so the times only compare the configurations
with each other (partitioning and collective overhead); they say nothing about GPU speed-ups.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=8, help="CPU devices, a power of two >= 4")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5, help="timed generate calls per configuration (median)")
    parser.add_argument("--dry-run", action="store_true", help="tiny random models, few tokens, 4 devices")
    parser.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    if args.dry_run:
        args.devices, args.batch, args.k, args.max_new_tokens, args.rounds = 4, 2, 2, 8, 1
    return args


ARGS = _parse()
os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"),
                                                  f"--xla_force_host_platform_device_count={ARGS.devices}"]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import scv_jax  # noqa: E402
from harness import publish  # noqa: E402
from scv_jax import DecoderConfig, ShardingConfig, SpeculativeDecoder  # noqa: E402
from scv_jax.models import Transformer, TransformerConfig, load_demo  # noqa: E402

TINY = TransformerConfig(vocab_size=64, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, head_dim=16,
                         ffn_dim=128, tie_embeddings=False)


def _models() -> tuple[Transformer, Transformer]:
    if ARGS.dry_run:
        return Transformer(TINY, rngs=nnx.Rngs(0)), Transformer(TINY, rngs=nnx.Rngs(1))
    return load_demo()


def _configurations() -> list[tuple[tuple[int, int] | None, ShardingConfig | None]]:
    """(mesh shape or None for one device, placement choices): every (data, model) split of the devices
    into powers of two (--dry-run: only the middle one), then the other choices at the middle one."""
    n = ARGS.devices
    middle = (2, n // 2)
    shapes = [middle] if ARGS.dry_run else [(1 << i, n >> i) for i in range(n.bit_length()) if (1 << i) <= n]
    return ([(None, None)] + [(shape, ShardingConfig()) for shape in shapes]
            + [(middle, ShardingConfig(vocab_parallel=False)), (middle, ShardingConfig(draft="model"))])


def _bytes_on_first_device(tree) -> int:
    device = min(jax.tree.leaves(tree)[0].sharding.device_set, key=lambda d: d.id)
    return sum(shard.data.nbytes for leaf in jax.tree.leaves(tree) for shard in leaf.addressable_shards
               if shard.device == device)


def _prompts(vocab: int) -> list[list[int]]:
    if vocab == 256:
        text = [b"import os\n", b"def main(argv):\n    ", b"class Foo:", b"for i in range(", b"    return ",
                b"if __name__ == ", b"# Copyright ", b"    def __init__(self"]
        return [list(text[i % len(text)]) for i in range(ARGS.batch)]
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab, 5 + i).tolist() for i in range(ARGS.batch)]


def _decoder(target, draft, config: DecoderConfig, shape, sharding,
             prompts: list[list[int]]) -> tuple[SpeculativeDecoder, float]:
    """The decoder of one configuration, warmed up, and its warm-up seconds. One untimed ``generate``
    follows (the first in a process also compiles JAX's own small ops, e.g. making the random key)."""
    mesh = None if shape is None else scv_jax.decoder_mesh(*shape)
    decoder = SpeculativeDecoder(target, draft, config=config, mesh=mesh, sharding=sharding)
    start = time.perf_counter()
    decoder.warmup(ARGS.batch, config.max_seq_len)
    seconds = time.perf_counter() - start
    decoder.generate(prompts, 2)
    return decoder, seconds


def _summary(decoder: SpeculativeDecoder, runs: list, warmup: float) -> dict:
    """Median tokens/s and step time of ``runs`` (GenerateOutputs), and the bytes on the first device."""
    stats = [out.stats for out in runs]
    caches = decoder.runner.caches.take()
    decoder.runner.caches.put(*caches)
    return dict(tokens=runs[0].tokens, same=all(out.tokens == runs[0].tokens for out in runs),
                compiles=sum(s.compile_count for s in stats),
                tokens_per_second=float(np.median([s.tokens_per_second for s in stats])),
                step_ms=float(np.median([1e3 * (s.wall_seconds - s.prefill_seconds) / s.steps for s in stats])),
                warmup_s=warmup, weights=_bytes_on_first_device((decoder.runner.target_params, decoder.runner.draft_params)),
                caches=_bytes_on_first_device(caches))


def main() -> None:
    target, draft = _models()
    config = DecoderConfig(k=ARGS.k, block_size=16, num_blocks=8 * ARGS.batch, max_seq_len=128, prefill_chunk=32,
                           batch_buckets=(ARGS.batch,), context_buckets=(8,))
    lines = ["| mesh (data x model) | draft | embeddings | tokens/s | ms per step | vs one device | weights per device "
             "(MB) | KV caches per device (MB) | warm-up s | same tokens |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    configurations = _configurations()
    prompts = _prompts(target.config.vocab_size)
    decoders = [_decoder(target, draft, config, shape, sharding, prompts) for shape, sharding in configurations]
    runs = [[] for _ in decoders]
    for _ in range(ARGS.rounds):           # round-robin, so that load changes on the host hit every row alike
        for (decoder, _), outputs in zip(decoders, runs):
            outputs.append(decoder.generate(prompts, ARGS.max_new_tokens))
    reference = None
    for (shape, sharding), (decoder, warmup), outputs in zip(configurations, decoders, runs):
        result = _summary(decoder, outputs, warmup)
        reference = reference or result
        label = "one device" if shape is None else f"{shape[0]} x {shape[1]}"
        draft_place = "-" if sharding is None else sharding.draft
        embeddings = "-" if sharding is None else ("vocab-parallel" if sharding.vocab_parallel else "replicated")
        same = result["same"] and result["tokens"] == reference["tokens"] and result["compiles"] == 0
        lines.append(f"| {label} | {draft_place} | {embeddings} | {result['tokens_per_second']:.1f} | "
                     f"{result['step_ms']:.2f} | {result['tokens_per_second'] / reference['tokens_per_second']:.2f}x | "
                     f"{result['weights'] / 1e6:.2f} | {result['caches'] / 1e6:.2f} | {result['warmup_s']:.1f} | "
                     f"{'yes' if same else 'NO'} |")
    table = "\n".join(lines)
    if "NO" in table:
        print(table)
        sys.exit("bench_mesh: a configuration's tokens differ from one device's (or it compiled after warm-up)")
    publish(__file__, "bench_mesh: the decoder by mesh shape on CPU devices",
            f"{ARGS.devices} CPU devices on the host's cores (XLA_FLAGS device count), "
            f"{'tiny random models' if ARGS.dry_run else 'demo pair'}, batch {ARGS.batch}, k = {ARGS.k}, "
            f"{ARGS.max_new_tokens} new tokens, greedy, compilation excluded, median of {ARGS.rounds} rounds run "
            "round-robin; times are relative only (all devices share the CPU, which other jobs also used). ",
            table, append=ARGS.append)


if __name__ == "__main__":
    main()
