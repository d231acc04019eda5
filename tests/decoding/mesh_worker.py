"""Runs the decoder on a mesh of CPU devices and reports what ``test_mesh.py`` asserts (one JSON line).

    python -m tests.decoding.mesh_worker --pair qwen --meshes 1,8 2,4:model 8,1 [--sample] [--extras]
        [--head 2,4] [--structured 2,4] [--devices 4 --process-id 0 --num-processes 2 --coordinator 127.0.0.1:PORT]
        [--no-expected]

It must start its own interpreter: the CPU device count (and, for several processes,
``jax.distributed.initialize``) is fixed before JAX initialises. It decodes the same prompts with the
model pair on one device and on each mesh ("data,model", ":model" places the draft on the mesh too),
greedy (all at once, two at a time, with logit controls) and (``--sample``) sampled, after a warm-up,
and records the tokens, the compiles after warm-up, the donations and the bytes each device holds. With
``--structured`` meshes (the demo pair) also requests with structured output, their steps warmed up too. With
``--head`` (the demo pair) it also decodes greedily with the demo EAGLE-3 head on those meshes and checks
the head cache's sharded row reads and writes against one device.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import re
import sys
import tempfile
import types


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pair", default="qwen", choices=("demo", "qwen"))
    parser.add_argument("--meshes", nargs="+", required=True, help="data,model[:model]")
    parser.add_argument("--sample", action="store_true", help="also decode with temperature 1")
    parser.add_argument("--devices", type=int, default=8, help="CPU devices of this process")
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--coordinator", default=None)
    parser.add_argument("--extras", action="store_true",
                        help="also report the mesh errors and check the sharded commit's Pallas kernel")
    parser.add_argument("--head", nargs="*", default=(), help="data,model meshes to run the demo EAGLE-3 head on")
    parser.add_argument("--structured", nargs="*", default=(),
                        help="data,model meshes (of --meshes) that also decode requests with structured output "
                             "(the demo pair's byte vocabulary)")
    parser.add_argument("--no-expected", action="store_true",
                        help="leave out the one-device run (another process of the same run reports it)")
    return parser.parse_args()


ARGS = _parse()
os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"),
                                                  f"--xla_force_host_platform_device_count={ARGS.devices}"]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

if ARGS.num_processes > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(ARGS.coordinator, ARGS.num_processes, ARGS.process_id)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import scv_jax  # noqa: E402
from scv_jax import DecoderConfig, SamplingParams, ShardingConfig, SpeculativeDecoder  # noqa: E402
from scv_jax import StructuredOutputsParams as Structured  # noqa: E402
from scv_jax.graph.compile_counter import CompileCounter  # noqa: E402
from scv_jax.decoding import head_step  # noqa: E402
from scv_jax.decoding.caches import HeadCache  # noqa: E402
from scv_jax.demo.hf_export import write_tokenizer  # noqa: E402
from scv_jax.models import TransformerConfig, YarnRopeScaling, load_demo, load_demo_head, load_tokenizer  # noqa: E402
from scv_jax.ops.commit.sharded import sharded_commit_draft_kv  # noqa: E402
from scv_jax.sharding.mesh import cache_shardings, tracing_on  # noqa: E402
from tests.models.fixtures import perturbed_copy, tiny_model  # noqa: E402

# Qwen2-style: q/k/v biases, 2 KV heads (fewer than a model axis of 4 or 8: replicated); an LM head of its
# own (the demo pair ties theirs), so that greedy decoding of random weights does not repeat one token; and
# gpt-oss's attention: sinks (split over "model" with their heads), an output bias, a windowed layer and a
# full one, YaRN; and gpt-oss's mixture of experts (router and expert biases, the clamped SwiGLU): 8 experts,
# split over "model" (one or two a shard)
QWEN_TINY = TransformerConfig(vocab_size=64, num_layers=2, d_model=64, num_heads=8, num_kv_heads=2, head_dim=8,
                              ffn_dim=128, qkv_bias=True, tie_embeddings=False, attention_sinks=True,
                              attention_out_bias=True, sliding_window=6, sliding_layers=(True, False),
                              rope_scaling=YarnRopeScaling(factor=4.0, original_max_position_embeddings=16),
                              num_experts=8, num_experts_per_tok=2, moe_ffn_dim=32, moe_bias=True, swiglu_limit=7.0)
CONFIG = DecoderConfig(k=3, block_size=8, num_blocks=64, max_seq_len=64, prefill_chunk=16, batch_buckets=(4,),
                       context_buckets=(8,))
MAX_NEW = 12
TIGHT_FREE = 5          # blocks a data shard's pool keeps free in ``_tight``: a request of the longest prompt
# needs up to 4 (32 positions), two need more
# a collective in optimized HLO and its result type: "= f32[2,4]{0,1} all-gather(", "= (f32[2], s32[2]) all-reduce("
_COLLECTIVE = re.compile(r"= ([^=]+?) (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)"
                         r"(?:-start)?\(")


def _pair(name: str):
    if name == "demo":
        return load_demo()
    target = tiny_model(QWEN_TINY, seed=0)
    sinks = target.blocks.attn.sinks
    sinks.set_value(jax.random.normal(jax.random.key(7), sinks.get_value().shape))   # a sink worth attending to
    return target, perturbed_copy(target, noise=0.1)          # accepts about half of the drafts


def _prompts(vocab: int) -> list[list[int]]:
    if vocab == 256:
        return [list(b"import os\n"), list(b"def main(argv):\n    "), list(b"class Foo:")]
    rng = np.random.default_rng(1)
    return [rng.integers(0, vocab, rng.integers(1, 20)).tolist() for _ in range(3)]


def _layout(tree) -> dict[str, dict]:
    """{path ("blocks/attn/q/kernel", "k_pages"): bytes, bytes on each of this process's devices}."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = "/".join(str(getattr(k, "key", getattr(k, "name", ""))) for k in path
                        if getattr(k, "name", "") != "value")
        held = {device.id: 0 for device in leaf.sharding.mesh.local_devices}
        for shard in leaf.addressable_shards:
            held[shard.device.id] += shard.data.nbytes
        out[name] = dict(nbytes=leaf.nbytes, device_bytes=sorted(held.values()))
    return out


def _tight(decoder: SpeculativeDecoder, prompts: list[list[int]]):
    """``prompts`` three times over, with all but ``TIGHT_FREE`` blocks of each data shard's pool held:
    the running requests outgrow their pools, the most recently admitted are preempted and resume."""
    held = [pool.allocate(max(pool.num_blocks - TIGHT_FREE, 0)) for pool in decoder.pool.shards]
    try:
        return decoder.generate(prompts * 3, MAX_NEW)
    finally:
        for pool, blocks in zip(decoder.pool.shards, held):
            pool.free(blocks)


def _engine_tokens(engine: scv_jax.Engine, requests: list[tuple[list[int], SamplingParams]],
                   arrivals: dict[int, int] | None = None, aborts: dict[int, int] | None = None) -> types.SimpleNamespace:
    """Each of ``requests`` (prompt, params) added (request i before step ``arrivals[i]``, default 0; aborted
    before step ``aborts[i]`` if given) and stepped to its end (400 steps at most): its tokens. On a follower
    process (the engine's mesh spans processes) it follows process 0's engine and returns no tokens."""
    if not engine.is_leader:
        engine.follow()
        return types.SimpleNamespace(tokens=None)
    arrivals, aborts = arrivals or {}, aborts or {}
    tokens = [[] for _ in requests]
    for step in range(400):
        for i, (prompt, params) in enumerate(requests):
            if arrivals.get(i, 0) == step:
                engine.add_request(prompt, params, str(i))
            if aborts.get(i) == step:
                engine.abort(str(i))
        if step > max(arrivals.values(), default=0) and not engine.has_unfinished():
            break
        for out in engine.step():
            tokens[int(out.request_id)] += out.new_token_ids
    engine.close()
    return types.SimpleNamespace(tokens=tokens)


def _chunked(decoder: SpeculativeDecoder, prompts: list[list[int]]) -> types.SimpleNamespace:
    """Greedy ``prompts`` on an engine prefilling one ``prefill_chunk`` a step (a budget of 1 token), the
    last arriving at step 3, and a copy of the first aborted at step 2 (over several processes: process 0
    drives the engine, the others follow)."""
    requests = [(prompt, SamplingParams(max_tokens=MAX_NEW)) for prompt in prompts + prompts[:1]]
    return _engine_tokens(scv_jax.Engine(decoder, max_num_batched_tokens=1), requests,
                          arrivals={len(prompts) - 1: 3}, aborts={len(prompts): 2})


def _adaptive(target, draft, prompts: list[list[int]]) -> tuple[dict, str]:
    """Over several processes: greedy ``prompts`` on an adaptive engine that process 0 drives (its tokens,
    and the steps each process ran per k), and generate's refusal of adaptive k (every process calling it
    alike would each time its own steps)."""
    config = dataclasses.replace(CONFIG, adaptive=True, k_values=(1, 3))
    decoder = SpeculativeDecoder(target, draft, config=config, mesh=scv_jax.decoder_mesh(2, 4))
    try:
        decoder.generate(prompts, MAX_NEW)
        error = ""
    except ValueError as e:
        error = str(e)
    engine = scv_jax.Engine(decoder)          # (not warmed up: each k compiles when the controller first picks it)
    run = _engine_tokens(engine, [(prompt, SamplingParams(max_tokens=MAX_NEW)) for prompt in prompts])
    return dict(tokens=run.tokens, k_histogram=engine.stats.k_histogram), error


def _structured(decoder: SpeculativeDecoder, prompts: list[list[int]]) -> types.SimpleNamespace:
    """Greedy ``prompts`` on an engine with the demo byte tokenizer: one under a JSON schema, one a
    choice, one plain (drafted along the drafting automata, the host checking the accepted tokens)."""
    folder = pathlib.Path(tempfile.mkdtemp())
    write_tokenizer(folder)
    engine = scv_jax.Engine(decoder, tokenizer=load_tokenizer(folder))
    schema = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}}, "required": ["id", "ok"]}
    constraints = [Structured(json=schema), Structured(choice=["import sys", "import os"]), None]
    return _engine_tokens(engine, [(prompt, SamplingParams(max_tokens=2 * MAX_NEW, structured_outputs=constraint))
                                   for prompt, constraint in zip(prompts, constraints)])


def _generate(decoder: SpeculativeDecoder, prompts: list[list[int]], structured: bool) -> dict[str, list[list[int]]]:
    vocab = decoder.runner.vocab_size
    controlled = [SamplingParams(max_tokens=MAX_NEW, presence_penalty=1.5, frequency_penalty=0.5,
                                 logit_bias={1: 5.0, vocab - 1: -100.0}),
                  SamplingParams(max_tokens=MAX_NEW, repetition_penalty=1.5, bad_words_token_ids=[[prompts[1][-1]]]),
                  SamplingParams(max_tokens=MAX_NEW, allowed_token_ids=list(range(0, vocab, 2)))]
    out = {"greedy": decoder.generate(prompts, MAX_NEW),
           "streamed": decoder.generate(prompts, MAX_NEW, max_num_seqs=2),    # continuous batching
           "chunked": _chunked(decoder, prompts),                              # prompts over several steps
           "tight": _tight(decoder, prompts),                                  # preemptions
           "controlled": decoder.generate(prompts, sampling=controlled)}       # penalties, bias, bad words
    if structured:
        out["structured"] = _structured(decoder, prompts)
    if ARGS.sample:
        out["sampled"] = decoder.generate(prompts, MAX_NEW, temperature=1.0, seed=7)
        # the engine's per-request parameters: greedy, filtered and penalised rows in one batch
        mix = [SamplingParams(max_tokens=MAX_NEW), SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3,
                                                                  presence_penalty=1.0, max_tokens=MAX_NEW),
               SamplingParams(temperature=1.2, min_p=0.1, seed=4, max_tokens=MAX_NEW - 3)]
        out["mixed"] = decoder.generate(prompts, sampling=(mix * len(prompts))[:len(prompts)])
    return out


def _graph_stats(decoder: SpeculativeDecoder) -> dict[str, dict[str, int]]:
    return {k: dict(unaliased=s.unaliased_donations, copied=s.copied_donations, fallbacks=s.fallbacks)
            for k, s in decoder.graph_stats.items()}


def _on_mesh(target, draft, prompts: list[list[int]], spec: str) -> dict:
    shape, _, draft_placement = spec.partition(":")
    mesh = scv_jax.decoder_mesh(*(int(x) for x in shape.split(",")))
    decoder = SpeculativeDecoder(target, draft, config=CONFIG, mesh=mesh,
                                 sharding=ShardingConfig(draft=draft_placement or "replicated"))
    warmup = decoder.warmup(4, CONFIG.max_seq_len)
    if ARGS.sample:
        warmup += decoder.warmup(4, CONFIG.max_seq_len, temperatures=1.0)
    graph = _graph_stats(decoder)
    structured = spec in ARGS.structured
    if structured:      # (the steps of constrained requests: an engine's warm-up)
        warmup += scv_jax.Engine(decoder).warmup(4, CONFIG.max_seq_len, temperatures=0.0, structured_output=True)
    with CompileCounter() as compiles:
        outputs = _generate(decoder, prompts, structured)
    target_cache, draft_cache = decoder.runner.caches.take()
    decoder.runner.caches.put(target_cache, draft_cache)
    # (op, elements, shape) of each collective's largest result
    collectives = [(op, *max((int(np.prod(shape)), shape) for shape in (
                       [int(d) for d in dims.split(",") if d] for dims in re.findall(r"[a-z0-9]+\[([0-9,]*)\]", result))))
                   for key in decoder.runner.decode_executable.compiled_keys
                   for result, op in _COLLECTIVE.findall(decoder.runner.decode_executable.executable(key).as_text())]
    return dict(
        tokens={mode: out.tokens for mode, out in outputs.items()},
        preemptions=outputs["tight"].stats.num_preemptions, prefix_hits=outputs["tight"].stats.prefix_cache_hits,
        acceptance=outputs["greedy"].stats.acceptance_rate, warmup_compiles=warmup, overlaps=decoder.runner.overlaps,
        compiles_after_warmup=compiles.count + compiles.loads, graph=graph,
        structured_graph=_graph_stats(decoder) if structured else None,
        target_state=_layout(decoder.runner.target.state(decoder.runner.target_params)),
        draft_state=_layout(decoder.runner.draft.state(decoder.runner.draft_params)),
        target_cache=_layout(target_cache), draft_cache=_layout(draft_cache),
        cache_kv_heads=[target_cache.num_kv_heads, draft_cache.num_kv_heads], free_blocks=decoder.pool.num_free,
        collectives=collectives, vocab_size=target.config.vocab_size,
        mesh_processes=[[device.process_index for device in row] for row in mesh.devices])


def _head_on_mesh(target, prompts: list[list[int]], spec: str) -> dict:
    """Greedy tokens with the demo EAGLE-3 head on mesh ``spec`` (all at once and two at a time: requests
    arriving mid-flight), its donations, and the bytes each device holds of its state and cache."""
    mesh = scv_jax.decoder_mesh(*(int(x) for x in spec.split(",")))
    decoder = SpeculativeDecoder(target, load_demo_head(target), config=CONFIG, mesh=mesh)
    greedy = decoder.generate(prompts, MAX_NEW)
    streamed = decoder.generate(prompts, MAX_NEW, max_num_seqs=2)
    target_cache, head_cache = decoder.runner.caches.take()
    decoder.runner.caches.put(target_cache, head_cache)
    return dict(tokens={"greedy": greedy.tokens, "streamed": streamed.tokens}, acceptance=greedy.stats.acceptance_rate,
                graph=_graph_stats(decoder),
                head_state=_layout(decoder.runner.draft.state(decoder.runner.draft_params)),
                head_cache=_layout(head_cache._asdict()), free_blocks=decoder.pool.num_free)


def _head_rows(mesh) -> bool:
    """The head cache's ``write_rows`` then ``read_rows`` on ``mesh`` (rows of data shard s carry block ids
    local to its blocks) against one device (the same rows with global block ids)."""
    blocks, block_size, width, rows, data = 8, 4, 8, 4, mesh.shape["data"]
    rng = np.random.default_rng(0)
    cache = HeadCache.wrap(None, blocks, block_size, width, jnp.float32)
    local = np.stack([rng.permutation(blocks // data)[:2] for _ in range(rows)]).astype(np.int32)
    local[1, 1] = -1
    shard = np.arange(rows) // (rows // data)
    global_tables = np.where(local < 0, -1, local + shard[:, None] * (blocks // data))
    positions = rng.integers(0, 2 * block_size, (rows, 3)).astype(np.int32)
    mask = rng.random((rows, 3)) < 0.8
    features = jnp.asarray(rng.normal(size=(rows, 3, width)), jnp.float32)
    tokens = jnp.asarray(rng.integers(1, 100, (rows, 3)), jnp.int32)

    def write_read(cache, tables):
        cache = head_step.write_rows(cache, tables, positions, mask, after=(), features=features, tokens=tokens)
        return cache, head_step.read_rows(cache, tables, positions)

    def on_mesh(cache, tables):
        with tracing_on(mesh):
            return write_read(cache, tables)

    expected = jax.jit(write_read)(cache, global_tables)
    placed = jax.device_put(cache, HeadCache(None, *[NamedSharding(mesh, PartitionSpec("data"))] * 2))
    got = jax.jit(on_mesh)(placed, local)
    return all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree.leaves(got),
                                                                           jax.tree.leaves(expected)))


def _errors(mesh) -> dict[str, str]:
    """The one-line errors of bad meshes and models."""
    target = tiny_model(QWEN_TINY, seed=0)
    cases = {
        "axis_names": lambda: SpeculativeDecoder(target, config=CONFIG, mesh=jax.make_mesh(
            mesh.devices.shape, ("batch", "tensor"), axis_types=mesh.axis_types)),
        "kv_heads": lambda: SpeculativeDecoder(tiny_model(TransformerConfig(
            vocab_size=64, num_heads=6, num_kv_heads=3, ffn_dim=128), seed=0), config=CONFIG, mesh=mesh),
        "ffn_dim": lambda: SpeculativeDecoder(tiny_model(TransformerConfig(
            vocab_size=64, num_heads=8, num_kv_heads=2, ffn_dim=90), seed=0), config=CONFIG, mesh=mesh),
        "num_experts": lambda: SpeculativeDecoder(tiny_model(TransformerConfig(
            vocab_size=64, num_heads=8, num_kv_heads=2, num_experts=6), seed=0), config=CONFIG, mesh=mesh),
        "num_blocks": lambda: SpeculativeDecoder(target, config=DecoderConfig(num_blocks=63), mesh=mesh),
        "too_many_devices": lambda: scv_jax.decoder_mesh(2, len(jax.devices())),
    }
    messages = {}
    for case, make in cases.items():
        try:
            make()
            messages[case] = ""
        except (ValueError, TypeError) as error:
            messages[case] = f"{type(error).__name__}: {error}"
    return messages


def _sharded_commit(mesh) -> dict[str, bool]:
    """The commit under ``shard_map`` with the Pallas kernel (interpret mode) and the XLA scatter
    against ``commit_draft_kv`` on one device (rows of data shard s carry slots local to its blocks)."""
    layers, blocks, block_size, heads, head_dim, rows = 2, 8, 4, mesh.shape["model"], 128, 8
    rng = np.random.default_rng(0)
    cache = scv_jax.PagedKVCache.create(layers, blocks, block_size, heads, head_dim, dtype="bfloat16")
    cache = cache.replace(v_pages=jnp.zeros_like(cache.v_pages))
    keys = jnp.asarray(rng.normal(size=(layers, rows, heads, head_dim)), jnp.float32)
    slots = rng.permutation(blocks * block_size // mesh.shape["data"])[:rows].astype(np.int32)
    slots[2] = -1
    mask = np.arange(rows) != 5
    shard = np.arange(rows) // (rows // mesh.shape["data"])
    global_slots = np.where(slots < 0, -1, slots + shard * (blocks // mesh.shape["data"]) * block_size)
    expected = scv_jax.commit_draft_kv(cache, keys, 2 * keys, global_slots, mask, backend="xla")

    def commit(cache, keys, values, slots, mask, backend):
        with tracing_on(mesh):
            return sharded_commit_draft_kv(cache, keys, values, slots, mask, backend=backend)

    same = {}
    for backend in ("xla", "interpret"):
        out = jax.jit(commit, donate_argnums=0, static_argnames="backend")(
            jax.device_put(cache, cache_shardings(cache, mesh)), keys, 2 * keys, slots, mask, backend)
        same[backend] = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in (
            (out.k_pages, expected.k_pages), (out.v_pages, expected.v_pages)))
    return same


def main() -> None:
    target, draft = _pair(ARGS.pair)
    prompts = _prompts(target.config.vocab_size)
    expected = {} if ARGS.no_expected else {
        mode: out.tokens for mode, out in _generate(SpeculativeDecoder(target, draft, config=CONFIG), prompts,
                                                    bool(ARGS.structured)).items()}
    result = dict(process=jax.process_index(), devices=len(jax.devices()), local_devices=len(jax.local_devices()),
                  expected=expected, meshes={spec: _on_mesh(target, draft, prompts, spec) for spec in ARGS.meshes})
    if ARGS.num_processes > 1:
        result["adaptive"], result["adaptive_error"] = _adaptive(target, draft, prompts)
    if ARGS.extras:
        mesh = scv_jax.decoder_mesh(2, len(jax.devices()) // 2)
        result.update(errors=_errors(mesh), sharded_commit=_sharded_commit(mesh))
    if ARGS.head:
        mesh = scv_jax.decoder_mesh(2, len(jax.devices()) // 2)
        result.update(head={spec: _head_on_mesh(target, prompts, spec) for spec in ARGS.head},
                      head_rows=_head_rows(mesh))
        try:
            SpeculativeDecoder(target, load_demo_head(target), config=CONFIG, mesh=mesh,
                               sharding=ShardingConfig(draft="model"))
            result["head_error"] = ""
        except ValueError as error:
            result["head_error"] = str(error)
    print(json.dumps(result), flush=True)
    if ARGS.num_processes > 1:
        jax.distributed.shutdown()      # every process leaves the job together (its barrier) before exiting


if __name__ == "__main__":
    sys.exit(main())
