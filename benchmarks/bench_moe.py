"""Experts a verify step reads on mixture-of-experts targets, and the k the adaptive controller picks when
a step's cost grows with them.

A verify step scores ``batch * (k + 1)`` tokens; each token's router picks ``top_k`` of E experts per
layer, so the step reads the weights of every DISTINCT expert its tokens picked. Three parts:

1. Distinct experts per layer (mean over layers) at ``--batches`` (1 / 16 / 64) and k = 0..8, and the expert weight
   bytes a step reads (distinct x layers x one expert's bytes):
   - a Qwen3-30B-A3B-shaped target (48 layers, 128 experts, top-8, expert width 768, bfloat16): routing of
     real text is not available, so the uniform-routing expectation E * (1 - (1 - top_k / E) ^ tokens),
     and a measurement with random weights (``moe.route`` of random hidden states through 48 random
     routers: close to uniform by construction, and within 1% of it);
   - the tiny MoE fixtures (tests/models/hf_fixtures: qwen3_moe, mixtral, gpt_oss; float32, random weights):
     real forwards over random tokens (a ``--prefix``-token context, then the k + 1 verified tokens), the
     experts ``moe.route`` picks from each layer's router logits.
2. The 30B-shaped verify forward compiled on this CPU with nothing materialised (abstract parameters,
   ``compile_8b.abstract_transformer``): XLA's ``memory_analysis()`` (weights = arguments, temporaries)
   and ``cost_analysis()`` (FLOPs, bytes accessed), beside the routing-aware weight bytes of part 1.
   XLA's static analysis cannot see the routing: it counts every expert.
3. The adaptive controller's k on that MoE target vs dense ones: the controller learns only from
   measured step times, so it is driven by ``adaptive_sim.simulate`` (as ``sim_adaptive.py``) with step
   times from a roofline of the bytes read (weights: non-expert ones + the expected distinct experts')
   and the FLOPs (2 x active parameters per token), at an assumed bandwidth and FLOP rate (H100-like
   defaults), plus ``--draft-ratio`` x the target's batch-1 k = 0 step per draft forward. Dense: the same
   active weights (6.1 GB) read whole every step, or all 60 GB. Constant conditional acceptance
   alpha at every position; the KV cache's reads are left out (short contexts).

Run: ``JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_moe.py [--batches 1 16 64] [--max-k 8]
[--alphas 0.6 0.8] [--json PATH] [--append] [--dry-run]``
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from adaptive_sim import K_MAX, FixedPolicy, OraclePolicy, Scenario, constant_acceptance, simulate  # noqa: E402
from compile_8b import abstract_transformer  # noqa: E402
from harness import publish  # noqa: E402
from scv_jax import AdaptiveController  # noqa: E402
from scv_jax.models import Transformer, TransformerConfig, load_hf  # noqa: E402
from scv_jax.models.attention import causal_attention  # noqa: E402
from scv_jax.models.moe import route  # noqa: E402

QWEN3_30B_A3B = TransformerConfig(vocab_size=151936, num_layers=48, d_model=2048, num_heads=32, num_kv_heads=4,
                                  head_dim=128, ffn_dim=6144, rope_theta=1e6, norm_eps=1e-6, tie_embeddings=False,
                                  dtype="bfloat16", qk_norm=True, num_experts=128, num_experts_per_tok=8,
                                  moe_ffn_dim=768, norm_topk_prob=True)
# --dry-run's stand-in: the 30B's routing (128 experts, top-8) at toy widths
TINY_30B = dataclasses.replace(QWEN3_30B_A3B, vocab_size=256, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2,
                               head_dim=16, ffn_dim=64, moe_ffn_dim=32)
FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "models", "hf_fixtures")
FIXTURE_NAMES = ("qwen3_moe", "mixtral", "gpt_oss")


# ---------------------------------------------------------------------------------------- part 1: experts
def expected_distinct(tokens: np.ndarray | int, num_experts: int, top_k: int) -> np.ndarray:
    """Expected distinct experts ``tokens`` tokens pick under uniform routing (each token's ``top_k``
    distinct experts a uniform draw; an expert is missed by a token with chance 1 - top_k / E)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** np.asarray(tokens, np.float64))


def distinct_per_layer(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """float64[L] distinct experts of int[L, ...] chosen experts, per layer."""
    flat = experts.reshape(experts.shape[0], -1)
    hit = np.zeros((flat.shape[0], num_experts), bool)
    hit[np.arange(flat.shape[0])[:, None], flat] = True
    return hit.sum(axis=1).astype(np.float64)


@dataclasses.dataclass(frozen=True)
class WeightBytes:
    """A MoE model's weight bytes: ``per_expert`` (one expert of one layer: gate, up, down and biases),
    ``experts`` (all of them), ``other`` (everything else: attention, norms, routers, embedding, LM head)
    and ``embedding`` (the table a forward gathers rows of, not reads whole)."""

    per_expert: int
    experts: int
    other: int
    embedding: int

    @classmethod
    def of(cls, model: Transformer) -> "WeightBytes":
        """From ``model``'s parameters (concrete or abstract)."""
        config = model.config
        sizes = {jax.tree_util.keystr(path): math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
                 for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))}
        experts = sum(n for name, n in sizes.items() if "experts_" in name)
        embedding = sum(n for name, n in sizes.items() if name.startswith("['embed']"))
        return cls(experts // (config.num_experts * config.num_layers), experts,
                   sum(sizes.values()) - experts, embedding)


def routed_experts(model: Transformer, tokens: jax.Array) -> jax.Array:
    """int32[L, B, S, top_k]: the experts each layer's router picks (``moe.route``) for each token of a plain
    causal forward over tokens int32[B, S]; ``model`` a ``per_layer()`` MoE model (its blocks as ``Block``
    runs them)."""
    config = model.config
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    x, chosen = model.embed(tokens), []
    for i, block in enumerate(model.blocks):
        def attend(q, k, v, sinks, window=config.layer_window(i)):
            return causal_attention(q, k, v, positions, sliding_window=window, sinks=sinks)
        x = x + block.attn(block.attn_norm(x), positions, attend)[0]
        h = block.mlp_norm(x)
        chosen.append(route(block.mlp.router(h), config.num_experts_per_tok, config.norm_topk_prob)[1])
        x = x + block.mlp(h)
    return jnp.stack(chosen)


def fixture_distinct(model: Transformer, batches: list[int], max_k: int, prefix: int, seeds: int
                     ) -> dict[int, np.ndarray]:
    """Per batch B of ``batches``, float64[max_k + 1]: distinct experts per layer (mean over layers and
    ``seeds`` draws of random tokens) of a verify step of B requests with k = 0..max_k drafts: the k + 1
    tokens after a ``prefix``-token context of each row. One forward of max(batches) rows per seed (a
    row's routing depends on its own tokens alone), its first B rows for batch B."""
    config = model.config
    forward = nnx.jit(routed_experts)
    out = {batch: np.zeros(max_k + 1) for batch in batches}
    for seed in range(seeds):
        tokens = jax.random.randint(jax.random.key(seed), (max(batches), prefix + max_k + 1), 0, config.vocab_size)
        experts = np.asarray(forward(model, tokens))[:, :, prefix:]           # [L, rows, max_k + 1, top_k]
        for batch in batches:
            out[batch] += [distinct_per_layer(experts[:, :batch, :k + 1], config.num_experts).mean()
                           for k in range(max_k + 1)]
    return {batch: counts / seeds for batch, counts in out.items()}


def random_routing_distinct(config: TransformerConfig, batches: list[int], max_k: int, seed: int = 0
                            ) -> dict[int, np.ndarray]:
    """As ``fixture_distinct`` for ``config``'s routing with random weights: ``moe.route`` of unit-normal
    float32 hidden states through ``config.num_layers`` random routers (normal, std 1 / sqrt(d_model)),
    max(batches) rows of max_k + 1 tokens, the first B rows for batch B."""
    rows, d = max(batches), config.d_model
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((rows * (max_k + 1), d), np.float32)
    routers = rng.standard_normal((config.num_layers, d, config.num_experts), np.float32) / np.float32(math.sqrt(d))
    pick = jax.jit(jax.vmap(lambda w: route(hidden @ w, config.num_experts_per_tok, config.norm_topk_prob)[1]))
    experts = np.asarray(pick(routers)).reshape(config.num_layers, rows, max_k + 1, -1)
    return {batch: np.array([distinct_per_layer(experts[:, :batch, :k + 1], config.num_experts).mean()
                             for k in range(max_k + 1)]) for batch in batches}


def expert_rows(args: argparse.Namespace, config: TransformerConfig) -> list[dict]:
    """Part 1's rows: per model, source and batch, distinct experts per layer and expert bytes read per
    step at k = 0..max_k."""
    ks = np.arange(args.max_k + 1)
    rows = []

    def add(model: str, source: str, batch: int, distinct: np.ndarray, weights: WeightBytes,
            layers: int, num_experts: int, top_k: int) -> None:
        rows.append({"model": model, "source": source, "batch": batch, "num_experts": num_experts, "top_k": top_k,
                     "layers": layers, "expert_bytes": weights.per_expert, "k": ks.tolist(),
                     "distinct": distinct.tolist(), "bytes": (distinct * layers * weights.per_expert).tolist()})
        print(f"  {model}, {source}, batch {batch}: distinct experts per layer at k = 0..{args.max_k}: "
              + " ".join(f"{d:.1f}" for d in distinct), flush=True)

    weights = WeightBytes.of(abstract_transformer(config, "per_layer"))
    e, top_k, layers = config.num_experts, config.num_experts_per_tok, config.num_layers
    random = random_routing_distinct(config, args.batches, args.max_k, args.seed)
    for batch in args.batches:
        add(args.shape_name, "uniform expectation", batch, expected_distinct(batch * (ks + 1), e, top_k), weights,
            layers, e, top_k)
        add(args.shape_name, "random weights", batch, random[batch], weights, layers, e, top_k)
    for name in FIXTURE_NAMES:
        model = load_hf(os.path.join(FIXTURES, name), dtype="float32").per_layer()
        c = model.config
        fixture_weights = WeightBytes.of(model)
        for batch, distinct in fixture_distinct(model, args.batches, args.max_k, args.prefix, args.seeds).items():
            add(name, f"random tokens (mean of {args.seeds})", batch, distinct, fixture_weights, c.num_layers,
                c.num_experts, c.num_experts_per_tok)
    return rows


def readable_bytes(n: float) -> str:
    """``n`` bytes in GB, MB, kB or B (3 significant digits)."""
    for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.3g} B"


def experts_table(rows: list[dict]) -> str:
    ks = rows[0]["k"]
    lines = ["| model (E, top-k) | routing | batch | " + " | ".join(f"k={k}" for k in ks)
             + " | expert weights read at k=0 / k=max |", "|---|---|---:|" + "---:|" * (len(ks) + 1)]
    for row in rows:
        lines.append(f"| {row['model']} ({row['num_experts']}, {row['top_k']}) | {row['source']} | {row['batch']} | "
                     + " | ".join(f"{d:.1f}" for d in row["distinct"])
                     + f" | {readable_bytes(row['bytes'][0])} / {readable_bytes(row['bytes'][-1])} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- part 2: compiled
def compiled_rows(config: TransformerConfig, batches: list[int], ks: list[int]) -> list[dict]:
    """XLA's memory and cost analyses of the verify forward (``model(tokens)`` over int32[batch, k + 1],
    the layers unrolled as the decoder runs them), abstract parameters; with the routing-aware weight
    bytes (non-expert weights but the embedding table, plus the uniform expectation's experts)."""
    model = abstract_transformer(config, "per_layer").per_layer()
    graphdef, params = nnx.split(model)
    forward = jax.jit(lambda p, tokens: nnx.merge(graphdef, p)(tokens))
    weights = WeightBytes.of(model)
    rows = []
    for batch in batches:
        for k in ks:
            start = time.perf_counter()
            compiled = forward.lower(params, jax.ShapeDtypeStruct((batch, k + 1), jnp.int32)).compile()
            memory, cost = compiled.memory_analysis(), compiled.cost_analysis()
            distinct = float(expected_distinct(batch * (k + 1), config.num_experts, config.num_experts_per_tok))
            rows.append({"batch": batch, "k": k, "compile_s": time.perf_counter() - start,
                         "argument_bytes": memory.argument_size_in_bytes, "temp_bytes": memory.temp_size_in_bytes,
                         "xla_flops": cost["flops"], "xla_bytes_accessed": cost["bytes accessed"],
                         "routed_bytes": weights.other - weights.embedding
                         + distinct * config.num_layers * weights.per_expert})
            print(f"  compiled batch {batch}, k {k}: {rows[-1]['compile_s']:.1f} s", flush=True)
    return rows


def compiled_table(rows: list[dict]) -> str:
    gb = lambda n: f"{n / 1e9:,.2f}"  # noqa: E731
    lines = ["| batch | k | weights (arguments) GB | weights read, routing-aware GB | XLA bytes accessed GB "
             "| XLA GFLOP | temporaries GB | compile s |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['batch']} | {r['k']} | {gb(r['argument_bytes'])} | {gb(r['routed_bytes'])} | "
              f"{gb(r['xla_bytes_accessed'])} | {r['xla_flops'] / 1e9:,.0f} | {gb(r['temp_bytes'])} | "
              f"{r['compile_s']:.1f} |" for r in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- part 3: controller
@dataclasses.dataclass(frozen=True)
class RooflineCost:
    """True step seconds from weight bytes and FLOPs (duck-types ``adaptive_sim.StepCost``): a target
    forward over N tokens takes max(bytes(N) / ``bandwidth``, N * ``flops_per_token`` / ``flop_rate``),
    bytes(N) = ``fixed_bytes`` + the expected distinct experts of N tokens x ``layers`` x
    ``expert_bytes`` (0 for a dense model); each sequential draft forward (and a catch-up) takes
    ``draft_seconds``."""

    fixed_bytes: float
    expert_bytes: float
    num_experts: int
    top_k: int
    layers: int
    flops_per_token: float
    bandwidth: float
    flop_rate: float
    draft_seconds: float

    def target(self, tokens: np.ndarray | int) -> np.ndarray:
        """Seconds of a target forward over ``tokens`` tokens."""
        tokens = np.asarray(tokens, np.float64)
        experts = (expected_distinct(tokens, self.num_experts, self.top_k) * self.layers * self.expert_bytes
                   if self.expert_bytes else 0.0)
        return np.maximum((self.fixed_bytes + experts) / self.bandwidth, tokens * self.flops_per_token / self.flop_rate)

    @property
    def target_seconds(self) -> float:
        return float(self.target(1))

    def seconds(self, batch_size: int, num_draft_tokens: np.ndarray, catch_up_tokens: int = 0) -> float:
        drafts = np.asarray(num_draft_tokens)
        draft_forwards = drafts.max(initial=0) + (1 if catch_up_tokens else 0)
        return float(self.target(batch_size + drafts.sum()) + draft_forwards * self.draft_seconds)

    def uniform_seconds(self, batch_size: int, k: np.ndarray) -> np.ndarray:
        k = np.asarray(k, np.float64)
        return self.target(batch_size * (k + 1)) + k * self.draft_seconds


def cost_models(config: TransformerConfig, bandwidth: float, flop_rate: float, draft_ratio: float
                ) -> dict[str, RooflineCost]:
    """The MoE target of ``config`` and two dense ones: its active weights read whole every step, and all
    its weights read (and computed) whole; the same draft (``draft_ratio`` x the MoE's batch-1 step)."""
    w = WeightBytes.of(abstract_transformer(config, "per_layer"))
    itemsize = jnp.dtype(config.dtype).itemsize
    other = w.other - w.embedding                   # read whole every step (the embedding: a few rows)
    active = other + config.num_layers * config.num_experts_per_tok * w.per_expert
    flops = lambda n_bytes: 2 * n_bytes / itemsize  # noqa: E731  (2 FLOPs per weight per token)
    base = dict(num_experts=config.num_experts, top_k=config.num_experts_per_tok, layers=config.num_layers,
                bandwidth=bandwidth, flop_rate=flop_rate, draft_seconds=0.0)
    moe = RooflineCost(fixed_bytes=other, expert_bytes=w.per_expert, flops_per_token=flops(active), **base)
    base["draft_seconds"] = draft_ratio * moe.target_seconds
    return {"MoE": dataclasses.replace(moe, draft_seconds=base["draft_seconds"]),
            f"dense, active weights ({active / 1e9:.3g} GB)": RooflineCost(
                fixed_bytes=active, expert_bytes=0.0, flops_per_token=flops(active), **base),
            f"dense, all weights ({(other + w.experts) / 1e9:.3g} GB)": RooflineCost(
                fixed_bytes=other + w.experts, expert_bytes=0.0, flops_per_token=flops(other + w.experts), **base)}


def controller_rows(args: argparse.Namespace, config: TransformerConfig) -> list[dict]:
    """Part 3's rows: per cost model, batch and alpha, the k the oracle (the cost model's best) and the
    adaptive controller (most frequent over the second half of the run) choose, and throughput ratios."""
    rows = []
    for name, cost in cost_models(config, args.bandwidth_gbs * 1e9, args.tflops * 1e12, args.draft_ratio).items():
        for batch in args.batches:
            for alpha in args.alphas:
                scenario = Scenario(f"{name}, B={batch}, a={alpha}", constant_acceptance(args.ticks, alpha),
                                    np.full(args.ticks, batch, np.int64), cost)
                oracle = simulate(OraclePolicy(scenario, tuple(range(args.max_k + 1))), scenario, args.seed)
                adaptive = simulate(AdaptiveController(k_max=args.max_k), scenario, args.seed)
                held = collections.Counter(adaptive.k[adaptive.k.size // 2:].tolist()).most_common(1)[0][0]
                no_drafts = simulate(FixedPolicy(0), scenario, args.seed)
                seconds = cost.uniform_seconds(batch, np.arange(args.max_k + 1))
                rows.append({"model": name, "batch": batch, "alpha": alpha, "oracle_k": int(np.median(oracle.k)),
                             "adaptive_k": int(held), "steps": int(adaptive.k.size),
                             "step_ms": (seconds * 1e3).tolist(),
                             "adaptive_vs_oracle": adaptive.throughput / oracle.throughput,
                             "speedup_vs_k0": adaptive.throughput / no_drafts.throughput})
                r = rows[-1]
                print(f"  {name}, batch {batch}, alpha {alpha}: best k {r['oracle_k']}, controller k "
                      f"{r['adaptive_k']} ({r['steps']} steps)", flush=True)
    return rows


def controller_table(rows: list[dict]) -> str:
    lines = ["| target cost model | batch | alpha | step ms at k=0 / 2 / 4 / 8 (T(8)/T(0)) | best k (cost model) "
             "| adaptive controller's k | controller / oracle tok/s | controller / k=0 tok/s |",
             "|---|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        ms = r["step_ms"]
        shown = " / ".join(f"{ms[k]:.3g}" for k in (0, 2, 4, 8) if k < len(ms))
        lines.append(f"| {r['model']} | {r['batch']} | {r['alpha']} | {shown} ({ms[-1] / ms[0]:.2f}x) | "
                     f"{r['oracle_k']} | {r['adaptive_k']} | {r['adaptive_vs_oracle']:.3f} | "
                     f"{r['speedup_vs_k0']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    """Runs the three parts, prints (and with ``--append`` appends) the tables; returns the JSON rows."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--max-k", type=int, default=8, help="k = 0..max-k drafts per request")
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.6, 0.8],
                        help="conditional acceptance per draft position (part 3)")
    parser.add_argument("--prefix", type=int, default=16, help="context tokens before the verified ones (fixtures)")
    parser.add_argument("--seeds", type=int, default=3, help="random token draws per fixture row")
    parser.add_argument("--compile-k", type=int, nargs="*", default=[0, 8], help="k of the compiled 30B steps")
    parser.add_argument("--bandwidth-gbs", type=float, default=3350.0, help="weight-read bandwidth (H100 HBM3)")
    parser.add_argument("--tflops", type=float, default=400.0,
                        help="achieved bf16 TFLOP/s (about 40%% of an H100's dense peak)")
    parser.add_argument("--draft-ratio", type=float, default=0.05,
                        help="one draft forward / the MoE target's batch-1 k = 0 step")
    parser.add_argument("--ticks", type=int, default=2000, help="simulated length in batch-1 target forwards")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="write every row as JSON")
    parser.add_argument("--append", action="store_true", help="append the tables to benchmarks/RESULTS.md")
    parser.add_argument("--dry-run", action="store_true",
                        help="seconds: the 30B's routing at toy widths (2 layers), batch 1 and 4, k <= 3, 1 seed, "
                             "one compiled step (batch 1, k 3), 200 ticks")
    args = parser.parse_args(argv)
    config = QWEN3_30B_A3B
    args.shape_name = "Qwen3-30B-A3B shape"
    if args.dry_run:
        config, args.shape_name = TINY_30B, "30B routing, toy widths"
        args.batches, args.max_k, args.seeds, args.ticks, args.compile_k = [1, 4], 3, 1, 200, [3]
    if not 0 <= args.max_k <= K_MAX:
        parser.error(f"--max-k must be in [0, {K_MAX}] (the simulator's draft positions)")
    if any(k > args.max_k for k in args.compile_k):
        parser.error(f"--compile-k must be <= --max-k ({args.max_k})")
    start = time.perf_counter()
    print("distinct experts per verify step:", flush=True)
    experts = expert_rows(args, config)
    print(f"[{time.perf_counter() - start:.0f} s] compiling the {args.shape_name} verify forward:", flush=True)
    compiled = compiled_rows(config, args.batches[:1] if args.dry_run else args.batches, args.compile_k)
    print(f"[{time.perf_counter() - start:.0f} s] adaptive controller on roofline step costs:", flush=True)
    controller = controller_rows(args, config)
    result = {"experts": experts, "compiled": compiled, "controller": controller}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    body = (f"Distinct experts per layer a verify step of batch x (k + 1) tokens touches (mean over layers), "
            f"and the expert weights it reads (distinct x layers x one expert's bytes):\n\n{experts_table(experts)}"
            f"\n\nThe {args.shape_name} verify forward (`model(tokens)` over [batch, k + 1], layers unrolled) "
            f"compiled on this CPU from abstract parameters: `memory_analysis()` and `cost_analysis()` (static: "
            f"every expert counted, with the CPU lowering's copies of the expert weights), beside the weights a "
            f"step reads with routing (non-expert weights but the embedding table, plus the uniform "
            f"expectation's experts):\n\n{compiled_table(compiled)}\n\n"
            f"The adaptive controller (`AdaptiveController(k_max={args.max_k})`, its own code, learning from "
            f"simulated step times: `adaptive_sim.simulate`, {args.ticks} ticks) on roofline step costs: "
            f"max(weights read / {args.bandwidth_gbs:g} GB/s, 2 x active parameters x tokens / "
            f"{args.tflops:g} TFLOP/s), the MoE's weights read from the uniform expectation; each draft "
            f"forward {args.draft_ratio:g} x the MoE's batch-1 k=0 step; constant conditional acceptance "
            f"alpha; KV-cache reads left out. Best k: the oracle's (the cost model's argmax of expected "
            f"tokens / step seconds); the controller's: its most frequent k over the run's second "
            f"half.\n\n{controller_table(controller)}")
    publish(__file__, f"Speculation on a mixture of experts ({args.shape_name}, tiny MoE fixtures)",
            f"{args.seeds} random-token draws per fixture row after a {args.prefix}-token context; assumed "
            f"device for the step costs: {args.bandwidth_gbs:g} GB/s, {args.tflops:g} TFLOP/s (H100-like; not "
            "measured). ", body, append=args.append, argv=argv)
    print(f"[{time.perf_counter() - start:.0f} s] done", flush=True)
    return result


if __name__ == "__main__":
    main()
