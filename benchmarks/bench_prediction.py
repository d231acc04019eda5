"""Predicted outputs: tokens/s and mean accepted length of a greedy request whose ``prediction`` is its
exact output, against the same request without one, on the demo pair (the target, n-gram drafts: the host
drafter a prediction needs), k = 4 and k = 8, and the target alone for reference.

Each request runs alone, greedy, ``--max-tokens`` tokens (eos ignored) after a benchmark prompt. The
exact prediction is the target's greedy output of that prompt (what an edit that changes nothing would
send). Every configuration runs its requests once untimed (it compiles its shapes), then timed. Mean
accepted length: the tokens a decode step emits for the request (accepted drafts + 1). The outputs must be
identical with and without the prediction (checked).

    python benchmarks/bench_prediction.py --append

``--dry-run``: two short requests, nothing appended.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scv_jax import DecoderConfig, Engine, NgramDrafter, SamplingParams  # noqa: E402
from scv_jax.demo.e2e import benchmark_prompts  # noqa: E402
from scv_jax.demo.report import append_markdown, results_header  # noqa: E402
from scv_jax.models import load_demo  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")


def run_one(engine: Engine, prompt: list[int], params: SamplingParams) -> tuple[list[int], float, int, object]:
    """One request alone: its tokens, its seconds from add to end, its decode steps and last output."""
    start, steps, last = time.perf_counter(), 0, None
    request_id = engine.add_request(prompt, params)
    for _ in range(4 * params.max_tokens + 10):
        if not engine.has_unfinished():
            return list(last.token_ids), time.perf_counter() - start, steps, last
        for out in engine.step():
            if out.request_id == request_id:
                steps += bool(out.new_token_ids)
                last = out
    raise SystemExit("bench_prediction: a request did not end")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    if args.dry_run:
        args.requests, args.max_tokens = 2, 16
    target, _ = load_demo()
    prompts = benchmark_prompts(args.requests, args.prompt_tokens, seed=5)
    max_len = args.prompt_tokens + args.max_tokens + 16
    plain = lambda **kw: SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, **kw)  # noqa: E731
    reference = Engine(target, None, config=DecoderConfig(k=0, max_seq_len=max_len))
    exact = [run_one(reference, p, plain())[0] for p in prompts]
    rows = []
    for name, drafter, k in [("target alone", None, 0), ("n-gram k=4", NgramDrafter(), 4),
                             ("n-gram k=8", NgramDrafter(), 8)]:
        engine = Engine(target, drafter, config=DecoderConfig(k=k, max_seq_len=max_len))
        for with_prediction in ([False] if drafter is None else [False, True]):
            params = [plain(prediction=e) if with_prediction else plain() for e in exact]
            for p, q in zip(prompts, params):                      # untimed: compiles
                run_one(engine, p, q)
            runs = [run_one(engine, p, q) for p, q in zip(prompts, params)]
            if [r[0] for r in runs] != exact:
                raise SystemExit(f"bench_prediction: {name} changed the greedy output")
            tokens, seconds, steps = (sum(len(r[0]) for r in runs), sum(r[1] for r in runs),
                                      sum(r[2] for r in runs))
            accepted = sum(r[3].num_accepted_prediction_tokens for r in runs)
            rejected = sum(r[3].num_rejected_prediction_tokens for r in runs)
            rows.append((name, "exact output" if with_prediction else "none", tokens / seconds, tokens / steps,
                         accepted, rejected))
    lines = ["| drafter | prediction | tok/s | mean accepted length | accepted prediction tokens | rejected |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {n} | {p} | {t:.0f} | {a:.2f} | {acc} | {rej} |" for n, p, t, a, acc, rej in rows]
    base = {n: t for n, p, t, *_ in rows if p == "none"}
    gains = ", ".join(f"{n}: {t / base[n]:.2f}x" for n, p, t, *_ in rows if p != "none")
    text = "\n".join(lines) + f"\n\nTokens/s with the exact prediction vs none, same drafter: {gains}.\n"
    print(text)
    if args.append and not args.dry_run:
        append_markdown(RESULTS, results_header(
            "Predicted outputs (bench_prediction.py)", "python benchmarks/bench_prediction.py --append",
            f"{args.requests} greedy requests run alone, {args.prompt_tokens}-token benchmark prompts, "
            f"{args.max_tokens} tokens each (eos ignored); demo pair (target), outputs checked identical. ") + text)


if __name__ == "__main__":
    main()
