"""Stalls of running streams while long prompts arrive, with prompts prefilled whole in the step that admits
them (a budget no prompt reaches: what the engine did before chunked prefill) against chunked prefill
under ``DecoderConfig.max_num_batched_tokens`` budgets. ``--streams`` requests decode for the whole run;
once they decode, ``--long`` requests with ``--long-tokens``-token prompts arrive, one every ``--every``
steps. Reports the gaps between the streams' emissions (p50 / p99 / max), the long requests' time to
first token, and the streams' tokens/s, on the demo pair with a draft model (k = 4), every mode in one
process on one decoder (compiled ahead of time, and every mode run once before the timed pass).

    python benchmarks/bench_stalls.py --append

``--dry-run``: a short run on small prompts, nothing appended (a check that the script runs).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scv_jax import DecoderConfig, Engine, SamplingParams, SpeculativeDecoder  # noqa: E402
from scv_jax.demo.e2e import benchmark_prompts  # noqa: E402
from scv_jax.demo.report import append_markdown, results_header  # noqa: E402
from scv_jax.models import load_demo  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
WHOLE = 1 << 20          # a budget no prompt reaches: every prompt prefilled in the step that admits it


def run(engine: Engine, streams: list[list[int]], longs: list[list[int]], every: int, long_tokens: int,
        max_steps: int) -> dict[str, float]:
    """The streams first (as long as the context allows), then the long prompts; the mode's figures."""
    for i, prompt in enumerate(streams):
        params = SamplingParams(max_tokens=engine.config.max_seq_len - len(prompt), ignore_eos=True)
        engine.add_request(prompt, params, f"s{i}")
    for _ in range(max_steps):
        engine.step()
        if not engine.num_prefilling and not engine.num_waiting:
            break
    last = {f"s{i}": time.perf_counter() for i in range(len(streams))}
    gaps, arrived, ttft, stream_tokens = [], {}, [], 0
    start = time.perf_counter()
    for step in range(max_steps):
        if step % every == 0 and len(arrived) < len(longs):
            j = len(arrived)
            engine.add_request(longs[j], SamplingParams(max_tokens=long_tokens, ignore_eos=True), f"l{j}")
            arrived[f"l{j}"] = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.request_id in last and out.new_token_ids:
                gaps.append(now - last[out.request_id])
                last[out.request_id] = now
                stream_tokens += len(out.new_token_ids)
            elif out.request_id in arrived and out.new_token_ids and len(out.token_ids) == len(out.new_token_ids):
                ttft.append(now - arrived[out.request_id])
        if len(ttft) == len(longs):
            break
    else:
        raise SystemExit(f"bench_stalls: the long prompts did not all start in {max_steps} steps")
    wall = time.perf_counter() - start
    for request_id in list(last) + list(arrived):
        engine.abort(request_id)
    engine.step()
    if engine.stats.num_preemptions:
        raise SystemExit("bench_stalls: the pool was too small (preemptions)")
    if engine.stats.compiled:
        raise SystemExit(f"bench_stalls: compiled while timed: {engine.stats.compiled}")
    gaps_ms = np.array(gaps) * 1e3
    return dict(p50=float(np.percentile(gaps_ms, 50)), p99=float(np.percentile(gaps_ms, 99)), max=float(gaps_ms.max()),
                ttft=float(np.mean(ttft)) * 1e3, tok_s=stream_tokens / wall, steps=step + 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--long", type=int, default=3, help="long prompts arriving")
    parser.add_argument("--long-len", type=int, default=2048, help="tokens of each long prompt")
    parser.add_argument("--every", type=int, default=16, help="steps between the long prompts' arrivals")
    parser.add_argument("--budgets", default="128,256,512,1024", help="max_num_batched_tokens of the chunked runs")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    if args.dry_run:
        args.streams, args.long, args.long_len, args.every, args.budgets = 2, 2, 100, 2, "32"
    budgets = [int(b) for b in args.budgets.split(",")]
    max_len = args.long_len + 64
    # no prefix cache: every mode prefills the same prompts, and all of each
    config = DecoderConfig(k=args.k, max_seq_len=max_len, batch_buckets=(1, 2, 4, 8),
                           num_blocks=8 * (max_len // 16 + 8), enable_prefix_caching=False)
    target, draft = load_demo()
    decoder = SpeculativeDecoder(target, draft, config=config)
    decoder.warmup(args.streams + args.long, max_len, progress=True)
    streams = benchmark_prompts(args.streams, 32, seed=1)
    text = bytes(b for p in benchmark_prompts(64, 64, seed=2) for b in p)
    longs = [list((text[i * 97:] + text)[:args.long_len]) for i in range(args.long)]
    rows = []
    for budget in [WHOLE] + budgets:                  # a first pass runs every executable once
        run(Engine(decoder, max_num_batched_tokens=budget), streams, longs, args.every, 4, max_steps=10_000)
    for budget in [WHOLE] + budgets:
        engine = Engine(decoder, max_num_batched_tokens=budget)      # the same executables
        figures = run(engine, streams, longs, args.every, 4, max_steps=10_000)
        name = "whole prompt in one step (before)" if budget == WHOLE else f"chunked, max_num_batched_tokens {budget}"
        print(f"{name}: {figures}", file=sys.stderr, flush=True)
        rows.append(f"| {name} | {figures['p50']:.0f} | {figures['p99']:.0f} | {figures['max']:.0f} | "
                    f"{figures['ttft']:.0f} | {figures['tok_s']:.0f} |")
    table = ("| prefill | stream gap p50 ms | p99 ms | max ms | long prompt TTFT ms (mean) | stream tok/s |\n"
             "|---|---|---|---|---|---|\n" + "\n".join(rows))
    text = (f"{args.streams} streams decoding (greedy, draft model k = {args.k}) while {args.long} prompts of "
            f"{args.long_len} tokens arrive, one every {args.every} steps; prefill_chunk {config.prefill_chunk}; "
            f"demo pair, compiled ahead of time.\n\n{table}\n")
    print(text)
    if args.append and not args.dry_run:
        append_markdown(RESULTS, results_header("Stalls while long prompts arrive: chunked prefill (bench_stalls.py)",
                                                "python benchmarks/bench_stalls.py " + " ".join(sys.argv[1:])) + text)


if __name__ == "__main__":
    main()
