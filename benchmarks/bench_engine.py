"""Online decoding with ``scv_jax.Engine``: requests arriving as a Poisson process (prompt and output
lengths from a fixed seed), each with its own sampling parameters, speculative (draft model, n-gram,
adaptive) against target-only, on the demo pair. Reports per mode time to first token (TTFT), time per
output token after the first (TPOT, per request), p50 / p99, requests/s and output tokens/s; every mode
decodes the same arrivals in one process, after a warm-up that compiles every executable.

    python benchmarks/bench_engine.py --rate 8 --num-requests 48 --append

``--dry-run``: 4 requests of 8 tokens, one batch bucket, adaptive k from (0, 4), no warm-up, nothing appended (a
check that the script runs).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scv_jax import DecoderConfig, Engine, SamplingParams  # noqa: E402
from scv_jax.demo.e2e import benchmark_prompts  # noqa: E402
from scv_jax.demo.report import append_markdown, results_header  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
MODES = {"target only": dict(draft=None, k=0), "draft model k=4": dict(draft="model", k=4),
         "n-gram k=4": dict(draft="ngram", k=4), "draft model adaptive": dict(draft="model", adaptive=True)}


def workload(num: int, rate: float, seed: int, max_output: int, sampled: float) -> list[tuple[float, list[int], SamplingParams]]:
    """(arrival seconds, prompt, params) of ``num`` requests: Poisson arrivals at ``rate`` per second,
    prompts of 16-96 tokens, outputs of max_output / 4 to max_output tokens, a ``sampled`` fraction at
    temperature 0.8 with top-p 0.95 (the others greedy)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, num)) if rate > 0 else np.zeros(num)
    lengths = rng.integers(16, 97, num)
    prompts = [p[:n] for p, n in zip(benchmark_prompts(num, 96, seed=seed), lengths.tolist())]
    outputs = rng.integers(max(max_output // 4, 1), max_output + 1, num)
    hot = rng.random(num) < sampled
    return [(float(t), p, SamplingParams(temperature=0.8 if s else 0.0, top_p=0.95 if s else 1.0, seed=i,
                                          max_tokens=int(m), ignore_eos=True))
            for i, (t, p, m, s) in enumerate(zip(arrivals, prompts, outputs, hot))]


def run_mode(engine: Engine, requests, max_steps: int) -> dict[str, float]:
    """Replays ``requests`` against ``engine`` in real time; the latency figures of the mode."""
    first, done, counts, arrived = {}, {}, {}, {}
    start, pending, steps = time.perf_counter(), list(enumerate(requests)), 0
    while (pending or engine.has_unfinished()) and steps < max_steps:
        now = time.perf_counter() - start
        while pending and pending[0][1][0] <= now:
            i, (when, prompt, params) = pending.pop(0)
            engine.add_request(prompt, params, str(i))
            arrived[str(i)] = start + when
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0][1][0] - now))
            continue
        outputs = engine.step()
        steps += 1
        stamp = time.perf_counter()
        for out in outputs:
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = stamp
            if out.finished:
                done[out.request_id], counts[out.request_id] = stamp, len(out.token_ids)
    if len(done) != len(requests):
        raise RuntimeError(f"{len(done)} of {len(requests)} requests finished in {max_steps} steps")
    wall = max(done.values()) - start
    ttft = np.array([first[r] - arrived[r] for r in done]) * 1e3
    tpot = np.array([(done[r] - first[r]) / max(counts[r] - 1, 1) for r in done]) * 1e3
    tokens = sum(counts.values())
    return dict(ttft_p50=np.percentile(ttft, 50), ttft_p99=np.percentile(ttft, 99), tpot_p50=np.percentile(tpot, 50),
                tpot_p99=np.percentile(tpot, 99), requests_per_s=len(done) / wall, tokens_per_s=tokens / wall,
                steps=steps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--rate", type=float, default=8.0, help="requests per second (0: all at once)")
    parser.add_argument("--max-output", type=int, default=96)
    parser.add_argument("--sampled", type=float, default=0.5, help="fraction of sampled requests")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.num_requests, args.max_output, args.rate, args.max_num_seqs = 4, 8, 0.0, 4
    from scv_jax.models import load_demo

    target, draft = load_demo()
    requests = workload(args.num_requests, args.rate, args.seed, args.max_output, args.sampled)
    longest = max(len(p) + s.max_tokens for _, p, s in requests)
    rows = []
    # a dry run pads every step to one batch bucket: each executable compiles once, not again as requests finish
    buckets = (args.max_num_seqs,) if args.dry_run else (1, 2, 4, 8)
    # and an adaptive decoder there picks k from (0, 4): its controller times (so compiles) each k it may pick,
    # the default (0, 2, 4, 6, 8) more decode steps for the same code (adaptive mode alone: 15 s -> 8 s on CPU)
    k_values = dict(k_values=(0, 4)) if args.dry_run else {}
    for name in args.modes:
        mode = MODES[name]
        config = DecoderConfig(k=mode.get("k", 4), adaptive=mode.get("adaptive", False), max_seq_len=256,
                               num_blocks=512, batch_buckets=buckets, **k_values)
        drafter = {"model": draft, "ngram": "ngram", None: None}[mode["draft"]]
        engine = Engine(target, drafter, config=config, max_num_seqs=args.max_num_seqs)
        if not args.dry_run:
            print(f"[{name}] warm-up ...", file=sys.stderr, flush=True)
            engine.warmup(args.max_num_seqs, longest, temperatures=(0.0, 0.8))
            run_mode(engine, requests[:args.max_num_seqs], 100_000)      # the controller's first timings
        print(f"[{name}] {len(requests)} requests ...", file=sys.stderr, flush=True)
        figures = run_mode(engine, requests, 100_000)
        if engine.num_free_blocks != engine.num_blocks or engine.stats.compiled and not args.dry_run:
            raise RuntimeError(f"{name}: blocks not returned or compiled after warm-up: {engine.stats.compiled}")
        rows.append((name, figures))
    base = rows[0][1]["tokens_per_s"]
    lines = ["| mode | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | requests/s | output tok/s | vs first row | steps |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, f in rows:
        lines.append(f"| {name} | {f['ttft_p50']:.0f} / {f['ttft_p99']:.0f} | {f['tpot_p50']:.1f} / {f['tpot_p99']:.1f} "
                     f"| {f['requests_per_s']:.2f} | {f['tokens_per_s']:.0f} | {f['tokens_per_s'] / base:.2f}x "
                     f"| {f['steps']:.0f} |")
    table = "\n".join(lines)
    print(table)
    if args.append and not args.dry_run:
        command = "python benchmarks/bench_engine.py " + " ".join(argv if argv is not None else sys.argv[1:])
        details = (f"demo pair, float32, {args.num_requests} requests at {args.rate:g}/s (Poisson, seed {args.seed}), "
                   f"prompts 16-96 tokens, outputs {max(args.max_output // 4, 1)}-{args.max_output} tokens "
                   f"(ignore_eos), {args.sampled:.0%} sampled (T 0.8, top-p 0.95), at most {args.max_num_seqs} "
                   "running; one process, same arrivals per mode, after warm-up.")
        append_markdown(RESULTS, results_header("bench_engine: online requests on the Engine", command, details)
                        + "\n" + table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
