"""KV blocks on demand against blocks reserved up front, on a fixed pool: requests ask for
``--max-tokens`` (1024) and end after ~100 tokens (80 to 120: the driver aborts each once it has emitted
its length, as an eos would end it). Reports the requests running at once (most, and mean over the
steps), preemptions, output tokens/s (compilation excluded) and the wall time of the stream, on the
demo pair with a draft model (k = 4), both modes in one process on one decoder.

Reserved up front is what the engine did before blocks came on demand: a request reserved the blocks of
prompt + max_tokens - 1 positions when admitted, so the pool ran ``num_blocks // worst case`` requests
at once; the benchmark runs that admission as a cap on the running requests (``max_num_seqs``).

    python benchmarks/bench_memory.py --append

``--window W``: both models attend within W positions on every layer (the demo pair's weights; the
tokens differ from the full models'), and the requests end after 300-400 tokens: blocks kept for a
request's whole context against blocks behind every window given back (``RequestBatch.release_behind``),
both on demand, on one decoder.

``--dry-run``: 6 requests of 8 tokens on a small pool, nothing appended (a check that the script runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scv_jax import DecoderConfig, Engine, SamplingParams, SpeculativeDecoder  # noqa: E402
from scv_jax.demo.e2e import benchmark_prompts  # noqa: E402
from scv_jax.demo.report import append_markdown, results_header  # noqa: E402
from scv_jax.models import Transformer, load_demo  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
BLOCK_SIZE = DecoderConfig.block_size


def workload(num: int, max_tokens: int, stop: tuple[int, int], seed: int) -> list[tuple[list[int], SamplingParams, int]]:
    """(prompt of 16-64 tokens, params asking for ``max_tokens``, the tokens after which it ends)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(16, 65, num)
    prompts = [p[:n] for p, n in zip(benchmark_prompts(num, 64, seed=seed), lengths.tolist())]
    ends = rng.integers(stop[0], stop[1] + 1, num)
    return [(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True), int(e)) for p, e in zip(prompts, ends)]


def windowed(model: Transformer, window: int) -> Transformer:
    """``model``'s weights, every layer attending within ``window`` positions."""
    copy = Transformer(dataclasses.replace(model.config, sliding_window=window, sliding_layers=None), rngs=nnx.Rngs(0))
    nnx.update(copy, nnx.state(model))
    return copy


def run(engine: Engine, requests, max_steps: int) -> dict[str, float]:
    """All ``requests`` at once; each aborted once it emitted its length. The mode's figures."""
    ends, emitted = {}, {}
    for i, (prompt, params, end) in enumerate(requests):
        engine.add_request(prompt, params, str(i))
        ends[str(i)], emitted[str(i)] = end, 0
    running, start, steps = [], time.perf_counter(), 0
    while engine.has_unfinished() and steps < max_steps:
        for out in engine.step():
            emitted[out.request_id] = len(out.token_ids)
            if not out.finished and len(out.token_ids) >= ends[out.request_id]:
                engine.abort(out.request_id)
        running.append(engine.num_running)
        steps += 1
    if engine.has_unfinished():
        raise SystemExit(f"bench_memory: the stream did not end in {max_steps} steps")
    wall = time.perf_counter() - start
    stats = engine.stats
    tokens = sum(min(emitted[r], ends[r]) for r in ends)
    return dict(most=max(running), mean=float(np.mean(running)), preemptions=stats.num_preemptions,
                tokens=tokens, tok_s=tokens / max(wall - stats.compile_seconds, 1e-9), wall=wall,
                compile=stats.compile_seconds, steps=steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--pool-requests", type=int, default=4,
                        help="the pool holds this many worst-case requests (prompt + max_tokens)")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--window", type=int, default=None,
                        help="every layer attends within this many positions: blocks kept vs given back")
    parser.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    stop = (80, 120) if args.window is None else (300, 400)
    if args.dry_run:
        args.num_requests, args.max_tokens, args.pool_requests, args.max_num_seqs, stop = 6, 24, 2, 4, (6, 8)
        args.window = args.window and 8
    max_len = 64 + args.max_tokens
    worst = -(-max_len // BLOCK_SIZE)
    num_blocks = args.pool_requests * worst
    buckets = tuple(b for b in (1, 2, 4, 8, 16, 32) if b < args.max_num_seqs) + (args.max_num_seqs,)
    target, draft = load_demo()
    if args.window is not None:
        target, draft = windowed(target, args.window), windowed(draft, args.window)
    config = DecoderConfig(k=args.k, num_blocks=num_blocks, max_seq_len=max_len, batch_buckets=buckets)
    decoder = SpeculativeDecoder(target, draft, config=config)
    requests = workload(args.num_requests, args.max_tokens, stop, args.seed)
    if args.window is None:      # mode: (max_num_seqs, the blocks behind the windows given back)
        modes = {f"reserved up front ({args.pool_requests} at once)": (args.pool_requests, False),
                 f"on demand (max_num_seqs {args.max_num_seqs})": (args.max_num_seqs, False)}
    else:
        modes = {f"window {args.window}, every block kept": (args.max_num_seqs, False),
                 f"window {args.window}, blocks behind it given back": (args.max_num_seqs, True)}
    span, rows = decoder.runner.kv_span, []
    for name, (cap, release) in modes.items():
        decoder.runner.kv_span = span if release else None      # what a new Engine's requests release by
        figures = run(Engine(decoder, max_num_seqs=cap), requests, max_steps=100_000)
        print(f"{name}: {figures}", file=sys.stderr, flush=True)
        rows.append(f"| {name} | {figures['most']} | {figures['mean']:.1f} | {figures['preemptions']} | "
                    f"{figures['tokens']} | {figures['tok_s']:.0f} | {figures['wall']:.1f} | {figures['compile']:.1f} |")
    table = ("| mode | running at most | running, mean over steps | preemptions | output tokens | "
             "output tok/s (compiles excluded) | wall s | of it compiling s |\n|---|---|---|---|---|---|---|---|\n"
             + "\n".join(rows))
    pair = "demo pair" if args.window is None else f"demo pair's weights, every layer windowed (W = {args.window})"
    text = (f"{args.num_requests} requests (prompts 16-64 tokens) asking for max_tokens {args.max_tokens}, each ending "
            f"after {stop[0]}-{stop[1]} tokens; a pool of {num_blocks} blocks of {BLOCK_SIZE} = {args.pool_requests} "
            f"worst cases; {pair}, draft model k = {args.k}, greedy.\n\n{table}\n")
    print(text)
    if args.append and not args.dry_run:
        title = ("KV blocks on demand vs reserved up front" if args.window is None
                 else "Blocks behind every sliding window given back")
        append_markdown(RESULTS, results_header(f"{title} (bench_memory.py)",
                                                "python benchmarks/bench_memory.py " + " ".join(sys.argv[1:])) + text)


if __name__ == "__main__":
    main()
