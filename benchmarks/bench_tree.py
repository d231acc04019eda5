"""Token trees: the tree acceptance ops against the chain's ops at the same number of verified tokens, and
the cost of the tree mask in paged attention against the chain.

* acceptance: ``accept_tree_greedy`` on random trees of N nodes (parents uniform over the earlier nodes,
  targets that follow a child 80% of the time) and ``accept_greedy`` on chains of N drafts; at V =
  32000, ``tree_rejection_sample`` and ``rejection_sample`` (drafts without a distribution) likewise;
* attention: ``paged_attention`` with ``new_token_parents`` (a random tree over T new tokens, token 0 the
  root) against the chain (None) on the same inputs (Llama-8B-like heads, bf16 cache, 8 staged entries).

Device time = ``harness.device_seconds`` (dependent calls inside one executable); µs per call = median of
back-to-back jitted calls. Every ratio comes from the same process, interleaved.

Run: ``python benchmarks/bench_tree.py [--dry-run] [--append]`` (``--dry-run``: tiny sizes).
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

import scv_jax
from bench_attention import LLAMA_8B, TINY, make_inputs
from harness import device_seconds, median_seconds, publish


def random_tree(rng, batch: int, n: int, vocab_size: int):
    """(tokens, parents, num_nodes, greedy targets, target probs or None) of B random trees."""
    parents = np.array([[rng.integers(-1, i) for i in range(n)] for _ in range(batch)], np.int32)
    tokens = rng.integers(0, vocab_size, (batch, n)).astype(np.int32)
    target = rng.integers(0, vocab_size, (batch, n + 1)).astype(np.int32)
    for b in range(batch):
        for column in range(n + 1):
            children = np.flatnonzero(parents[b] == column - 1)
            if len(children) and rng.random() < 0.8:
                target[b, column] = tokens[b, rng.choice(children)]
    return jnp.asarray(tokens), jnp.asarray(parents), jnp.full((batch,), n, jnp.int32), jnp.asarray(target)


def timed(fn, args, *, repeats: int, iterations: int) -> tuple[float, float]:
    """(µs per call, device µs per call)."""
    call = jax.jit(fn)
    return (median_seconds(lambda: call(*args), repeats, 5) * 1e6,
            device_seconds(fn, args, iterations=iterations, repeats=repeats) * 1e6)


def acceptance_rows(batches, sizes, vocab_size: int, *, max_sampling_batch: int, repeats: int,
                    iterations: int) -> list[str]:
    rng = np.random.default_rng(0)
    lines = []
    for batch in batches:
        for n, depth in sizes:
            tokens, parents, num_nodes, target = random_tree(rng, batch, n, 8)
            drafts, targets = tokens.reshape(-1), target[:, 1:].reshape(-1)
            cu = jnp.arange(0, batch * n + 1, n, dtype=jnp.int32)
            bonus = target[:, 0]
            probs = None if batch > max_sampling_batch else jax.nn.softmax(jax.random.normal(jax.random.key(batch * n), (batch, n + 1, vocab_size)), -1)
            key = jax.random.key(1)
            ops = [
                ("accept_tree_greedy", functools.partial(scv_jax.accept_tree_greedy, max_depth=depth, backend="xla"),
                 (tokens, parents, num_nodes, target)),
                ("accept_greedy (chain)", functools.partial(scv_jax.accept_greedy, max_spec_len=n, backend="xla"),
                 (drafts, cu, targets, bonus)),
                ("tree_rejection_sample", lambda t, p, c, q: scv_jax.tree_rejection_sample(
                    t, p, c, q, key=key, max_depth=depth), (tokens, parents, num_nodes, probs)),
                ("rejection_sample (chain)", lambda d, c, q, b: scv_jax.rejection_sample(
                    d, c, None, q, b, key=key, max_spec_len=n, backend="xla"),
                 (drafts, cu, None if probs is None else probs[:, 1:].reshape(batch * n, vocab_size), bonus)),
            ]
            for name, fn, args in ops:
                sampling = "sample" in name
                if sampling and batch > max_sampling_batch:
                    continue
                call_us, device_us = timed(fn, args, repeats=repeats, iterations=iterations)
                lines.append(f"| {name} | {batch} | {n} | {'-' if 'chain' in name else depth} | "
                             f"{vocab_size if sampling else '-'} | {call_us:.1f} | {device_us:.1f} |")
    return ["| op | B | N (nodes or drafts) | max_depth | V | µs per call | device µs |",
            "|---|---:|---:|---:|---:|---:|---:|"] + lines


def attention_rows(shape, batches, contexts, tokens_list, *, repeats: int, iterations: int) -> list[str]:
    rng = np.random.default_rng(1)
    lines = []
    for batch in batches:
        for context in contexts:
            for tokens in tokens_list:
                inputs = make_inputs(shape, batch, context, tokens, "bfloat16")
                parents = jnp.asarray([[-1] + [rng.integers(0, i) for i in range(1, tokens)] for _ in range(batch)],
                                      jnp.int32)
                q = inputs.pop("q")
                chain = lambda q, rest, parents: scv_jax.paged_attention(q, **rest, backend="xla")  # noqa: E731
                tree = lambda q, rest, parents: scv_jax.paged_attention(  # noqa: E731
                    q, **rest, new_token_parents=parents, backend="xla")
                times = {}
                for _ in range(2):   # interleaved; the faster of the two rounds
                    for name, fn in (("chain", chain), ("tree", tree)):
                        result = timed(fn, (q, inputs, parents), repeats=repeats, iterations=iterations)
                        times[name] = min(times.get(name, result), result, key=lambda r: r[1])
                chain_us, tree_us = times["chain"][1], times["tree"][1]
                ratio = f"{tree_us / chain_us:.2f}" if chain_us > 0 else "-"   # (a dry run's times may read 0)
                lines.append(f"| {batch} | {context} | {tokens} | {chain_us:.0f} | {tree_us:.0f} | {ratio} |")
    return ["| B | context | T (new tokens) | chain device µs | tree device µs | tree / chain |",
            "|---:|---:|---:|---:|---:|---:|"] + lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes (checks the script runs)")
    parser.add_argument("--append", action="store_true", help="append the tables to benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    if args.dry_run:
        accept = acceptance_rows((2,), ((4, 2),), 16, max_sampling_batch=2, repeats=1, iterations=2)
        attend = attention_rows(TINY, (1,), (32,), (3,), repeats=1, iterations=2)
    else:
        accept = acceptance_rows((1, 8, 64), ((16, 6), (32, 8), (64, 10)), 32000, max_sampling_batch=8, repeats=5,
                                 iterations=10)
        attend = attention_rows(LLAMA_8B, (1, 8), (1024,), (9, 17, 33), repeats=5, iterations=8)
    body = "\n".join(["Tree acceptance vs the chain at the same number of verified tokens (XLA):", "", *accept,
                      "", "Paged attention (XLA), the tree mask vs the chain on the same inputs:", "", *attend])
    publish(__file__, "bench_tree: tree acceptance and the tree attention mask",
            "random trees; targets follow a child 80% of the time; attention: 32 q heads, 8 kv heads, head_dim 128, "
            "block 16, bf16 cache, 8 staged entries. ", body, append=args.append, argv=argv)


if __name__ == "__main__":
    main()
