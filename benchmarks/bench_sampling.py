"""filtered_probs per decode step: the target's [B, k + 1, V] logits through each request's temperature,
top-k, top-p and min-p, against a plain softmax over the same logits.

Logits are LLM-like (Zipf-shaped: logit = -1.5 log(rank) + noise, ranks shuffled), so top-p 0.9 cuts
inside the first 256 candidates (``lax.top_k``); "top-p 0.99 flat" uses N(0, 1) logits, whose top-p
set is thousands of tokens wide: every row's cut-off then comes from the bisection. Sampled rows use
temperature 0.8; "greedy" rows temperature 0 (one-hot of the argmax). Each figure: median wall time of
``repeats`` jitted calls, each waited for (``jax.block_until_ready``), inputs on the device.

Run: ``python benchmarks/bench_sampling.py [--quick] [--append]``.
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp

import scv_jax
from harness import median_seconds, publish

BATCHES = (1, 8, 64)
VOCABS = (32_000, 152_064)
STEP_TOKENS = 5   # k + 1 with k = 4
# name -> (temperature, top_k, top_p, min_p, logits)
VARIANTS = {"greedy": (0.0, 0, 1.0, 0.0, "zipf"), "no filter": (0.8, 0, 1.0, 0.0, "zipf"),
            "top-k 50": (0.8, 50, 1.0, 0.0, "zipf"), "top-p 0.9": (0.8, 0, 0.9, 0.0, "zipf"),
            "all (k 50, p 0.9, min-p 0.05)": (0.8, 50, 0.9, 0.05, "zipf"),
            "top-p 0.99 flat": (0.8, 0, 0.99, 0.0, "normal")}


def step_logits(batch: int, vocab: int, kind: str, seed: int = 0) -> jax.Array:
    """float32[batch, STEP_TOKENS, vocab] target logits."""
    key = jax.random.key(seed)
    shape = (batch, STEP_TOKENS, vocab)
    noise = jax.random.normal(key, shape, jnp.float32)
    if kind == "normal":
        return noise
    ranks = jnp.argsort(jax.random.uniform(jax.random.fold_in(key, 1), shape), axis=-1) + 1
    return -1.5 * jnp.log(ranks.astype(jnp.float32)) + 0.3 * noise


def run(batches=BATCHES, vocabs=VOCABS, repeats: int = 5) -> list[tuple[int, int, str, float, float]]:
    """(B, V, variant, ms per step, ratio to softmax) rows."""
    softmax = jax.jit(lambda x: jax.nn.softmax(x, axis=-1))
    rows = []
    for vocab in vocabs:
        for batch in batches:
            logits = {kind: step_logits(batch, vocab, kind) for kind in ("zipf", "normal")}
            base = median_seconds(lambda: softmax(logits["zipf"]), repeats)
            rows.append((batch, vocab, "softmax (floor)", base * 1e3, 1.0))
            for name, (t, k, p, m, kind) in VARIANTS.items():
                params = (jnp.full((batch,), t, jnp.float32), jnp.full((batch,), k, jnp.int32),
                          jnp.full((batch,), p, jnp.float32), jnp.full((batch,), m, jnp.float32))
                seconds = median_seconds(lambda: scv_jax.filtered_probs(logits[kind], *params), repeats)
                rows.append((batch, vocab, name, seconds * 1e3, seconds / base))
                print(f"B={batch} V={vocab} {name}: {seconds * 1e3:.1f} ms ({seconds / base:.2f}x softmax)",
                      flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="B in (1, 8), V = 32000, 3 repeats")
    parser.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    rows = run((1, 8), (32_000,), 3) if args.quick else run()
    body = "| B | V | variant | ms per step | x softmax |\n|---:|---:|---|---:|---:|\n" + "".join(
        f"| {b} | {v} | {name} | {ms:.2f} | {ratio:.2f} |\n" for b, v, name, ms, ratio in rows)
    details = (f"CPU shared with other jobs ({os.cpu_count()} cores); target logits [B, {STEP_TOKENS}, V] float32; "
               "median of jitted calls each waited for; GPU figures pending (no GPU lent). ")
    publish(__file__, "filtered_probs per decode step (temperature, top-k, top-p, min-p)", details, body,
            append=args.append)


if __name__ == "__main__":
    main()
