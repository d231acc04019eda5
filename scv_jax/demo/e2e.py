"""End-to-end benchmark: speculative vs autoregressive tokens/s on the demo models (one process).

Used by ``scv-jax bench`` and ``benchmarks/bench_e2e.py``. Every configuration is compiled
(``warmup``) and run once untimed with the same prompts, then timed once.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Sequence

import numpy as np

from scv_jax.decoding.config import DecoderConfig
from scv_jax.decoding.decoder import GenerateOutput, SpeculativeDecoder
from scv_jax.demo.corpus import split_corpus, stdlib_bytes
from scv_jax.demo.report import append_markdown, results_header


@dataclasses.dataclass
class E2ERow:
    batch: int
    temperature: float
    mode: str                      # "autoregressive", "k=4" or "adaptive"
    tokens_per_second: float
    speedup: float                 # vs the autoregressive row of the same batch and temperature
    mean_accepted_length: float
    acceptance: float
    identical: bool | None         # greedy: same tokens as autoregressive; sampling: None


def benchmark_prompts(batch: int, length: int = 48, seed: int = 0) -> list[list[int]]:
    """``batch`` byte prompts cut from held-out standard-library source (line starts)."""
    _, holdout = split_corpus(stdlib_bytes(max_bytes=2_000_000, seed=seed))
    text = bytes(holdout)
    starts = [i + 1 for i in range(len(text) - length) if text[i] == ord("\n")]
    rng = np.random.default_rng(seed)
    return [list(text[s:s + length]) for s in rng.choice(starts, size=batch, replace=False)]


def _timed(decoder: SpeculativeDecoder, prompts, max_new_tokens: int, temperature: float) -> GenerateOutput:
    """One untimed call (compiles what it uses, adapts k) after compiling every k, then the timed call."""
    longest = max(map(len, prompts)) + max_new_tokens + max(decoder.config.allowed_k)
    decoder.warmup(len(prompts), longest, greedy=temperature == 0)
    decoder.generate(prompts, max_new_tokens, temperature=temperature, seed=1)
    return decoder.generate(prompts, max_new_tokens, temperature=temperature, seed=0)


def run_e2e(target, draft, *, batch_sizes: Sequence[int] = (1, 4, 16), temperatures: Sequence[float] = (0.0, 1.0),
            modes: Sequence[int | str] = (2, 4, 8, "adaptive"), max_new_tokens: int = 96,
            progress: bool = True) -> list[E2ERow]:
    """Tokens/s of autoregressive decoding and of speculative decoding per mode, per batch and temperature."""
    base = DecoderConfig(batch_buckets=tuple(sorted(set(batch_sizes))))
    configs = {"autoregressive": base}
    for mode in modes:
        configs[mode if mode == "adaptive" else f"k={mode}"] = (
            dataclasses.replace(base, adaptive=True) if mode == "adaptive" else dataclasses.replace(base, k=int(mode)))
    decoders = {name: SpeculativeDecoder(target, None if name == "autoregressive" else draft, config=config)
                for name, config in configs.items()}
    rows, total = [], len(batch_sizes) * len(temperatures) * len(decoders)
    start = time.perf_counter()
    for batch in batch_sizes:
        prompts = benchmark_prompts(batch)
        for temperature in temperatures:
            reference = None
            for name, decoder in decoders.items():
                out = _timed(decoder, prompts, max_new_tokens, temperature)
                if reference is None:
                    reference = out
                s = out.stats
                rows.append(E2ERow(batch, temperature, name, s.tokens_per_second,
                                   s.tokens_per_second / reference.stats.tokens_per_second,
                                   s.mean_accepted_length, s.acceptance_rate,
                                   out.tokens == reference.tokens if temperature == 0 else None))
                if progress:
                    print(f"[e2e {len(rows)}/{total}] batch {batch} T={temperature:g} {name:14s} "
                          f"{s.tokens_per_second:8.1f} tok/s  x{rows[-1].speedup:.2f}  "
                          f"({time.perf_counter() - start:.0f}s)", file=sys.stderr, flush=True)
    return rows


def format_table(rows: list[E2ERow]) -> str:
    """A markdown table of ``run_e2e`` rows."""
    lines = ["| batch | temperature | mode | tokens/s | vs autoregressive | mean accepted length | acceptance "
             "| identical |",
             "|---:|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        same = "-" if r.identical is None else ("yes" if r.identical else "NO")
        lines.append(f"| {r.batch} | {r.temperature:g} | {r.mode} | {r.tokens_per_second:.1f} | "
                     f"{r.speedup:.2f}x | {r.mean_accepted_length:.2f} | "
                     f"{'-' if np.isnan(r.acceptance) else f'{r.acceptance:.2f}'} | {same} |")
    return "\n".join(lines)


def write_results(path: str, table: str, command: str, max_new_tokens: int) -> None:
    """Appends a ``format_table`` table to the markdown file ``path`` under a results header."""
    append_markdown(path, results_header(
        "End-to-end speculative decoding on the demo models", command,
        f"Byte-level demo target (6 layers, d=384) and draft (1 layer, d=128); {max_new_tokens} new tokens "
        "per request, prompts from held-out stdlib source; compilation excluded. ") + table)
