"""The demo EAGLE-3 head (``scv_jax.models.load_demo_head``) against the demo draft model, n-gram prompt
lookup and the target alone, on the demo target, greedy: held-out standard-library prompts
(``scv_jax.demo.e2e.benchmark_prompts``), a batch of ``--prompts`` per round, new prompts each round
(seed = round), every mode on the same prompts, after a warm-up that compiles what each uses.

Modes: autoregressive; the draft model, the head and n-gram (``NgramDrafter(1, 3)``) chains at
k = ``--ks`` (default 2, 4, 6); the draft model's and the head's EAGLE-2 trees (``TreeConfig()``: depth
4, 16 nodes); the head in each ``--head-dtype`` (default bfloat16, as ``load_eagle3`` loads it; the
target and the draft model are float32). ``--packed``: autoregressive and the head's chains dense and
with packed verification (``DecoderConfig.packed_verify``) instead. Reported per mode: mean accepted
length (tokens per request per decode step, mean over rounds), acceptance per draft position, the
tokens the target scored per step (padding rows included), milliseconds per decode step (drafting and
verification, the prefill spread over the steps, compiles excluded: the draft's cost beside the
target's alone), tokens/s (median over rounds) and its ratio to autoregressive; greedy outputs are
checked against the target's alone.

    python benchmarks/bench_eagle3.py [--rounds 3] [--prompts 4] [--max-tokens 128] [--ks 2,4,6] [--head DIR]
                                      [--head-dtype bfloat16[,float32]] [--packed] [--append]

``--dry-run``: one round, 2 prompts, 8 tokens (a check that the script runs; nothing appended).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scv_jax import DecoderConfig, NgramDrafter, SpeculativeDecoder, TreeConfig  # noqa: E402
from scv_jax.demo.e2e import benchmark_prompts  # noqa: E402
from scv_jax.demo.report import append_markdown, results_header  # noqa: E402
from scv_jax.models import load_demo, load_demo_head, load_eagle3  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
PROMPT_LEN = 48


def decoders(head_dir: str | None, head_dtypes: list[str], max_len: int, ks: list[int], packed: bool = False
             ) -> dict[str, SpeculativeDecoder]:
    """{mode name: decoder} over the demo target, the head in each of ``head_dtypes`` (``packed``: the
    head's chains dense and packed)."""
    target, draft = load_demo()
    heads = {("eagle3 head" if len(head_dtypes) == 1 else f"eagle3 head {dtype}"):
             load_demo_head(target, dtype=dtype) if head_dir is None else load_eagle3(head_dir, target, dtype=dtype)
             for dtype in head_dtypes}

    def config(k: int, tree: TreeConfig | None = None, packed_verify: bool = False) -> DecoderConfig:
        return DecoderConfig(k=k, max_seq_len=max_len, num_blocks=256, tree=tree, packed_verify=packed_verify)

    modes = {"autoregressive": SpeculativeDecoder(target, None, config=config(0))}
    if packed:
        return modes | {f"{name}, k={k}{' packed' if p else ''}": SpeculativeDecoder(
            target, head, config=config(k, packed_verify=p)) for name, head in heads.items() for k in ks
            for p in (False, True)}
    for name, drafter in (("draft model", draft), *heads.items(), ("n-gram", NgramDrafter(1, 3))):
        modes |= {f"{name}, k={k}": SpeculativeDecoder(target, drafter, config=config(k)) for k in ks}
        if name != "n-gram":
            tree = TreeConfig()
            modes[f"{name}, tree"] = SpeculativeDecoder(target, drafter, config=config(tree.max_depth, tree))
    return modes


def run(args: argparse.Namespace) -> str:
    """The markdown table of every mode over ``args.rounds`` rounds."""
    modes = decoders(args.head, args.head_dtype, PROMPT_LEN + args.max_tokens, args.ks, args.packed)
    for decoder in modes.values():
        decoder.generate(benchmark_prompts(args.prompts, PROMPT_LEN, seed=1000), args.max_tokens)     # warm-up
    rows = {name: {"tps": [], "mal": [], "positions": [], "scored": [], "step_ms": []} for name in modes}
    for r in range(args.rounds):
        prompts = benchmark_prompts(args.prompts, PROMPT_LEN, seed=r)
        reference = None
        for name, decoder in modes.items():
            out = decoder.generate(prompts, args.max_tokens)
            reference = reference or out.tokens
            if out.tokens != reference:
                raise SystemExit(f"bench_eagle3: {name}'s greedy output differs from the target's alone")
            stats = out.stats
            rows[name]["tps"].append(stats.tokens_per_second)
            rows[name]["mal"].append(stats.mean_accepted_length)
            rows[name]["positions"].append(stats.acceptance_per_position)
            rows[name]["scored"].append(stats.scored_tokens / max(stats.steps, 1))
            rows[name]["step_ms"].append(1e3 * (stats.wall_seconds - stats.compile_seconds) / max(stats.steps, 1))
            print(f"round {r}: {name:20s} {stats.mean_accepted_length:5.2f} tokens/step "
                  f"{stats.tokens_per_second:8.1f} tokens/s", file=sys.stderr, flush=True)
    baseline = statistics.median(rows["autoregressive"]["tps"])
    lines = ["| mode | mean accepted length | acceptance per position | target tokens scored per step | ms per step "
             "| tokens/s (median) | x autoregressive |", "|---|---:|---|---:|---:|---:|---:|"]
    for name, r in rows.items():
        positions = [statistics.mean(column) for column in zip(*r["positions"])]
        shown = " ".join(f"{a:.2f}" for a in positions) or "-"
        tps = statistics.median(r["tps"])
        lines.append(f"| {name} | {statistics.mean(r['mal']):.2f} | {shown} | {statistics.mean(r['scored']):.1f} "
                     f"| {statistics.median(r['step_ms']):.1f} | {tps:.1f} | {tps / baseline:.2f} |")
    return "\n".join(lines)


def dtypes(text: str) -> list[str]:
    """``--head-dtype``'s comma-separated dtypes."""
    names = text.split(",")
    if any(name not in ("bfloat16", "float16", "float32") for name in names):
        raise argparse.ArgumentTypeError(f"expected bfloat16, float16 or float32, comma-separated; got {text!r}")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per round (one batch)")
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt")
    parser.add_argument("--ks", type=lambda text: [int(k) for k in text.split(",")], default=[2, 4, 6],
                        help="chain lengths, comma-separated")
    parser.add_argument("--head", help="an EAGLE-3 checkpoint for the demo target (default: the shipped head)")
    parser.add_argument("--head-dtype", type=dtypes, default=["bfloat16"],
                        help="the head's parameter and activation dtype: bfloat16 (default), float16 or float32, "
                             "or several, comma-separated (a mode per dtype; the target and draft model are float32)")
    parser.add_argument("--packed", action="store_true",
                        help="autoregressive and the head's modes, dense and packed (packed_verify)")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--append", action="store_true")
    args = parser.parse_args()
    if args.dry_run:
        args.rounds, args.prompts, args.max_tokens, args.ks = 1, 2, 8, [2]
    table = run(args)
    print(table)
    if args.append and not args.dry_run:
        command = "python benchmarks/bench_eagle3.py " + " ".join(sys.argv[1:])
        head_dtypes = " and in ".join(args.head_dtype) + (" (a mode each)" if len(args.head_dtype) > 1 else "")
        details = (f"{args.rounds} rounds of {args.prompts} prompts x {args.max_tokens} new tokens, greedy; the head "
                   f"in {head_dtypes}, the target and the draft model in float32. ")
        title = ("EAGLE-3 demo head, dense vs packed verification" if args.packed
                 else "EAGLE-3 demo head vs the demo draft model")
        append_markdown(RESULTS, results_header(title, command, details) + table + "\n")


if __name__ == "__main__":
    main()
