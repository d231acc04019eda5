"""End-to-end benchmark: speculative vs autoregressive tokens/s on the demo models (one process).

Used by ``scv-jax bench`` and ``benchmarks/bench_e2e.py``. Every configuration is compiled (``warmup``)
and run once untimed with the same prompts (the adaptive controller learns there), then timed
``repeats`` times, interleaved (round r runs every mode once, with seed r, before round r + 1), so the
machine's drifting load hits every mode alike and sampled rows average over texts; a row reports the
median and the spread of its runs.

Workloads: ``"stdlib"``, prompts cut from held-out standard-library source; ``"mixed"``, a batch of 8
with half repetitive prompts (rulers such as ``"####...\\n"``, which both drafters continue almost
perfectly) and half free-form stdlib prompts: requests of very different acceptance in one batch;
``"stream"``, 32 such requests served 8 at a time (``generate(max_num_seqs=8)``: continuous batching,
a finished request's slot goes to the next one), the throughput a server sees.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Sequence

import numpy as np

from scv_jax.decoding.config import DecoderConfig
from scv_jax.decoding.decoder import GenerateOutput, SpeculativeDecoder
from scv_jax.decoding.stats import GenerateStats
from scv_jax.demo import WORKLOADS
from scv_jax.demo.corpus import split_corpus, stdlib_bytes
from scv_jax.demo.report import append_markdown, results_header

MIXED_BATCH = 8
STREAM_REQUESTS = 32     # the stream workload's requests, MIXED_BATCH running at once
_RULERS = (b"#", b"=", b"-", b"*")


@dataclasses.dataclass
class E2ERow:
    workload: str                  # "stdlib", "mixed" or "stream"
    drafter: str                   # "model" (the demo draft) or "ngram" (prompt lookup)
    batch: int                     # requests running at once
    temperature: float
    mode: str                      # "autoregressive", "k=4" or "adaptive"
    tokens_per_second: float       # median over the repeats
    spread: tuple[float, float]    # (min, max) tokens/s over the repeats
    speedup: float                 # median tokens/s / the autoregressive row's median
    mean_accepted_length: float
    acceptance: float
    identical: bool | None         # greedy: same tokens as autoregressive in every run; sampling: None
    host_us_per_step: float        # median over the repeats of the host's own work per step (before the
                                   # step's dispatch and after its fetch)
    wall_minus_device_us: float    # median over the repeats of step wall time - the step's device time
    runs: tuple[float, ...] = ()   # tokens/s of each repeat, in round order


def benchmark_prompts(batch: int, length: int = 48, seed: int = 0) -> list[list[int]]:
    """``batch`` byte prompts cut from held-out standard-library source (line starts)."""
    _, holdout = split_corpus(stdlib_bytes(max_bytes=2_000_000, seed=seed))
    text = bytes(holdout)
    starts = [i + 1 for i in range(len(text) - length) if text[i] == ord("\n")]
    rng = np.random.default_rng(seed)
    return [list(text[s:s + length]) for s in rng.choice(starts, size=batch, replace=False)]


def mixed_prompts(batch: int = MIXED_BATCH, seed: int = 3) -> list[list[int]]:
    """Half repetitive rulers (``"####...\\n"``), half free-form stdlib prompts, interleaved."""
    free = benchmark_prompts(batch - batch // 2, seed=seed)
    rulers = [list(_RULERS[i % len(_RULERS)] * 40 + b"\n") for i in range(batch // 2)]
    return [p for pair in zip(free, rulers) for p in pair] + free[len(rulers):]


def _warm(decoder: SpeculativeDecoder, prompts, batch: int, max_new_tokens: int, temperature: float,
          progress: bool) -> None:
    """Compiles every k for ``batch`` running requests (``progress``: a line per executable on stderr),
    then one untimed call (compiles what it uses, adapts k)."""
    longest = max(map(len, prompts)) + max_new_tokens
    decoder.warmup(batch, longest, temperatures=temperature, progress=progress)
    decoder.generate(prompts, max_new_tokens, temperature=temperature, seed=1000,   # a seed the timed runs do not use
                     max_num_seqs=batch)


def wall_minus_device_us(decoder: SpeculativeDecoder, stats: GenerateStats, greedy: bool, context: int) -> float:
    """Mean over a call's timed steps of step wall time - that shape's device time, in µs, over the shapes
    that ran 90% of the steps (each shape's device time measured now, right after the call, so it
    sees the same machine load)."""
    shapes = sorted(stats.step_seconds.items(), key=lambda item: -item[1][0])
    total, steps, wall, device = sum(v[0] for _, v in shapes), 0, 0.0, 0.0
    for (batch, k), (count, seconds, _) in shapes:
        if steps >= 0.9 * total:
            break
        steps, wall = steps + count, wall + seconds
        device += count * decoder.device_seconds_per_step(batch, k, greedy=greedy, context=context, calls=8,
                                                          repeats=1)
    return (wall - device) / steps * 1e6 if steps else float("nan")


def run_e2e(target, draft, *, batch_sizes: Sequence[int] = (1, 4, 16), temperatures: Sequence[float] = (0.0, 1.0),
            modes: Sequence[int | str] = (2, 4, 8, "adaptive"), max_new_tokens: int = 96, repeats: int = 3,
            drafter: str = "model", workloads: Sequence[str] = ("stdlib",), packed: bool = False,
            k_values: Sequence[int] = DecoderConfig.k_values, progress: bool = True) -> list[E2ERow]:
    """Tokens/s of autoregressive decoding and of speculative decoding per mode, per workload, batch and
    temperature (the mixed and stream workloads: batch 8, greedy), with ``draft`` ("model") or prompt lookup
    ("ngram") drafting; ``repeats`` interleaved timed runs each. ``packed``: every speculative mode
    also runs with ``DecoderConfig(packed_verify=True)`` (modes "k=4 packed", "adaptive packed"). ``k_values``:
    the k the adaptive modes may pick."""
    if drafter not in ("model", "ngram"):
        raise ValueError(f"run_e2e: drafter must be 'model' or 'ngram', got {drafter!r}")
    if not workloads or not set(workloads) <= set(WORKLOADS):
        raise ValueError(f"run_e2e: workloads must name some of {WORKLOADS}, got {workloads!r}")
    shapes = {"mixed": ((MIXED_BATCH,), (0.0,)), "stream": ((MIXED_BATCH,), (0.0,)),
              "stdlib": (tuple(batch_sizes), tuple(temperatures))}
    cases = [(w, b, t) for w in workloads for b in shapes[w][0] for t in shapes[w][1]]
    # a stream admits requests one by one: their prefill runs at batch 1, not padded to the running batch
    buckets = tuple(sorted({b for _, b, _ in cases} | ({1} if "stream" in workloads else set())))
    base = DecoderConfig(batch_buckets=buckets, k_values=tuple(k_values))
    configs = {"autoregressive": base}
    for packing in (False, True) if packed else (False,):
        for mode in modes:
            name = ("adaptive" if mode == "adaptive" else f"k={mode}") + (" packed" if packing else "")
            configs[name] = dataclasses.replace(base, packed_verify=packing,
                                                **(dict(adaptive=True) if mode == "adaptive" else dict(k=int(mode))))
    drafting = draft if drafter == "model" else "ngram"
    rows, start = [], time.perf_counter()

    def report(case: str, message: str) -> None:     # a progress line on stderr
        if progress:
            print(f"{case} {message}  ({time.perf_counter() - start:.0f}s)", file=sys.stderr, flush=True)

    for number, (workload, batch, temperature) in enumerate(cases, 1):
        case = f"[e2e {drafter} {workload}] batch {batch} T={temperature:g}"
        # fresh decoders per case: a case's executables (and the memory XLA:CPU maps for them) go with it
        decoders = {name: SpeculativeDecoder(target, None if name == "autoregressive" else drafting, config=config)
                    for name, config in configs.items()}
        prompts = (benchmark_prompts(batch) if workload == "stdlib"
                   else mixed_prompts(STREAM_REQUESTS if workload == "stream" else batch))
        for i, (name, decoder) in enumerate(decoders.items(), 1):
            report(case, f"case {number}/{len(cases)}: compiling and warming up {name} ({i}/{len(decoders)}) ...")
            _warm(decoder, prompts, batch, max_new_tokens, temperature, progress)
        runs: dict[str, list[GenerateOutput]] = {name: [] for name in decoders}
        hosts: dict[str, list[tuple[float, float]]] = {name: [] for name in decoders}
        for seed in range(repeats):          # round r: every mode with seed r (sampled texts differ by seed)
            report(case, f"timed round {seed + 1}/{repeats} ({len(decoders)} modes) ...")
            for name, decoder in decoders.items():
                out = decoder.generate(prompts, max_new_tokens, temperature=temperature, seed=seed, max_num_seqs=batch)
                out.stats.check_no_fallbacks(f"e2e row {workload} batch {batch} T={temperature} {name}")
                runs[name].append(out)
                own = sum(v[2] for v in out.stats.step_seconds.values()) / max(out.stats.steps, 1) * 1e6
                hosts[name].append((own, wall_minus_device_us(decoder, out.stats, temperature == 0,
                                                              max(map(len, prompts)) + max_new_tokens // 2)))
        reference = float(np.median([o.stats.tokens_per_second for o in runs["autoregressive"]]))
        for name, outs in runs.items():
            speeds = [o.stats.tokens_per_second for o in outs]
            s = outs[-1].stats
            same = (all(o.tokens == ref.tokens for o, ref in zip(outs, runs["autoregressive"]))
                    if temperature == 0 else None)
            rows.append(E2ERow(workload, drafter, batch, temperature, name, float(np.median(speeds)),
                               (min(speeds), max(speeds)), float(np.median(speeds)) / reference,
                               s.mean_accepted_length, s.acceptance_rate, same,
                               *(float(x) for x in np.median(hosts[name], axis=0)), tuple(speeds)))
            report(case, f"{name:14s} {rows[-1].tokens_per_second:8.1f} tok/s  x{rows[-1].speedup:.2f}  host "
                         f"{rows[-1].host_us_per_step:.0f} us/step, wall - device {rows[-1].wall_minus_device_us:.0f} "
                         f"us/step, k histogram {s.k_histogram}")
    return rows


def format_table(rows: list[E2ERow]) -> str:
    """A markdown table of ``run_e2e`` rows (tokens/s: median [min-max] of the repeats)."""
    lines = ["| workload | drafter | batch | temperature | mode | tokens/s | vs autoregressive | mean accepted length "
             "| acceptance | identical | host µs/step | wall - device µs/step |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        same = "-" if r.identical is None else ("yes" if r.identical else "NO")
        lines.append(f"| {r.workload} | {r.drafter} | {r.batch} | {r.temperature:g} | {r.mode} | "
                     f"{r.tokens_per_second:.1f} [{r.spread[0]:.0f}-{r.spread[1]:.0f}] | {r.speedup:.2f}x | "
                     f"{r.mean_accepted_length:.2f} | {'-' if np.isnan(r.acceptance) else f'{r.acceptance:.2f}'} | "
                     f"{same} | {r.host_us_per_step:.0f} | {r.wall_minus_device_us:.0f} |")
    return "\n".join(lines)


def adaptive_summary(rows: list[E2ERow]) -> str:
    """Per workload, batch and temperature: each adaptive mode's tokens/s over the best fixed k's (of
    every fixed mode, packed or not; medians; the runs' spread; and the ratio within each round, which
    the machine's drifting load hits alike), as markdown lines ("" without adaptive and fixed modes)."""
    lines = ["| workload | drafter | batch | temperature | adaptive mode | best fixed k | adaptive / best fixed "
             "(median) | adaptive min / best fixed max | same-round ratios: median [min-max] |",
             "|---|---|---:|---:|---|---|---:|---:|---:|"]
    groups: dict[tuple, list[E2ERow]] = {}
    for r in rows:
        groups.setdefault((r.workload, r.drafter, r.batch, r.temperature), []).append(r)
    for (workload, drafter, batch, temperature), group in groups.items():
        fixed = [r for r in group if r.mode.startswith("k=")]
        if not fixed:
            continue
        best = max(fixed, key=lambda r: r.tokens_per_second)
        for adaptive in (r for r in group if r.mode.startswith("adaptive")):
            paired = [a / b for a, b in zip(adaptive.runs, best.runs)] or [float("nan")]
            lines.append(f"| {workload} | {drafter} | {batch} | {temperature:g} | {adaptive.mode} | {best.mode} | "
                         f"{adaptive.tokens_per_second / best.tokens_per_second:.2f} | "
                         f"{adaptive.spread[0] / best.spread[1]:.2f} | "
                         f"{np.median(paired):.2f} [{min(paired):.2f}-{max(paired):.2f}] |")
    return "\n".join(lines) if len(lines) > 2 else ""


def write_results(path: str, table: str, command: str, max_new_tokens: int, repeats: int) -> None:
    """Appends a ``format_table`` table to the markdown file ``path`` under a results header."""
    append_markdown(path, results_header(
        "End-to-end speculative decoding on the demo models", command,
        f"Byte-level demo target (6 layers, d=384) and draft (1 layer, d=128) or n-gram prompt lookup; "
        f"{max_new_tokens} new tokens per request; compilation excluded; median [min-max] of {repeats} "
        "interleaved runs; host µs/step: the host's own work per step (before the step's dispatch and after "
        "its fetch); wall - device: step wall time - the step executable's own time (called alone on "
        "device-resident inputs and waited for). ") + table)
