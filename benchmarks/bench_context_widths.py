"""The padding cost of geometric context widths: the decode step's device time (``device_seconds_per_step``)
with its block table padded to the default widths (max_seq_len's width and its halves,
``DecoderConfig.block_buckets``) vs at its exact width, on the demo models, for contexts just past a
width (the worst case: almost 2x the blocks) and in between. Also the executables a request growing to
max_seq_len crosses, per policy (the default halving widths, and the former multiples of 16 blocks).

Run: ``JAX_PLATFORMS=cpu python benchmarks/bench_context_widths.py [--append]``
"""

from __future__ import annotations

import argparse
import dataclasses
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from harness import publish  # noqa: E402
from scv_jax import DecoderConfig, SpeculativeDecoder  # noqa: E402
from scv_jax.graph.buckets import Buckets  # noqa: E402
from scv_jax.models import load_demo  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--contexts", type=int, nargs="+", default=[260, 520, 760],
                        help="cache lengths (positions); default: just past 16 and 32 blocks, and 48 blocks")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    target, draft = load_demo()
    base = DecoderConfig(batch_buckets=tuple(sorted(set(args.batch_sizes))))
    exact = dataclasses.replace(base, context_buckets=tuple(range(1, base.max_blocks_per_seq + 1)))
    lines = ["| drafter, k | batch | context | exact width | padded width | exact ms | padded ms | padded / exact |",
             "|---|---|---|---|---|---|---|---|"]
    for name, model, k in (("none, 0", None, 0), ("model, 4", draft, 4)):
        decoders = {label: SpeculativeDecoder(target, model, config=dataclasses.replace(config, k=k))
                    for label, config in (("exact", exact), ("padded", base))}
        for batch in args.batch_sizes:
            for context in args.contexts:
                width = -(-(context + k + 1) // base.block_size)
                samples = {label: [] for label in decoders}
                for _ in range(args.repeats):        # interleaved: a load change hits both alike
                    for label, decoder in decoders.items():
                        samples[label].append(decoder.device_seconds_per_step(batch, k, context=context, calls=10,
                                                                              repeats=1))
                times = {label: min(values) for label, values in samples.items()}   # the least disturbed
                padded = base.block_buckets().bucket(width)
                lines.append(f"| {name} | {batch} | {context} | {width} | {padded} | {times['exact'] * 1e3:.2f} | "
                             f"{times['padded'] * 1e3:.2f} | {times['padded'] / times['exact']:.2f} |")
                print(lines[-1], flush=True)
    crossings = ["", "| max_seq_len (blocks of 16) | halving widths (default) | multiples of 16 blocks (before) |",
                 "|---|---|---|"]
    for max_seq_len in (1024, 1088, 4160, 16384):
        most = -(-max_seq_len // 16)
        crossings.append(f"| {max_seq_len} ({most}) | {len(Buckets.halving(most, min_size=16).sizes)} | "
                         f"{len(Buckets.pow2_then_linear(most, linear_step=16, min_size=16).sizes)} |")
    publish(__file__, "Context widths: padding cost of the halving widths",
            f"Demo models, device_seconds_per_step (the fastest of {args.repeats} interleaved samples of 10 calls), max_seq_len "
            f"{base.max_seq_len}, widths {base.block_buckets().sizes} blocks of {base.block_size}; the table after "
            "it: the widths (one executable per k and batch bucket each) that a request growing to max_seq_len "
            "crosses. ", "\n".join(lines + crossings), append=args.append)


if __name__ == "__main__":
    main()
