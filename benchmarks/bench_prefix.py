"""Prefix caching with and without speculation: the prefix-cache hit rate (tokens found / tokens looked
up) and the time to first token (TTFT) of two workloads, with the cache off and on, for the target
alone, a draft model (k = 4), n-gram drafts (k = 4), draft-model trees and the demo's EAGLE-3 head
(chains, k = 4, and trees), on the demo pair:

- shared system prompt: requests of one system prompt + a user message each;
- multi-turn chat: conversations whose every turn's prompt is the last prompt + its answer + a new
  message (turn 1 of every conversation, then turn 2, ...).

Requests run one at a time (TTFT is the request's own prefill and first step). Each decoder runs the
workload once untimed (it compiles its shapes), then, with its prefix cache emptied
(``Engine.reset_prefix_cache``), timed. The hit rates with the cache on must be equal with and without
speculation: drafts never reach a cache. With an EAGLE head a block is cached under its tokens and the
token after it (the head's row at its last position pairs it with that token), so a block that ends
exactly where prompts start to differ (the shared system prompt's last, 384 tokens = 24 blocks) is
shared only between prompts that agree on the next token: there the head's rate may be lower (it is
reported, and must not be higher); a chat's turns extend the last turn's tokens, so there it must be
equal too.

    python benchmarks/bench_prefix.py --append
    python benchmarks/bench_prefix.py --modes "target only" "EAGLE-3 head k=4" "EAGLE-3 head tree" --append

``--dry-run``: tiny workloads, target alone and a draft model, nothing appended.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scv_jax import DecoderConfig, Engine, SamplingParams, SpeculativeDecoder, TreeConfig  # noqa: E402
from scv_jax.demo.e2e import benchmark_prompts  # noqa: E402
from scv_jax.demo.report import append_markdown, results_header  # noqa: E402
from scv_jax.models import load_demo, load_demo_head  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")


def run_one(engine: Engine, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    """One request alone: its tokens and its TTFT (seconds)."""
    start = time.perf_counter()
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    first, tokens = None, []
    for _ in range(10 * max_tokens + 10):
        if not engine.has_unfinished():
            return tokens, first
        for out in engine.step():
            if out.request_id == request_id and out.new_token_ids:
                first = first or time.perf_counter() - start
                tokens = list(out.token_ids)
    raise SystemExit("bench_prefix: a request did not end")


def shared_prompt(engine: Engine, args) -> list[float]:
    system = benchmark_prompts(1, args.system_tokens, seed=1)[0]
    messages = benchmark_prompts(args.requests, 32, seed=2)
    return [run_one(engine, system + m[:16 + i % 17], args.max_tokens)[1] for i, m in enumerate(messages)]


def chat(engine: Engine, args) -> list[float]:
    messages = benchmark_prompts(args.conversations * (args.turns + 1), 24, seed=3)
    prompts = [messages[c] for c in range(args.conversations)]
    ttft = []
    for turn in range(args.turns):
        for c in range(args.conversations):
            answer, seconds = run_one(engine, prompts[c], args.max_tokens)
            ttft.append(seconds)
            prompts[c] = prompts[c] + answer + messages[(turn + 1) * args.conversations + c]
    return ttft


WORKLOADS = {"shared system prompt": shared_prompt, "multi-turn chat": chat}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16, help="shared system prompt: requests")
    parser.add_argument("--system-tokens", type=int, default=384)
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    parser.add_argument("--modes", nargs="+", default=None, help="the drafters to run (default: all)")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    target, draft = load_demo()
    head, tree = load_demo_head(target), TreeConfig(max_depth=4, branching=2, max_nodes=8)
    modes = {"target only": (None, dict(k=0)), "draft model k=4": (draft, dict(k=4)),
             "n-gram k=4": ("ngram", dict(k=4)), "draft-model tree": (draft, dict(tree=tree)),
             "EAGLE-3 head k=4": (head, dict(k=4)), "EAGLE-3 head tree": (head, dict(tree=tree))}
    if args.modes:
        unknown = set(args.modes) - set(modes)
        if unknown:
            raise SystemExit(f"bench_prefix: --modes must name some of {list(modes)}, got {sorted(unknown)}")
        modes = {name: modes[name] for name in args.modes}
    if args.dry_run:
        args.requests, args.system_tokens, args.conversations, args.turns, args.max_tokens = 3, 40, 2, 2, 6
        modes = {name: modes[name] for name in ("target only", "EAGLE-3 head k=4")}
    max_len = max(args.system_tokens + 48, args.turns * (24 + args.max_tokens) + 8) + args.max_tokens
    rows, rates = [], {}
    for workload, run in WORKLOADS.items():
        for name, (drafter, fields) in modes.items():
            for caching in (False, True):
                config = DecoderConfig(**fields, max_seq_len=max_len, num_blocks=8 * -(-max_len // 16),
                                       batch_buckets=(1,), enable_prefix_caching=caching)
                engine = Engine(SpeculativeDecoder(target, drafter, config=config), max_num_seqs=1)
                run(engine, args)                      # compiles this decoder's shapes
                engine.reset_prefix_cache()
                engine.stats.prefix_cache_queries = engine.stats.prefix_cache_hits = 0
                start = time.perf_counter()
                ttft = np.array(run(engine, args)) * 1000
                wall = time.perf_counter() - start
                stats = engine.stats
                rate = stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1)
                if caching:
                    rates.setdefault(workload, {})[name] = round(rate, 6)
                line = (f"| {workload} | {name} | {'on' if caching else 'off'} | {rate:.1%} | "
                        f"{np.median(ttft):.1f} | {np.percentile(ttft, 90):.1f} | {wall:.1f} |")
                print(line, file=sys.stderr, flush=True)
                rows.append(line)
    lookahead = {"EAGLE-3 head k=4", "EAGLE-3 head tree"}       # blocks hashed with the token after them
    equal = all(len({r for n, r in by_name.items() if w == "multi-turn chat" or n not in lookahead}) <= 1
                for w, by_name in rates.items())
    plain = {w: max((r for n, r in by_name.items() if n not in lookahead), default=1.0)
             for w, by_name in rates.items()}
    equal = equal and all(r <= plain[w] for w, by_name in rates.items() for n, r in by_name.items() if n in lookahead)
    table = ("| workload | drafter | prefix cache | hit rate (tokens) | TTFT p50 ms | TTFT p90 ms | wall s |\n"
             "|---|---|---|---|---|---|---|\n" + "\n".join(rows))
    text = (f"Shared system prompt: {args.requests} requests of a {args.system_tokens}-token system prompt + "
            f"16-32 tokens; multi-turn chat: {args.conversations} conversations x {args.turns} turns (+ 24 tokens "
            f"a message); {args.max_tokens} output tokens a request, one request at a time; demo pair, float32, "
            f"greedy.\n\n{table}\n\nHit rates with the cache on equal with and without speculation (an EAGLE head's "
            f"in the chat; at most equal with a shared system prompt): {'yes' if equal else 'NO'} ({rates}).\n")
    print(text)
    if not equal:
        raise SystemExit("bench_prefix: the hit rates differ between drafters")
    if args.append and not args.dry_run:
        append_markdown(RESULTS, results_header("Prefix caching with and without speculation (bench_prefix.py)",
                                                "python benchmarks/bench_prefix.py " + " ".join(sys.argv[1:])) + text)


if __name__ == "__main__":
    main()
