"""Token trees: the tree acceptance ops against the chain's ops at the same number of verified tokens, and
the cost of the tree mask in paged attention against the chain.

* acceptance: ``accept_tree_greedy`` on random trees of N nodes (parents uniform over the earlier nodes,
  targets that follow a child 80% of the time) and ``accept_greedy`` on chains of N drafts; at V =
  32000, ``tree_rejection_sample`` and ``rejection_sample`` (drafts without a distribution) likewise;
* attention: ``paged_attention`` with ``new_token_parents`` (a random tree over T new tokens, token 0 the
  root) against the chain (None) on the same inputs (Llama-8B-like heads, bf16 cache, 8 staged entries).

* ``--e2e``: end to end on the demo pair (``scv_jax.models.load_demo()``), greedy: mean accepted length per
  step (tokens emitted per request per step) and tokens/s of chain k = 8, a 16-node tree (max_depth 6,
  branching 3) and a 32-node tree (max_depth 8, branching 4), with the draft model and with n-gram
  drafting (``NgramDrafter(1, 3)``; its tries ignore branching), on stdlib and mixed prompts
  (``scv_jax.demo.e2e``), batch 1 (the prompts one at a time) and 4; every configuration warmed up,
  then ``--rounds`` interleaved rounds in one process (median tokens/s; autoregressive for the ratio).

Device time = ``harness.device_seconds`` (dependent calls inside one executable); µs per call = median of
back-to-back jitted calls. Every ratio comes from the same process, interleaved.

Run: ``python benchmarks/bench_tree.py [--dry-run] [--e2e [--rounds N]] [--append]`` (``--dry-run``: tiny
sizes; with ``--e2e``: a tiny random pair, few tokens).
"""

from __future__ import annotations

import argparse
import functools
import os

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


E2E_MODES = {"chain k=8": dict(k=8), "tree 16 (d6, b3)": dict(tree=scv_jax.TreeConfig(6, 3, 16)),
             "tree 32 (d8, b4)": dict(tree=scv_jax.TreeConfig(8, 4, 32))}


def e2e_rows(*, dry_run: bool, rounds: int) -> list[str]:
    """The end-to-end table: one row per (drafter, workload, batch, mode)."""
    from scv_jax.demo.e2e import benchmark_prompts, mixed_prompts

    if dry_run:
        from scv_jax.models import Transformer, TransformerConfig
        from flax import nnx
        config = TransformerConfig(vocab_size=256, num_layers=1, d_model=32, num_heads=2, num_kv_heads=1,
                                   head_dim=16, ffn_dim=48)
        target, draft = Transformer(config, rngs=nnx.Rngs(0)), Transformer(config, rngs=nnx.Rngs(1))
        workloads, batches, max_new = {"stdlib": benchmark_prompts(4, length=16)}, (1, 4), 8
    else:
        target, draft = scv_jax.models.load_demo()
        workloads, batches, max_new = {"stdlib": benchmark_prompts(4), "mixed": mixed_prompts(4)}, (1, 4), 64
    longest = max(len(p) for ps in workloads.values() for p in ps) + max_new
    base = dict(block_size=16, num_blocks=256, max_seq_len=longest, batch_buckets=(1, 4),
                context_buckets=(-(-longest // 16),), backend="xla")
    drafters = {"draft model": draft, "n-gram": scv_jax.NgramDrafter(1, 3)}
    decoders = {("autoregressive", "-"): scv_jax.SpeculativeDecoder(target, None, config=scv_jax.DecoderConfig(**base))}
    for drafter_name, drafter in drafters.items():
        for mode, fields in E2E_MODES.items():
            decoders[(drafter_name, mode)] = scv_jax.SpeculativeDecoder(
                target, drafter, config=scv_jax.DecoderConfig(**base, **fields))
    results: dict[tuple, list] = {}
    for decoder in decoders.values():      # compile everything, then one untimed call per shape
        decoder.warmup(max(batches), longest, temperatures=0.0)
        for prompts in workloads.values():
            for batch in batches:
                decoder.generate(prompts, max_new, max_num_seqs=batch)
    for _ in range(rounds):                # interleaved rounds
        for workload, prompts in workloads.items():
            for batch in batches:
                for name, decoder in decoders.items():
                    stats = decoder.generate(prompts, max_new, max_num_seqs=batch).stats
                    results.setdefault((*name, workload, batch), []).append(
                        (stats.tokens_per_second, stats.mean_accepted_length))
    lines = []
    for workload in workloads:
        for batch in batches:
            base_tps = float(np.median([r[0] for r in results[("autoregressive", "-", workload, batch)]]))
            for name in decoders:
                runs = results[(*name, workload, batch)]
                tps = float(np.median([r[0] for r in runs]))
                lines.append(f"| {name[0]} | {name[1]} | {workload} | {batch} | {runs[0][1]:.2f} | {tps:.1f} | "
                             f"{min(r[0] for r in runs):.1f}-{max(r[0] for r in runs):.1f} | {tps / base_tps:.2f} |")
    return ["| drafter | mode | prompts | B | mean accepted length | tokens/s (median) | range | vs autoregressive |",
            "|---|---|---|---:|---:|---:|---|---:|"] + lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes (checks the script runs)")
    parser.add_argument("--append", action="store_true", help="append the tables to benchmarks/RESULTS.md")
    parser.add_argument("--e2e", action="store_true", help="end to end: chain k=8 vs 16- and 32-node trees")
    parser.add_argument("--rounds", type=int, default=3, help="--e2e: interleaved rounds")
    args = parser.parse_args(argv)
    if args.e2e:
        body = "\n".join(e2e_rows(dry_run=args.dry_run, rounds=1 if args.dry_run else args.rounds))
        load = " ".join(f"{x:.1f}" for x in os.getloadavg())
        publish(__file__, "bench_tree --e2e: chain k=8 vs token trees, end to end (greedy)",
                "demo pair (6-layer byte target, 1-layer draft) or n-gram (min_n 1, max_n 3); 4 prompts of each "
                f"workload, 64 new tokens each; batch 1 = one request at a time; backend xla; load average at the "
                f"end {load} (1/5/15 min; other agents share the 2 cores). ", body, append=args.append, argv=argv)
        return
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
