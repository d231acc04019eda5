"""Compile time of the decoder's steps at Llama-3.1-8B sizes, with no weights ever materialised.

    JAX_PLATFORMS=cpu python benchmarks/compile_8b.py [--batch 8] [--k 4] [--context 4096] [--append]
    JAX_PLATFORMS=cpu python benchmarks/compile_8b.py --set serve [--drafter draft eagle3] [--limit N]
                     [--workers W] [--serve-args "--max-num-seqs 4"] [--target qwen2.5-7b] [--memory]
                     [--dry-run] [--append]

Everything is abstract (``nnx.eval_shape`` for the models, ``jax.eval_shape`` for the bfloat16 paged
caches, ``jax.ShapeDtypeStruct`` inputs), and nothing comes from the persistent compilation cache
(``SCV_JAX_CACHE_DIR=off``: every compile is cold).

``--set steps`` (default): single steps, ``jax.jit(...).trace(...).lower().compile()``d exactly as
graph mode compiles them (caches donated), lowering and compile seconds printed:

- ``autoregressive``: one decode step of the target alone (forward over the pending token + commit);
- ``speculative``: one speculative step, k drafts from a Llama-3.2-1B-shaped draft (catch-up forward
  and a scan of k - 1 draft forwards), the target's verify forward over k + 1 tokens, greedy
  acceptance and the no-write-on-reject commits of both caches;

at 32 target layers and at 2 (how compile time grows with depth).

``--set serve``: every executable ``scv-jax serve`` compiles for the 8B target with each ``--drafter``
(``draft``: the 1B-shaped draft model; ``eagle3``: an EAGLE-3 head of the published Llama-3.1-8B shape),
with serve's default flags (``--serve-args`` changes them), enumerated by the engine itself
(``Engine.warmup_jobs`` of ``serving.server.engine_config`` and ``warmup_sizes``) and split as serve
splits them (``graph.compiler.largest_first``: the executables serve waits for before it listens, the
rest compiled in the background). Counts: every executable (what a server waited for before issue 40),
the largest bucket of each kind without stand-ins (what it waited for before them), and with them (what
serve waits for now). Then they are compiled in that order (those serve waits for, the other largest
buckets, the rest smallest first as serve compiles them in the background; ``--match``: those whose bucket
names every TEXT; ``--limit``: the first N) on a
``graph.compiler.Compiler`` of ``--workers`` threads: seconds each (trace, lower and compile), the sums
of the two waited-for sets, summed and wall. ``--dry-run``: the counts alone. ``--target qwen2.5-7b``:
a Qwen2.5-7B-shaped target (vocabulary 152064) with a Qwen2.5-0.5B-shaped draft of its vocabulary, or an
EAGLE-3 head of its width. ``--memory``: per compiled executable, XLA's ``memory_analysis()`` (temporary,
argument, output and aliased bytes) and its largest temporaries (the biggest arrays the optimized HLO
materialises outside fusions, named by their JAX op), e.g. to find vocabulary-sized temporaries at a
real batch (``--serve-args "--max-num-seqs 64"``).

Either set compiles the layers as the decoder runs them (``per_layer``: each layer's weights inputs of
their own, the layers one after another) and as a ``jax.lax.scan`` over stacked weights (``scan``:
traced once; the layout before ``Transformer.per_layer``).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import math
import os
import re
import shlex
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["SCV_JAX_CACHE_DIR"] = "off"      # cold compiles: no executable loaded from a persistent cache

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from harness import publish  # noqa: E402
from scv_jax import Engine, cli  # noqa: E402
from scv_jax.decoding.chain_verifier import ChainVerifier  # noqa: E402
from scv_jax.decoding.device_step import SplitModel, StepRow  # noqa: E402
from scv_jax.decoding.plan import SamplingColumn  # noqa: E402
from scv_jax.decoding.step_fn import make_decode_step  # noqa: E402
from scv_jax.graph.compiler import CompileJob, Compiler, largest_first  # noqa: E402
from scv_jax.launch import Models  # noqa: E402
from scv_jax.models import Llama3RopeScaling, Transformer, TransformerConfig  # noqa: E402
from scv_jax.models.eagle3 import Eagle3Head  # noqa: E402
from scv_jax.ops.commit.kv_cache import PagedKVCache  # noqa: E402
from scv_jax.serving.server import Served, engine_config, warmup_sizes  # noqa: E402

LLAMA3_ROPE = Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position_embeddings=8192)
LLAMA_31_8B = TransformerConfig(vocab_size=128256, num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8,
                                head_dim=128, ffn_dim=14336, rope_theta=500000.0, norm_eps=1e-5,
                                tie_embeddings=False, dtype="bfloat16", rope_scaling=LLAMA3_ROPE)
LLAMA_32_1B = TransformerConfig(vocab_size=128256, num_layers=16, d_model=2048, num_heads=32, num_kv_heads=8,
                                head_dim=64, ffn_dim=8192, rope_theta=500000.0, norm_eps=1e-5,
                                tie_embeddings=True, dtype="bfloat16", rope_scaling=LLAMA3_ROPE)
# The published EAGLE-3 head of Llama-3.1-8B-Instruct (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): one layer of the
# target's width over its features at layers (2, 16, 29), a 32000-token draft vocabulary.
EAGLE3_DRAFT_VOCAB, EAGLE3_AUX_LAYERS = 32000, (2, 16, 29)
BLOCK_SIZE = 16
QWEN25_7B = TransformerConfig(vocab_size=152064, num_layers=28, d_model=3584, num_heads=28, num_kv_heads=4,
                              head_dim=128, ffn_dim=18944, rope_theta=1e6, norm_eps=1e-6, tie_embeddings=False,
                              dtype="bfloat16", qkv_bias=True)
# Qwen2.5-0.5B's shape with the 7B's vocabulary (the released 0.5B pads to 151936; a draft must match)
QWEN25_05B = TransformerConfig(vocab_size=152064, num_layers=24, d_model=896, num_heads=14, num_kv_heads=2,
                               head_dim=64, ffn_dim=4864, rope_theta=1e6, norm_eps=1e-6, tie_embeddings=True,
                               dtype="bfloat16", qkv_bias=True)


@dataclasses.dataclass(frozen=True)
class TargetShapes:
    """A target shape, its draft model's (``draft_name`` says which) and its EAGLE-3 head's (one layer of
    the target's width, reading ``aux_layers``)."""

    target: TransformerConfig
    draft: TransformerConfig
    draft_name: str
    aux_layers: tuple[int, int, int]


TARGETS = {"llama-3.1-8b": TargetShapes(LLAMA_31_8B, LLAMA_32_1B, "a Llama-3.2-1B-shaped draft model",
                                        EAGLE3_AUX_LAYERS),
           "qwen2.5-7b": TargetShapes(QWEN25_7B, QWEN25_05B,
                                      "a Qwen2.5-0.5B-shaped draft model (the 7B's vocabulary)", (2, 14, 25))}


class ScannedTransformer(Transformer):
    """A ``Transformer`` the decoder runs with its stacked layers under a ``jax.lax.scan`` (``per_layer``
    keeps them stacked): the layout the steps had before ``Transformer.per_layer``."""

    def per_layer(self) -> "Transformer":
        return self


def abstract_transformer(config: TransformerConfig, layers: str) -> Transformer:
    """The model with abstract parameters (nothing allocated); ``layers`` "per_layer" (as the decoder
    splits it) or "scan" (a ``ScannedTransformer``)."""
    cls = ScannedTransformer if layers == "scan" else Transformer
    return nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0)))


def abstract_head(target: Transformer, aux_layers: tuple[int, int, int] = EAGLE3_AUX_LAYERS) -> Eagle3Head:
    """An abstract EAGLE-3 head of the published shape (one layer of ``target``'s width, a 32000-token
    draft vocabulary) over ``target``, sharing its embedding (as ``load_eagle3`` binds one)."""
    vocab_map = np.arange(EAGLE3_DRAFT_VOCAB, dtype=np.int32)
    head = nnx.eval_shape(lambda: Eagle3Head(
        dataclasses.replace(target.config, num_layers=1), None, draft_vocab_size=EAGLE3_DRAFT_VOCAB,
        draft_to_target=vocab_map, aux_layers=aux_layers, norm_before_residual=False, rngs=nnx.Rngs(0)))
    head.embed = target.embed
    return head


def abstract_cache(config: TransformerConfig, num_blocks: int) -> PagedKVCache:
    return jax.eval_shape(lambda: PagedKVCache.create(config.num_layers, num_blocks, BLOCK_SIZE,
                                                      config.num_kv_heads, config.head_dim, dtype="bfloat16"))


# ---------------------------------------------------------------------------------------- --set steps
def compile_step(target: TransformerConfig, draft: TransformerConfig | None, *, batch: int, k: int,
                 context: int, layers: str) -> tuple[float, float]:
    """(lowering seconds, compile seconds) of one decode step (``k`` drafts; no draft: k = 0)."""
    max_blocks = -(-context // BLOCK_SIZE)
    num_blocks = batch * max_blocks
    target_split, target_params = SplitModel.split(abstract_transformer(target, layers))
    draft_split, draft_params = (SplitModel.split(abstract_transformer(draft, layers)) if draft is not None
                                 else (None, None))
    step = jax.jit(make_decode_step(target_split, draft_split, BLOCK_SIZE, ChainVerifier()),
                   static_argnames=("k", "greedy", "backend"), donate_argnames=("target_cache", "draft_cache"))
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    start = time.perf_counter()
    lowered = step.trace(
        target_params=target_params, draft_params=draft_params, target_cache=abstract_cache(target, num_blocks),
        draft_cache=abstract_cache(draft, num_blocks) if draft is not None else None,
        block_tables=i32(batch, max_blocks), rows=i32(batch, StepRow.WIDTH),
        sampling=jax.ShapeDtypeStruct((batch, SamplingColumn.WIDTH), jnp.float32),
        request_mask=jax.ShapeDtypeStruct((batch,), jnp.bool_),
        k=k if draft is not None else 0, greedy=True, backend="xla").lower()
    lowered_at = time.perf_counter()
    lowered.compile()
    return lowered_at - start, time.perf_counter() - lowered_at


def steps_table(args: argparse.Namespace) -> tuple[str, str, str]:
    """(title, details, markdown table) of the single steps."""
    rows = ["| step | layers run | target layers | draft layers | lowering s | compile s |",
            "|---|---|---:|---:|---:|---:|"]
    for depth in (32, 2):
        target = dataclasses.replace(LLAMA_31_8B, num_layers=depth)
        draft = dataclasses.replace(LLAMA_32_1B, num_layers=min(depth, LLAMA_32_1B.num_layers))
        for name, draft_config in (("autoregressive", None), (f"speculative (k={args.k})", draft)):
            for layers in args.layers:
                lower_s, compile_s = compile_step(target, draft_config, batch=args.batch, k=args.k,
                                                  context=args.context, layers=layers)
                rows.append(f"| {name} | {layers} | {depth} | {draft_config.num_layers if draft_config else '-'} | "
                            f"{lower_s:.1f} | {compile_s:.1f} |")
                print(rows[-1], flush=True)
    return ("Compile time at Llama-3.1-8B sizes (abstract shapes)",
            f"Batch {args.batch}, {args.context}-token block tables, bfloat16 model and caches, "
            "Llama-3.2-1B-shaped draft. ", "\n".join(rows))


# ---------------------------------------------------------------------------------------- --set serve
@dataclasses.dataclass
class ServeSet:
    """The executables ``serve`` compiles for one drafter and layer layout, split as serve splits them."""

    jobs: list[CompileJob]          # every executable: the ``first`` serve waits for, the other ``kinds``, the rest
    first: int                      # how many serve waits for before it listens (with stand-ins)
    kinds: int                      # how many it waited for without stand-ins: the largest bucket of each kind


def serve_set(drafter: str, layers: str, serve_args: list[str], shapes: TargetShapes = TARGETS["llama-3.1-8b"]
              ) -> ServeSet:
    """``scv-jax serve``'s warm-up executables (``serve_args``: its flags beyond the defaults) for the
    abstract target of ``shapes`` with ``drafter`` ("draft" or "eagle3"), as the engine enumerates them,
    in the order ``ServeSet.jobs`` says."""
    target = abstract_transformer(shapes.target, layers)
    model = (abstract_transformer(shapes.draft, layers) if drafter == "draft"
             else abstract_head(target, shapes.aux_layers))
    args = cli.parse_args(["serve", "--model", "abstract-shaped", *serve_args])
    # no position limit: Llama-3.1's 131072 exceeds serve's default context (2048) as none would
    models = Models(target, model, (target, model), position_limit=None)
    config, max_model_len, _ = engine_config(args, models)
    engine = Engine(target, model, config=config)
    caches = engine.runner.caches
    caches.put(*jax.eval_shape(caches.take))      # abstract caches: the warm-up's examples read their shapes
    jobs = engine.warmup_jobs(**warmup_sizes(args, Served(engine, max_model_len, shapes.target.vocab_size)))
    first, rest = largest_first(jobs)
    decode = engine.runner.decode_executable
    stand_ins, decode.stand_ins = decode.stand_ins, {}      # the split as it was before stand-ins
    try:
        largest = largest_first(jobs)[0]
    finally:
        decode.stand_ins = stand_ins
    waited = {id(job) for job in first}
    others = [job for job in largest if id(job) not in waited]
    taken = {id(job) for job in others}
    rest = [job for job in rest if id(job) not in taken]
    return ServeSet(first + others + rest, len(first), len(first) + len(others))


def compile_jobs(jobs: list[CompileJob], workers: int | None) -> tuple[list[tuple[CompileJob, float]], float]:
    """Compiles ``jobs`` in order on a ``Compiler`` of ``workers`` threads: ([(job, seconds)] in completion
    order, wall seconds); one line per executable on stdout."""
    done: list[tuple[CompileJob, float]] = []

    def on_compiled(job: CompileJob, compiles: int, seconds: float, count: int, total: int) -> None:
        done.append((job, seconds))
        print(f"  {count}/{total} [{label(job)}] ({job.cache.describe(job.key)}) {seconds:.1f} s", flush=True)

    start = time.perf_counter()
    Compiler(workers, on_compiled=on_compiled).run(jobs)
    return done, time.perf_counter() - start


def label(job: CompileJob) -> str:
    """The job's executable, a prefill of the drafter alone (its catch-up) marked."""
    return job.cache.name + (" (drafter's catch-up)" if job.example.get("target_params", ()) is None else "")


HLO_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
             "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
NOT_BUFFERS = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant"}
IN_PLACE = {"scatter", "dynamic-update-slice", "dynamic_update_slice"}   # HLO opcodes and JAX op names
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%\S+ = (\w+)\[([\d,]*)\]\S* ([\w-]+)\((.*)$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLED = re.compile(r"(?:calls|body|condition|to_apply)=%([\w.-]+)|(?:branch|called)_computations=\{([^}]*)\}")


def materialised_computations(lines: list[str]) -> set[str]:
    """Names of the computations whose instructions own buffers: the entry and those that instructions
    other than fusions call (while bodies, branches, calls), not fusions' bodies nor computations no
    instruction calls."""
    called, fused = set(), set()
    for line in lines:
        for single, several in _CALLED.findall(line):
            names = [single] if single else [name.strip().lstrip("%") for name in several.split(",")]
            (fused if " fusion(" in line else called).update(names)
    entry = {line.split()[1].lstrip("%") for line in lines if line.startswith("ENTRY ")}
    return entry | (called - fused)


def largest_temporaries(hlo_text: str, count: int = 3, dim: int | None = None) -> list[tuple[int, str]]:
    """The ``count`` largest arrays an optimized HLO module materialises (with ``dim``: only those with a
    dimension of that size, e.g. the vocabulary), as (bytes, "type[dims] op"): the instructions of the
    ``materialised_computations`` (fusions' bodies live in registers), parameters, tuples, bitcasts and
    in-place updates of a parameter's shape (the donated caches' scatters) left out; the op is the last
    two parts of the JAX op name."""
    found: dict[str, int] = {}
    lines = hlo_text.splitlines()
    parameters = {(m.group(1), m.group(2)) for m in map(_INSTRUCTION.match, lines)
                  if m is not None and m.group(3) == "parameter"}
    owners = materialised_computations(lines)
    materialised = False
    for line in lines:
        if line.endswith("{") and not line.startswith(" "):      # a computation's header
            materialised = line.split("(")[0].split()[-1].lstrip("%") in owners
            continue
        match = _INSTRUCTION.match(line)
        if not materialised or match is None or match.group(3) in NOT_BUFFERS:
            continue
        kind, dims, opcode, rest = match.groups()
        shape = [int(d) for d in dims.split(",") if d]
        op = _OP_NAME.search(rest)
        op_names = op.group(1).split("/") if op else [opcode]
        if (kind not in HLO_BYTES or (dim is not None and dim not in shape)
                or ({opcode, op_names[-1]} & IN_PLACE and (kind, dims) in parameters)):
            continue
        nbytes = HLO_BYTES[kind] * math.prod(shape)
        name = "/".join(op_names[-2:])
        key = f"{kind}[{dims}] {name}"
        found[key] = max(found.get(key, 0), nbytes)
    return sorted(((n, key) for key, n in found.items()), reverse=True)[:count]


def memory_rows(drafter: str, done: list[tuple[CompileJob, float]], vocab: int) -> list[str]:
    """One markdown row per compiled job: XLA's memory analysis, the largest temporaries and the largest
    of those with a ``vocab``-sized dimension."""
    mb = lambda n: f"{n / 1e6:,.1f}"  # noqa: E731
    listed = lambda found: "; ".join(f"{key} ({mb(n)} MB)" for n, key in found) or "-"  # noqa: E731
    rows = []
    for job, _ in done:
        compiled = job.cache.executable(job.key)
        stats, text = compiled.memory_analysis(), compiled.as_text()
        rows.append(f"| {drafter} | {label(job)} | {job.cache.describe(job.key)} | {mb(stats.temp_size_in_bytes)} | "
                    f"{mb(stats.argument_size_in_bytes)} | {mb(stats.output_size_in_bytes)} | "
                    f"{mb(stats.alias_size_in_bytes)} | {listed(largest_temporaries(text))} | "
                    f"{listed(largest_temporaries(text, dim=vocab))} |")
        print(rows[-1], flush=True)
    return rows


def summed_seconds(done: list[tuple[CompileJob, float]], jobs: list[CompileJob]) -> str:
    """The seconds ``jobs`` took, summed; "-" unless each was compiled."""
    seconds = {id(job): s for job, s in done}
    return f"{sum(seconds[id(job)] for job in jobs):.1f}" if all(id(job) in seconds for job in jobs) else "-"


def serve_table(args: argparse.Namespace) -> tuple[str, str, str]:
    """(title, details, markdown tables) of serve's executables for each drafter and layer layout."""
    serve_args = shlex.split(args.serve_args)
    rows = ["| drafter | layers run | executables: all / largest per kind without stand-ins / serve waits for "
            "| compiled here | seconds each: min / median / max | waited for, s: with / without stand-ins "
            "| summed s | wall s |",
            "|---|---|---|---:|---|---:|---:|---:|"]
    details, memory = [], []
    shapes = TARGETS[args.target]
    for drafter in args.drafter:
        for layers in args.layers:
            found = serve_set(drafter, layers, serve_args, shapes)
            by_name = collections.Counter(job.cache.name for job in found.jobs)
            counts = (f"{len(found.jobs)} ({', '.join(f'{n} {name}' for name, n in by_name.items())}) / "
                      f"{found.kinds} / {found.first}")
            print(f"{drafter}, {layers}: {counts} executables (all / largest per kind without stand-ins / "
                  f"serve waits for)", flush=True)
            if args.dry_run:
                rows.append(f"| {drafter} | {layers} | {counts} | 0 | - | - | - | - |")
                continue
            chosen = [job for job in found.jobs if all(text in job.cache.describe(job.key) for text in args.match)]
            chosen = chosen[:args.limit]
            done, wall = compile_jobs(chosen, args.workers)
            seconds = [s for _, s in done]
            waits = [summed_seconds(done, found.jobs[:n]) for n in (found.first, found.kinds)]
            rows.append(f"| {drafter} | {layers} | {counts} | {len(done)} | {min(seconds):.1f} / "
                        f"{statistics.median(seconds):.1f} / {max(seconds):.1f} | {' / '.join(waits)} | "
                        f"{sum(seconds):.1f} | {wall:.1f} |")
            details += [f"| {drafter} | {layers} | {label(job)} | {job.cache.describe(job.key)} | {s:.1f} |"
                        for job, s in done]
            print(rows[-1], flush=True)
            if args.memory:
                memory += memory_rows(f"{drafter}, {layers}", done, shapes.target.vocab_size)
    body = "\n".join(rows)
    if details:
        body += ("\n\nEach executable (trace, lower and compile seconds):\n\n| drafter | layers run | executable "
                 "| bucket | s |\n|---|---|---|---|---:|\n" + "\n".join(details))
    if memory:
        body += ("\n\nMemory (`compiled.memory_analysis()` on this CPU, MB) and the largest temporaries, all "
                 "and vocabulary-sized:\n\n| drafter | executable | bucket | temp | arguments | outputs | aliased | "
                 "largest temporaries | largest vocabulary-sized |\n|---|---|---|---:|---:|---:|---:|---|---|\n"
                 + "\n".join(memory))
    limit = "every executable" if args.limit is None else f"the first {args.limit} in the order above"
    if args.match:
        limit += " of those whose bucket names " + " and ".join(repr(text) for text in args.match)
    return (f"Compile time{' and memory' if memory else ''} of serve's executables at {args.target} sizes "
            "(abstract shapes)",
            f"`scv-jax serve` defaults{' with ' + args.serve_args if args.serve_args else ''}; {args.target}-shaped "
            f"target (vocabulary {shapes.target.vocab_size}), drafter {shapes.draft_name} (`draft`) or an EAGLE-3 "
            f"head of the published shape (`eagle3`); compiled: {limit}, on "
            f"{args.workers or 'the default number of'} compile thread(s), cold (no persistent cache). ", body)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", choices=["steps", "serve"], default="steps", dest="which",
                        help="single decode steps, or every executable serve compiles")
    parser.add_argument("--batch", type=int, default=8, help="--set steps: batch size")
    parser.add_argument("--k", type=int, default=4, help="--set steps: drafts per step")
    parser.add_argument("--context", type=int, default=4096,
                        help="--set steps: tokens per request the block tables cover")
    parser.add_argument("--drafter", nargs="+", default=["draft", "eagle3"], choices=["draft", "eagle3"],
                        help="--set serve: the 1B-shaped draft model and/or the 8B EAGLE-3 head")
    parser.add_argument("--serve-args", default="", help="--set serve: serve flags beyond its defaults")
    parser.add_argument("--limit", type=int, default=None,
                        help="--set serve: compile the first N executables in serve's order (default: all)")
    parser.add_argument("--match", action="append", default=[], metavar="TEXT",
                        help="--set serve: compile only the executables whose bucket names TEXT (repeatable: "
                             "all of them), e.g. 'k=4' 'logprobs=False'")
    parser.add_argument("--workers", type=int, default=None,
                        help="--set serve: compile threads (default: graph.compiler.default_workers())")
    parser.add_argument("--dry-run", action="store_true", help="--set serve: count the executables, compile none")
    parser.add_argument("--target", choices=list(TARGETS), default="llama-3.1-8b", help="--set serve: the target shape")
    parser.add_argument("--memory", action="store_true",
                        help="--set serve: each compiled executable's memory analysis and largest temporaries")
    parser.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    parser.add_argument("--layers", nargs="+", default=["per_layer", "scan"], choices=["per_layer", "scan"])
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        parser.error(f"--limit must be >= 1, got {args.limit}")
    if args.memory and (args.which != "serve" or args.dry_run):
        parser.error("--memory needs --set serve and compiles (not --dry-run)")
    if args.target != "llama-3.1-8b" and args.which != "serve":
        parser.error("--target needs --set serve")
    title, details, body = steps_table(args) if args.which == "steps" else serve_table(args)
    publish(__file__, title, details, body, append=args.append)


if __name__ == "__main__":
    main()
