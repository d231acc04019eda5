"""Suffix decoding (``scv_jax.SuffixDrafter``) against n-gram prompt lookup, the demo draft model and the
target alone, on the demo pair, three workloads served one request after another through one engine
(the suffix drafter's cache of finished outputs learns across them), greedy:

* ``stdlib``: distinct held-out standard-library prompts (nothing repeats across requests);
* ``repeated``: requests drawn from 8 prompt families, each request its family's prompt with a few bytes
  changed (agent loops, batch jobs);
* ``editing``: a source snippet, a blank line and the snippet's first line again (the target's greedy
  continuation echoes the snippet with small changes, as an editing answer does).

Modes: the target alone, n-gram (``NgramDrafter(1, 3)``) and suffix chains of ``--k`` drafts, the draft
model at ``--k-model``, and suffix trees (``--k`` deep, 2 x ``--k`` nodes).

Each round draws new prompts (seed = round), so no mode sees a request it served in an earlier round;
modes run interleaved, round by round, after a warm-up that compiles every executable. Reported per
workload and mode: tokens/s (median over rounds), mean accepted length (tokens per request per decode
step), and the ratio to n-gram's tokens/s; greedy outputs are checked against the target's alone.

``--host-cost``: the drafter's host work alone (no model): µs per request per step to propose for a
batch of 64 requests (``--batch``) whose histories are 1k, 8k and 32k tokens (``--histories``) of
standard-library text, µs per token to
index a prompt and to extend, and the memory (tracemalloc) of the finished-output cache holding
``--cached`` requests of 256 tokens.

    python benchmarks/bench_suffix.py [--rounds 3] [--requests 64] [--append]
    python benchmarks/bench_suffix.py --host-cost [--append]

``--dry-run``: a tiny random pair and few requests (a check that the script runs; nothing appended).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import tracemalloc

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scv_jax import DecoderConfig, Engine, NgramDrafter, SamplingParams, SuffixDrafter, TreeConfig  # noqa: E402
from scv_jax.demo.corpus import split_corpus, stdlib_bytes  # noqa: E402
from scv_jax.demo.report import append_markdown, results_header  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
WORKLOADS = ("stdlib", "repeated", "editing")
MAX_LEN = 384                # the longest prompt (editing: about 250 bytes) + max tokens


def source_lines(seed: int) -> list[bytes]:
    """Held-out standard-library lines of 8+ bytes (a fixed selection per seed)."""
    _, holdout = split_corpus(stdlib_bytes(max_bytes=2_000_000, seed=0))
    lines = [line for line in bytes(holdout).split(b"\n") if len(line.strip()) >= 8]
    rng = np.random.default_rng(seed)
    return [lines[i] for i in rng.permutation(len(lines))]


def snippet(lines: list[bytes], start: int, size: int) -> bytes:
    """About ``size`` bytes of consecutive lines from ``start``."""
    out = b""
    for line in lines[start:]:
        if len(out) >= size:
            break
        out += line + b"\n"
    return out[:size]


def prompts_of(workload: str, num: int, seed: int) -> list[list[int]]:
    """``num`` byte prompts of a workload (see the module docstring), fixed by ``seed``."""
    rng, lines = np.random.default_rng(seed), source_lines(seed)
    if workload == "stdlib":
        return [list(snippet(lines, 8 * i, 64)) for i in range(num)]
    if workload == "repeated":
        families = [bytearray(snippet(lines, 8 * i, 64)) for i in range(8)]
        out = []
        for _ in range(num):
            prompt = bytearray(families[rng.integers(8)])
            for at in rng.choice(len(prompt), size=2, replace=False):
                prompt[at] = rng.integers(ord("a"), ord("z") + 1)
            out.append(list(prompt))
        return out
    if workload == "editing":
        out = []
        for i in range(num):
            code = snippet(lines, 8 * i, 160)
            out.append(list(code + b"\n" + code.split(b"\n")[0] + b"\n"))
        return out
    raise ValueError(f"unknown workload {workload!r}")


def serve_one_by_one(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float, int]:
    """Each prompt served alone, in order: (outputs, seconds, decode steps)."""
    outputs, steps, start = [], 0, time.perf_counter()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
        tokens: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                if out.new_token_ids:
                    steps += 1
                tokens = list(out.token_ids)
        outputs.append(tokens)
    return outputs, time.perf_counter() - start, steps


def e2e(args) -> str:
    if args.dry_run:
        from flax import nnx

        from scv_jax.models import Transformer, TransformerConfig
        config = TransformerConfig(vocab_size=256, num_layers=1, d_model=32, num_heads=2, num_kv_heads=1,
                                   head_dim=16, ffn_dim=48)
        target, draft = Transformer(config, rngs=nnx.Rngs(0)), Transformer(config, rngs=nnx.Rngs(1))
    else:
        from scv_jax.models import load_demo
        target, draft = load_demo()
    tree = TreeConfig(max_depth=args.k, max_nodes=2 * args.k)
    modes = {"target only": (None, 0, None), f"n-gram k={args.k}": ("ngram", args.k, None),
             f"draft model k={args.k_model}": ("model", args.k_model, None), f"suffix k={args.k}": ("suffix", args.k, None),
             f"suffix tree ({tree.max_depth} deep, {tree.max_nodes} nodes)": ("suffix", 0, tree)}
    engines = {}
    for name, (kind, k, trees) in modes.items():
        drafter = {None: None, "ngram": NgramDrafter(1, 3), "model": draft, "suffix": SuffixDrafter()}[kind]
        config = DecoderConfig(k=k, max_seq_len=MAX_LEN, batch_buckets=(1,), context_buckets=(MAX_LEN // 16,),
                               tree=trees)
        engines[name] = Engine(target, drafter, config=config)
        if not args.dry_run:
            engines[name].warmup(1, MAX_LEN, temperatures=0.0)
    rows = {(w, m): {"tps": [], "mal": []} for w in WORKLOADS for m in modes}
    for r in range(args.rounds):
        for workload in WORKLOADS:
            prompts = prompts_of(workload, args.requests, seed=100 + r)
            reference = None
            for name, engine in engines.items():
                outputs, seconds, steps = serve_one_by_one(engine, prompts, args.max_tokens)
                if reference is None:
                    reference = outputs
                elif outputs != reference:
                    raise AssertionError(f"{name} on {workload}: greedy output differs from the target's alone")
                tokens = sum(map(len, outputs))
                rows[workload, name]["tps"].append(tokens / seconds)
                rows[workload, name]["mal"].append(tokens / steps)
                print(f"round {r} {workload:8s} {name:34s} {tokens / seconds:8.1f} tok/s  "
                      f"accepted length {tokens / steps:.2f}", file=sys.stderr, flush=True)
    lines = ["| workload | mode | tokens/s (median) | mean accepted length | tokens/s vs n-gram |", "|---|---|---|---|---|"]
    for workload in WORKLOADS:
        base = statistics.median(rows[workload, f"n-gram k={args.k}"]["tps"])
        for name in modes:
            tps = statistics.median(rows[workload, name]["tps"])
            lines.append(f"| {workload} | {name} | {tps:.1f} | {statistics.mean(rows[workload, name]['mal']):.2f} | "
                         f"{tps / base:.2f}x |")
    return "\n".join(lines)


def host_cost(args) -> str:
    """The drafter's own host work (see the module docstring)."""
    batch = args.batch
    text = np.asarray(stdlib_bytes(max_bytes=batch * max(args.histories) + 1_000_000, seed=1), np.int64)
    rng = np.random.default_rng(0)
    lines = [f"| history (tokens) | index a prompt (µs/token) | extend (µs/token) | propose, batch {batch}, k=8 "
             "(µs/request/step) |", "|---|---|---|---|"]
    for history in args.histories:
        drafter = SuffixDrafter()
        starts = rng.integers(0, len(text) - history - 64, batch)
        ids = [str(i) for i in range(batch)]
        began = time.perf_counter()
        for rid, s in zip(ids, starts.tolist()):
            drafter.start(rid, text[s:s + history - 8].tolist())
        index_us = (time.perf_counter() - began) / (batch * (history - 8)) * 1e6
        began = time.perf_counter()
        for rid, s in zip(ids, starts.tolist()):
            drafter.extend(rid, text[s + history - 8:s + history].tolist())
        extend_us = (time.perf_counter() - began) / (batch * 8) * 1e6
        histories = [text[s:s + history] for s in starts.tolist()]
        caps = np.full(batch, 8)
        times = []
        for _ in range(args.repeats):
            began = time.perf_counter()
            drafter.propose(ids, histories, caps)
            times.append(time.perf_counter() - began)
        lines.append(f"| {history} | {index_us:.2f} | {extend_us:.2f} | {statistics.median(times) / batch * 1e6:.1f} |")
    tracemalloc.start()
    drafter = SuffixDrafter(max_cached_requests=args.cached)
    for i in range(args.cached + 100):             # past the bound: the oldest outputs are dropped
        s = int(rng.integers(0, len(text) - 320))
        drafter.start(str(i), text[s:s + 64].tolist())
        drafter.extend(str(i), text[s + 64:s + 320].tolist())
        drafter.finish(str(i))
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    lines.append(f"\nFinished-output cache: {drafter.cached_requests} requests, {drafter.cached_tokens} tokens, "
                 f"{held / 2**20:.1f} MiB ({held / drafter.cached_tokens:.0f} bytes/token, tracemalloc).")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=64, help="requests per workload and round")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=8, help="drafts per step of the host drafters")
    parser.add_argument("--k-model", type=int, default=4, help="drafts per step of the draft model")
    parser.add_argument("--host-cost", action="store_true")
    parser.add_argument("--repeats", type=int, default=20, help="--host-cost: timed proposals per history")
    parser.add_argument("--batch", type=int, default=64, help="--host-cost: requests proposed for at once")
    parser.add_argument("--histories", type=int, nargs="+", default=[1024, 8192, 32768],
                        help="--host-cost: each request's history length (tokens)")
    parser.add_argument("--cached", type=int, default=10000, help="--host-cost: requests in the output cache")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--append", action="store_true")
    args = parser.parse_args()
    if args.dry_run:
        args.rounds, args.requests, args.max_tokens, args.repeats, args.cached = 1, 3, 8, 2, 50
        args.batch, args.histories = 4, [256]
    table = host_cost(args) if args.host_cost else e2e(args)
    print(table)
    if args.append and not args.dry_run:
        title = "Suffix decoding: host cost" if args.host_cost else "Suffix decoding: three workloads, demo pair"
        command = "python benchmarks/bench_suffix.py " + " ".join(sys.argv[1:])
        append_markdown(RESULTS, results_header(title, command) + table + "\n")


if __name__ == "__main__":
    main()
