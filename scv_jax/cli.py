"""The ``scv-jax`` command: ``scv-jax demo`` (speculative vs autoregressive on the demo models) and
``scv-jax bench`` (the end-to-end benchmark)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from typing import Callable

DEFAULT_PROMPT = "import sys\n\n\ndef "


class _Parser(argparse.ArgumentParser):
    """Reports a user's mistake in one line (no usage dump, no traceback) and exits with status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an int >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an int >= {minimum}, got {value}")
        return value
    return parse


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (0 = greedy), got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    formatter = argparse.ArgumentDefaultsHelpFormatter
    parser = _Parser(prog="scv-jax", description=__doc__, formatter_class=formatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    demo = sub.add_parser("demo", help="generate with the demo models: speculative vs autoregressive",
                          formatter_class=formatter)
    demo.add_argument("--prompt", default=DEFAULT_PROMPT, help="text to continue (bytes)")
    demo.add_argument("--max-new-tokens", type=_int_at_least(1), default=192, help="tokens to generate")
    demo.add_argument("--temperature", type=_temperature, default=0.0, help="0 = greedy")
    demo.add_argument("--seed", type=int, default=0, help="seed of the sampling draws")
    mode = demo.add_mutually_exclusive_group()
    mode.add_argument("--k", type=_int_at_least(0), default=6, help="fixed drafts per step (0 = no speculation)")
    mode.add_argument("--adaptive", action="store_true", help="choose k per step (AdaptiveController)")
    bench = sub.add_parser("bench", help="end-to-end benchmark on the demo models (with progress)",
                           formatter_class=formatter)
    bench.add_argument("--batch-sizes", type=_int_at_least(1), nargs="+", default=[1, 4, 16],
                       help="batch sizes to run")
    bench.add_argument("--temperatures", type=_temperature, nargs="+", default=[0.0, 1.0],
                       help="temperatures to run (0 = greedy)")
    bench.add_argument("--modes", nargs="+", default=["2", "4", "8", "adaptive"],
                       help="fixed k values and/or 'adaptive'")
    bench.add_argument("--max-new-tokens", type=_int_at_least(1), default=96, help="tokens per request")
    bench.add_argument("--append", metavar="PATH", help="append the results to this markdown file")
    return parser


def _text(tokens: list[int]) -> str:
    return bytes(tokens).decode("utf-8", errors="replace")


def _ratio(value: float, fmt: str) -> str:
    """``value`` formatted, or "-" when it is undefined (nan: no drafts were proposed)."""
    return "-" if math.isnan(value) else format(value, fmt)


def run_demo(args: argparse.Namespace) -> int:
    from scv_jax.decoding.config import DecoderConfig
    from scv_jax.decoding.decoder import SpeculativeDecoder
    from scv_jax.models import load_demo

    prompt = list(args.prompt.encode("utf-8"))
    if not prompt:
        raise ValueError("--prompt must not be empty")
    target, draft = load_demo()
    config = DecoderConfig(k=args.k, adaptive=args.adaptive, batch_buckets=(1,))
    needed = len(prompt) + args.max_new_tokens + max(config.allowed_k)
    config = dataclasses.replace(config, max_seq_len=max(config.max_seq_len, needed),
                                 num_blocks=max(config.num_blocks, -(-needed // config.block_size)))
    speculative = SpeculativeDecoder(target, draft, config=config)
    autoregressive = SpeculativeDecoder(target, None, config=config)
    print("compiling (one time) ...", file=sys.stderr, flush=True)
    for decoder in (speculative, autoregressive):       # untimed run: compiles every executable used
        decoder.generate([prompt], args.max_new_tokens, temperature=args.temperature, seed=args.seed + 1,
                         progress=True)
    spec = speculative.generate([prompt], args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    base = autoregressive.generate([prompt], args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    print(_text(prompt + spec.tokens[0]))
    print()
    s, b = spec.stats, base.stats
    mode = "adaptive k" if args.adaptive else f"k={args.k}"
    same = ("yes" if spec.tokens == base.tokens else "NO") if args.temperature == 0 else \
        "n/a (sampling: same distribution, different draws)"
    per_position = " ".join(_ratio(a, ".2f") for a in s.acceptance_per_position) or "-"
    rows = [("autoregressive", f"{b.tokens_per_second:8.1f} tokens/s", f"{b.wall_seconds:.2f} s"),
            (f"speculative ({mode})", f"{s.tokens_per_second:8.1f} tokens/s", f"{s.wall_seconds:.2f} s"),
            ("speedup", f"{s.tokens_per_second / b.tokens_per_second:8.2f}x", ""),
            ("mean accepted length", f"{s.mean_accepted_length:8.2f} tokens/step", f"{s.steps} steps"),
            ("acceptance", f"{_ratio(s.acceptance_rate, '8.2f'):>8s}", f"per position: {per_position}"),
            ("greedy outputs identical", same, "")]
    for name, value, extra in rows:
        print(f"{name:26s}{value:22s}{extra}")
    return 0 if args.temperature or spec.tokens == base.tokens else 1


def run_bench(args: argparse.Namespace) -> int:
    from scv_jax.demo.e2e import format_table, run_e2e, write_results
    from scv_jax.models import load_demo

    modes = []
    for mode in args.modes:
        if mode != "adaptive" and not (mode.isdigit() and int(mode) >= 1):
            raise ValueError(f"--modes: each mode must be a k >= 1 or 'adaptive', got {mode!r}")
        modes.append(mode if mode == "adaptive" else int(mode))
    target, draft = load_demo()
    rows = run_e2e(target, draft, batch_sizes=args.batch_sizes, temperatures=args.temperatures, modes=modes,
                   max_new_tokens=args.max_new_tokens)
    table = format_table(rows)
    print(table)
    if args.append:
        write_results(args.append, table, "scv-jax bench " + " ".join(sys.argv[2:]), args.max_new_tokens)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return run_demo(args) if args.command == "demo" else run_bench(args)
    except (ValueError, FileNotFoundError) as error:     # a user's mistake: one line, no traceback
        print(f"scv-jax {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
