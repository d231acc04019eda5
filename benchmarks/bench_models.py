"""Speculative decoding at realistic model sizes: random bf16 weights in the shapes of Qwen2.5-0.5B,
Llama-3.2-1B and Llama-3.1-8B (configs below, no download), made on the device.

For every (model, drafter, batch, k) it runs the decoder after warm-up and reports per row:
ms per step (median of 3 timed calls), tokens per step and tokens/s (random weights: drafts are rarely
accepted, so these say little about speculation), c(k) = the speculative step's cost / the autoregressive step's cost at the same batch
size, the speedup c(k) implies at per-draft acceptance 0.6 and 0.8 (expected tokens per step
(1 - a^(k+1)) / (1 - a), over c(k)), the fraction of the memory-bound floor (bytes a step must read:
parameters, plus KV of the context, over the measured copy bandwidth, divided by the step time) and
the compile seconds of the step executables.

Drafters (``--drafters``): ``2-layer``, a 2-layer model of the target's width (its own paged cache), on
random prompts; ``n-gram``, prompt lookup (no draft model), on prompts that repeat one 16-token pattern, so
every step has k drafts to verify (random weights reject them: these rows time the verify step).

    python benchmarks/bench_models.py [--models llama-1b ...] [--batch-sizes 1 8 32] [--ks 2 4 8]
                                      [--drafters 2-layer n-gram] [--context 512] [--new-tokens 64] [--append]
    python benchmarks/bench_models.py --dry-run      # tiny shapes on CPU (CI)

On CPU only the dry run is practical; the real sizes are meant for a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax
import numpy as np
from flax import nnx

from harness import copy_bandwidth, publish
from scv_jax.decoding.config import DecoderConfig
from scv_jax.decoding.decoder import SpeculativeDecoder
from scv_jax.decoding.proposers.ngram import NgramDrafter
from scv_jax.models import Llama3RopeScaling, Transformer, TransformerConfig

LLAMA3_ROPE = Llama3RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position_embeddings=8192)
MODELS: dict[str, TransformerConfig] = {
    "qwen2.5-0.5b": TransformerConfig(vocab_size=151936, num_layers=24, d_model=896, num_heads=14, num_kv_heads=2,
                                      head_dim=64, ffn_dim=4864, rope_theta=1e6, norm_eps=1e-6, tie_embeddings=True,
                                      dtype="bfloat16", qkv_bias=True),
    "llama-1b": TransformerConfig(vocab_size=128256, num_layers=16, d_model=2048, num_heads=32, num_kv_heads=8,
                                  head_dim=64, ffn_dim=8192, rope_theta=5e5, norm_eps=1e-5, tie_embeddings=True,
                                  dtype="bfloat16", rope_scaling=LLAMA3_ROPE),
    "llama-8b": TransformerConfig(vocab_size=128256, num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8,
                                  head_dim=128, ffn_dim=14336, rope_theta=5e5, norm_eps=1e-5, tie_embeddings=False,
                                  dtype="bfloat16", rope_scaling=dataclasses.replace(LLAMA3_ROPE, factor=8.0)),
}
DRY_RUN_MODELS = {"tiny": TransformerConfig(vocab_size=512, num_layers=4, d_model=64, num_heads=4, num_kv_heads=2,
                                            head_dim=16, ffn_dim=128, dtype="bfloat16")}
BLOCK_SIZE = 16
ACCEPTANCE_LEVELS = (0.6, 0.8)
DRAFTERS = ("2-layer", "n-gram")
PATTERN = 16                     # the n-gram rows' prompts repeat a pattern of this many tokens


@dataclasses.dataclass
class Row:
    model: str
    drafter: str                 # "-" for autoregressive
    batch: int
    k: int
    ms_per_step: float
    tokens_per_step: float       # emitted tokens per request per step
    tokens_per_second: float
    cost_ratio: float            # c(k): step cost / autoregressive step cost (1 for autoregressive)
    floor_fraction: float        # memory-bound floor seconds / measured step seconds
    compile_seconds: float


def random_model(config: TransformerConfig, seed: int) -> Transformer:
    """A model with random weights, created on the default device (never materialised on the host)."""
    return nnx.jit(lambda: Transformer(config, rngs=nnx.Rngs(seed)))()


def two_layer_draft(config: TransformerConfig) -> TransformerConfig:
    return dataclasses.replace(config, num_layers=2)


def parameter_bytes(model: Transformer) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def kv_bytes_per_token(config: TransformerConfig) -> int:
    """Bytes of one token's K and V over all layers in a bf16 cache."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens per step with k drafts each accepted with probability ``acceptance`` (until the first
    rejection), plus the bonus/correction token."""
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


TIMED_CALLS = 3


def measure(decoder: SpeculativeDecoder, prompts: list[list[int]], new_tokens: int
            ) -> tuple[float, float, float, float]:
    """(seconds per decode step, tokens per step, tokens/s, compile seconds): warm-up, one untimed call,
    then the median step time of ``TIMED_CALLS`` timed calls."""
    start = time.perf_counter()
    decoder.warmup(len(prompts), max(map(len, prompts)) + new_tokens + max(decoder.config.allowed_k))
    compile_seconds = time.perf_counter() - start
    decoder.generate(prompts, new_tokens, seed=1)
    runs = [decoder.generate(prompts, new_tokens, seed=seed).stats for seed in range(TIMED_CALLS)]
    for stats in runs:
        stats.check_no_fallbacks(f"bench_models batch {len(prompts)} k {decoder.config.allowed_k}")
    step_seconds = [(s.wall_seconds - s.prefill_seconds - s.compile_seconds) / s.steps for s in runs]
    median = runs[int(np.argsort(step_seconds)[len(runs) // 2])]
    seconds = float(np.median(step_seconds))
    return seconds, median.mean_accepted_length, median.mean_accepted_length * len(prompts) / seconds, compile_seconds


def prompts_for(drafter: str, batch: int, context: int, vocab: int) -> list[list[int]]:
    """Random prompts; for ``n-gram``, each a random 16-token pattern repeated (a lookup always matches)."""
    rng = np.random.default_rng(batch)
    if drafter == "n-gram":
        return np.tile(rng.integers(0, vocab, (batch, PATTERN)), -(-context // PATTERN))[:, :context].tolist()
    return rng.integers(0, vocab, (batch, context)).tolist()


def run(models: dict[str, TransformerConfig], batch_sizes, ks, drafters, context: int, new_tokens: int,
        bandwidth: float, backend: str) -> list[Row]:
    rows = []
    for name, config in models.items():
        target = random_model(config, seed=0)
        draft = random_model(two_layer_draft(config), seed=1) if "2-layer" in drafters else None
        target_bytes = parameter_bytes(target)
        draft_bytes = parameter_bytes(draft) if draft is not None else 0
        for batch in batch_sizes:
            max_len = context + new_tokens + max(ks)
            geometry = dict(block_size=BLOCK_SIZE, max_seq_len=max_len, num_blocks=batch * -(-max_len // BLOCK_SIZE),
                            cache_dtype="bfloat16", batch_buckets=(batch,), prefill_chunk=256, backend=backend,
                            context_buckets=(-(-max_len // BLOCK_SIZE),))
            kv_bytes = batch * (context + new_tokens // 2) * kv_bytes_per_token(config)
            draft_kv_bytes = batch * (context + new_tokens // 2) * kv_bytes_per_token(two_layer_draft(config))
            base = None
            for drafter, k in [("-", 0)] + [(d, k) for d in drafters for k in ks]:
                prompts = prompts_for(drafter, batch, context, config.vocab_size)
                drafting = {"-": None, "2-layer": draft, "n-gram": NgramDrafter()}[drafter]
                decoder = SpeculativeDecoder(target, drafting, config=DecoderConfig(k=k, **geometry))
                step_seconds, tokens_per_step, tokens_per_second, compile_seconds = measure(
                    decoder, prompts, new_tokens)
                base = base or step_seconds
                drafting_bytes = k * (draft_bytes + draft_kv_bytes) if drafter == "2-layer" else 0
                floor_bytes = target_bytes + kv_bytes + drafting_bytes
                rows.append(Row(name, drafter, batch, k, step_seconds * 1e3, tokens_per_step, tokens_per_second,
                                step_seconds / base, floor_bytes / bandwidth / step_seconds, compile_seconds))
                print(f"[bench_models] {name} {drafter} batch {batch} k={k}: {step_seconds * 1e3:.2f} ms/step, "
                      f"c={rows[-1].cost_ratio:.2f}", file=sys.stderr, flush=True)
    return rows


def format_table(rows: list[Row]) -> str:
    head = ("| model | drafter | batch | k | ms/step | tokens/step | tokens/s | c(k) | "
            + " | ".join(f"speedup @ a={a}" for a in ACCEPTANCE_LEVELS)
            + " | % of memory-bound floor | compile s |")
    lines = [head, "|" + "---|" * (10 + len(ACCEPTANCE_LEVELS))]
    for r in rows:
        implied = " | ".join(f"{expected_tokens(a, r.k) / r.cost_ratio:.2f}x" if r.k else "1.00x"
                             for a in ACCEPTANCE_LEVELS)
        lines.append(f"| {r.model} | {r.drafter} | {r.batch} | {r.k} | {r.ms_per_step:.2f} | "
                     f"{r.tokens_per_step:.2f} | {r.tokens_per_second:.0f} | {r.cost_ratio:.2f} | {implied} | {100 * r.floor_fraction:.0f}% | "
                     f"{r.compile_seconds:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--drafters", nargs="+", choices=DRAFTERS, default=list(DRAFTERS))
    parser.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    parser.add_argument("--new-tokens", type=int, default=64, help="generated tokens per request (timed)")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU with the XLA ops (CI)")
    parser.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    if args.dry_run:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        models, batch_sizes, ks, context, new_tokens = DRY_RUN_MODELS, (2,), (2,), 24, 8
        bandwidth = copy_bandwidth(1 << 24, repeats=3, inner=2)
    else:
        models = {name: MODELS[name] for name in args.models}
        batch_sizes, ks, context, new_tokens = args.batch_sizes, args.ks, args.context, args.new_tokens
        bandwidth = copy_bandwidth()
    rows = run(models, batch_sizes, ks, args.drafters, context, new_tokens, bandwidth, "xla" if args.dry_run else "auto")
    publish(__file__, "bench_models: speculative decoding at realistic sizes (random bf16 weights)",
            f"Context {context} prompt tokens, {new_tokens} new tokens per request; memory-bound floor = "
            f"(parameter bytes + KV bytes read) / measured copy bandwidth {bandwidth / 1e9:.0f} GB/s. ",
            format_table(rows), append=args.append)


if __name__ == "__main__":
    main()
