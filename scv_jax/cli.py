"""The ``scv-jax`` command: ``scv-jax demo`` (speculative vs autoregressive on the demo models) and
``scv-jax bench`` (the end-to-end benchmark)."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform
import sys

import jax

DEFAULT_PROMPT = "import sys\n\n\ndef "


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scv-jax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="generate with the demo models: speculative vs autoregressive")
    demo.add_argument("--prompt", default=DEFAULT_PROMPT, help="text to continue (bytes)")
    demo.add_argument("--max-new-tokens", type=int, default=192)
    demo.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    demo.add_argument("--seed", type=int, default=0)
    mode = demo.add_mutually_exclusive_group()
    mode.add_argument("--k", type=int, default=None, help="fixed drafts per step (default 6)")
    mode.add_argument("--adaptive", action="store_true", help="choose k per step (AdaptiveController)")
    bench = sub.add_parser("bench", help="end-to-end benchmark on the demo models (with progress)")
    bench.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    bench.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    bench.add_argument("--modes", nargs="+", default=["2", "4", "8", "adaptive"],
                       help="fixed k values and/or 'adaptive'")
    bench.add_argument("--max-new-tokens", type=int, default=96)
    bench.add_argument("--append", metavar="PATH", help="append the results to this markdown file")
    return parser


def _text(tokens: list[int]) -> str:
    return bytes(tokens).decode("utf-8", errors="replace")


def run_demo(args, target, draft) -> int:
    from scv_jax.decoding.config import DecoderConfig
    from scv_jax.decoding.decoder import SpeculativeDecoder

    prompt = list(args.prompt.encode("utf-8"))
    if not prompt:
        raise SystemExit("scv-jax demo: --prompt must not be empty")
    k = 6 if args.k is None else args.k
    config = DecoderConfig(k=k, adaptive=args.adaptive, batch_buckets=(1,))
    needed = len(prompt) + args.max_new_tokens + max(config.allowed_k)
    config = dataclasses.replace(config, max_seq_len=max(config.max_seq_len, needed),
                                 num_blocks=max(config.num_blocks, -(-needed // config.block_size)))
    speculative = SpeculativeDecoder(target, draft, config=config)
    autoregressive = SpeculativeDecoder(target, None, config=config)
    print("compiling (one time) ...", file=sys.stderr, flush=True)
    for decoder in (speculative, autoregressive):       # untimed run: compiles every executable used
        decoder.generate([prompt], args.max_new_tokens, temperature=args.temperature, seed=args.seed + 1)
    spec = speculative.generate([prompt], args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    base = autoregressive.generate([prompt], args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    print(_text(prompt + spec.tokens[0]))
    print()
    s, b = spec.stats, base.stats
    mode = "adaptive k" if args.adaptive else f"k={k}"
    same = ("yes" if spec.tokens == base.tokens else "NO") if args.temperature == 0 else \
        "n/a (sampling: same distribution, different draws)"
    per_position = " ".join(f"{a:.2f}" for a in s.acceptance_per_position)
    rows = [("autoregressive", f"{b.tokens_per_second:8.1f} tokens/s", f"{b.wall_seconds:.2f} s"),
            (f"speculative ({mode})", f"{s.tokens_per_second:8.1f} tokens/s", f"{s.wall_seconds:.2f} s"),
            ("speedup", f"{s.tokens_per_second / b.tokens_per_second:8.2f}x", ""),
            ("mean accepted length", f"{s.mean_accepted_length:8.2f} tokens/step", f"{s.steps} steps"),
            ("acceptance", f"{s.acceptance_rate:8.2f}", f"per position: {per_position}"),
            ("greedy outputs identical", same, "")]
    for name, value, extra in rows:
        print(f"{name:26s}{value:22s}{extra}")
    return 0 if args.temperature or spec.tokens == base.tokens else 1


def run_bench(args, target, draft) -> int:
    from scv_jax.demo.e2e import format_table, run_e2e

    modes = [m if m == "adaptive" else int(m) for m in args.modes]
    rows = run_e2e(target, draft, batch_sizes=args.batch_sizes, temperatures=args.temperatures, modes=modes,
                   max_new_tokens=args.max_new_tokens)
    table = format_table(rows)
    print(table)
    if args.append:
        command = "scv-jax bench " + " ".join(sys.argv[2:])
        header = (f"\n## End-to-end speculative decoding (demo models), {datetime.date.today()}\n\n"
                  f"Machine: {platform.processor() or platform.machine()}, {jax.devices()[0].platform} "
                  f"({jax.device_count()} device), jax {jax.__version__}. Command: `{command}`. "
                  f"{args.max_new_tokens} new tokens per request, prompts from held-out stdlib source, "
                  "compilation excluded (warm-up call first).\n\n")
        with open(args.append, "a") as f:
            f.write(header + table + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from scv_jax.models import load_demo

    target, draft = load_demo()
    return run_demo(args, target, draft) if args.command == "demo" else run_bench(args, target, draft)


if __name__ == "__main__":
    sys.exit(main())
