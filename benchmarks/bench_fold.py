"""Would fewer decode executables cost step time? Two static arguments of the decode step could be
folded away: ``logprobs`` (every dense step computing the emitted tokens' log-probabilities: one
executable where there are two) and ``greedy`` (all-greedy batches run by the sampled step, whose greedy
rows take the argmax: one where there are two). A/B in one process on the demo pair: each step on its
own executable ("plain") against the same step on the executable that would replace it. (Whether one
block-table width would do: ``bench_context_widths.py``.)

    python benchmarks/bench_fold.py [--rounds 6] [--append]

Each variant forces ``StepRunner.decode_plan``'s ``logprobs`` or ``greedy``; B requests of 40-token
prompts decode 8 timed steps (their median) per round, the variants alternating round by round; the
table gives the median over rounds after the first (which compiles) and the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

VARIANTS = ("plain", "logprobs folded", "greedy on sampled")


def step_seconds(engine, batch: int, temperature: float, seed: int) -> float:
    """The median wall time of 8 engine steps of ``batch`` decoding requests (after 3 steps of prefill)."""
    import scv_jax

    rng = np.random.default_rng(seed)
    request_ids = [engine.add_request(rng.integers(0, 256, 40).tolist(), scv_jax.SamplingParams(
        max_tokens=200, temperature=temperature, ignore_eos=True, seed=i)) for i in range(batch)]
    for _ in range(3):
        engine.step()
    steps = []
    for _ in range(8):
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    for request_id in request_ids:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    return statistics.median(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    import scv_jax
    from scv_jax.demo.report import append_markdown, results_header
    from scv_jax.models import load_demo

    target, draft = load_demo()
    rows = ["| k | requests | B | plain ms | logprobs folded ms (ratio) | on the sampled step ms (ratio) |",
            "| ---: | --- | ---: | ---: | ---: | ---: |"]
    for k, temperature in ((4, 0.0), (4, 1.0), (0, 0.0)):
        engine = scv_jax.Engine(target, draft, config=scv_jax.DecoderConfig(
            k=k, batch_buckets=(1, 4, 16), max_seq_len=512, num_blocks=16 * 32))
        runner = engine.runner
        plan = runner.decode_plan
        forced = {"plain": plan, "logprobs folded": lambda *a, **kw: plan(*a, **{**kw, "logprobs": True}),
                  "greedy on sampled": lambda batch, width, k, greedy, *a, **kw: plan(batch, width, k, False, *a, **kw)}
        variants = VARIANTS if temperature == 0 else VARIANTS[:2]
        for batch in (1, 16):
            times = {variant: [] for variant in variants}
            for round_ in range(args.rounds):
                for variant in variants:
                    runner.decode_plan = forced[variant]
                    seconds = step_seconds(engine, batch, temperature, round_)
                    if round_:
                        times[variant].append(seconds)
            ms = {variant: statistics.median(seconds) * 1e3 for variant, seconds in times.items()}
            cells = [f"{ms[v]:.2f} ({ms[v] / ms['plain']:.2f}x)" if v in ms else "-" for v in VARIANTS[1:]]
            row = (f"| {k} | {'greedy' if temperature == 0 else 'sampled'} | {batch} | {ms['plain']:.2f} | "
                   f"{' | '.join(cells)} |")
            print(row, flush=True)
            rows.append(row)
    if args.append:
        append_markdown("benchmarks/RESULTS.md", results_header(
            "Fewer decode executables: logprobs folded, greedy batches on the sampled step (bench_fold.py)",
            f"python benchmarks/bench_fold.py {' '.join(sys.argv[1:])}",
            f"Demo pair, float32, backend xla, 512-token buckets, 40-token prompts; the median step of "
            f"{args.rounds - 1} rounds. ")
            + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
