"""The cost of the logit controls (penalties, logit_bias, masks) per decode step: the decode executable
alone (``SpeculativeDecoder.device_seconds_per_step``, device-resident inputs, no host work) with none,
half or all of the batch's requests controlled, in one process on one decoder (the same executable:
the controls are data), with the ratio to the plain step. The settings take turns, one mean of
``--calls`` calls each per round, for ``--repeats`` rounds, each setting first in turn (a busy machine
slows them alike); the table gives each setting's median and fastest round.

Run: ``JAX_PLATFORMS=cpu python benchmarks/bench_controls.py [--batch-sizes 1 4] [--k 4] [--greedy]``
(the demo target and draft models, the draft proposing k drafts per step; sampled steps unless
``--greedy``). The controlled requests have presence, frequency and repetition penalties (0.5, 0.5,
1.2) and an all-zero bias row and no bad words: the cost is the same whatever the values are.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from scv_jax import DecoderConfig, SpeculativeDecoder  # noqa: E402
from scv_jax.models import load_demo  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--k", type=int, default=4, help="drafts per step (with the draft model)")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--greedy", action="store_true", help="all-greedy steps (default: sampled)")
    args = parser.parse_args()
    target, draft = load_demo()
    config = DecoderConfig(k=args.k, max_seq_len=512, batch_buckets=tuple(args.batch_sizes))
    decoder = SpeculativeDecoder(target, draft, config=config)
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, demo models (V = {decoder.vocab_size}), "
          f"k = {args.k}, context {args.context}, {'greedy' if args.greedy else 'sampled'} steps")
    print("| batch | controlled | ms / step (median) | ratio to plain | ms / step (fastest) | ratio to plain |")
    print("|---:|---:|---:|---:|---:|---:|")
    for batch in args.batch_sizes:
        settings = sorted({0, batch // 2, batch})
        rounds = {controlled: [] for controlled in settings}
        for turn in range(args.repeats):
            for controlled in settings[turn % len(settings):] + settings[:turn % len(settings)]:   # each first in turn
                rounds[controlled].append(decoder.device_seconds_per_step(
                    batch, args.k, greedy=args.greedy, context=args.context, calls=args.calls, repeats=1,
                    controlled=controlled))
        median = {c: float(np.median(r)) for c, r in rounds.items()}
        fastest = {c: min(r) for c, r in rounds.items()}
        for controlled in settings:
            print(f"| {batch} | {controlled} | {median[controlled] * 1e3:.2f} | {median[controlled] / median[0]:.3f} "
                  f"| {fastest[controlled] * 1e3:.2f} | {fastest[controlled] / fastest[0]:.3f} |", flush=True)


if __name__ == "__main__":
    main()
