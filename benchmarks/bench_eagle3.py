"""The demo EAGLE-3 head (``scv_jax.models.load_demo_head``) against the demo draft model, n-gram prompt
lookup and the target alone, on the demo target, greedy: held-out standard-library prompts
(``scv_jax.demo.e2e.benchmark_prompts``), a batch of ``--prompts`` per round, new prompts each round
(seed = round), every mode on the same prompts, after a warm-up that compiles what each uses.

Modes: autoregressive; the draft model at k = 4; the head at k = 2, 4, 6; n-gram (``NgramDrafter(1, 3)``)
at k = 4. ``--packed``: autoregressive and the head at k = 2, 4, 6 dense and with packed verification
(``DecoderConfig.packed_verify``) instead. Reported per mode: mean accepted length (tokens per request
per decode step, mean over rounds), the tokens the target scored per step (padding rows included) and
tokens/s (median over rounds); greedy outputs are checked against the target's alone.

    python benchmarks/bench_eagle3.py [--rounds 3] [--prompts 4] [--max-tokens 128] [--head DIR] [--packed] [--append]

``--dry-run``: one round, 2 prompts, 8 tokens (a check that the script runs; nothing appended).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scv_jax import DecoderConfig, NgramDrafter, SpeculativeDecoder  # noqa: E402
from scv_jax.demo.e2e import benchmark_prompts  # noqa: E402
from scv_jax.demo.report import append_markdown, results_header  # noqa: E402
from scv_jax.models import load_demo, load_demo_head, load_eagle3  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
PROMPT_LEN = 48


def decoders(head_dir: str | None, max_len: int, packed: bool = False) -> dict[str, SpeculativeDecoder]:
    """{mode name: decoder} over the demo target (``packed``: the head's modes dense and packed)."""
    target, draft = load_demo()
    head = load_demo_head(target) if head_dir is None else load_eagle3(head_dir, target, dtype="float32")

    def config(k: int, packed_verify: bool = False) -> DecoderConfig:
        return DecoderConfig(k=k, max_seq_len=max_len, num_blocks=256, packed_verify=packed_verify)

    autoregressive = {"autoregressive": SpeculativeDecoder(target, None, config=config(0))}
    if packed:
        return {**autoregressive, **{f"eagle3 head, k={k}{' packed' if p else ''}": SpeculativeDecoder(
            target, head, config=config(k, p)) for k in (2, 4, 6) for p in (False, True)}}
    return {**autoregressive, "draft model, k=4": SpeculativeDecoder(target, draft, config=config(4)),
            **{f"eagle3 head, k={k}": SpeculativeDecoder(target, head, config=config(k)) for k in (2, 4, 6)},
            "n-gram, k=4": SpeculativeDecoder(target, NgramDrafter(1, 3), config=config(4))}


def run(args: argparse.Namespace) -> str:
    """The markdown table of every mode over ``args.rounds`` rounds."""
    modes = decoders(args.head, PROMPT_LEN + args.max_tokens, args.packed)
    for decoder in modes.values():
        decoder.generate(benchmark_prompts(args.prompts, PROMPT_LEN, seed=1000), args.max_tokens)     # warm-up
    rows = {name: {"tps": [], "mal": [], "scored": []} for name in modes}
    for r in range(args.rounds):
        prompts = benchmark_prompts(args.prompts, PROMPT_LEN, seed=r)
        reference = None
        for name, decoder in modes.items():
            out = decoder.generate(prompts, args.max_tokens)
            reference = reference or out.tokens
            if out.tokens != reference:
                raise SystemExit(f"bench_eagle3: {name}'s greedy output differs from the target's alone")
            rows[name]["tps"].append(out.stats.tokens_per_second)
            rows[name]["mal"].append(out.stats.mean_accepted_length)
            rows[name]["scored"].append(out.stats.scored_tokens / out.stats.steps)
            print(f"round {r}: {name:20s} {out.stats.mean_accepted_length:5.2f} tokens/step "
                  f"{out.stats.tokens_per_second:8.1f} tokens/s", file=sys.stderr, flush=True)
    lines = ["| mode | mean accepted length | target tokens scored per step | tokens/s (median) |",
             "|---|---:|---:|---:|"]
    lines += [f"| {name} | {statistics.mean(r['mal']):.2f} | {statistics.mean(r['scored']):.1f} "
              f"| {statistics.median(r['tps']):.1f} |" for name, r in rows.items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per round (one batch)")
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt")
    parser.add_argument("--head", help="an EAGLE-3 checkpoint for the demo target (default: the shipped head)")
    parser.add_argument("--packed", action="store_true",
                        help="autoregressive and the head's modes, dense and packed (packed_verify)")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--append", action="store_true")
    args = parser.parse_args()
    if args.dry_run:
        args.rounds, args.prompts, args.max_tokens = 1, 2, 8
    table = run(args)
    print(table)
    if args.append and not args.dry_run:
        command = "python benchmarks/bench_eagle3.py " + " ".join(sys.argv[1:])
        details = f"{args.rounds} rounds of {args.prompts} prompts x {args.max_tokens} new tokens, greedy. "
        title = ("EAGLE-3 demo head, dense vs packed verification" if args.packed
                 else "EAGLE-3 demo head vs the demo draft model")
        append_markdown(RESULTS, results_header(title, command, details) + table + "\n")


if __name__ == "__main__":
    main()
