"""The decoder on meshes of CPU devices (each run in its own interpreter, ``mesh_worker``), one step in
flight (the default): greedy (all at once, two at a time (``max_num_seqs=2``), through preemptions in a
tight pool, with logit controls and with structured output) and sampled tokens identical to one device, the shardings
(bytes per device), zero compiles after warm-up, in-place donations, clear errors, and one
``generate`` over two processes."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[2]
SHARDED_PARAMETERS = ("blocks/attn/q/kernel", "blocks/attn/k/kernel", "blocks/attn/v/kernel", "blocks/attn/q/bias",
                      "blocks/attn/k/bias", "blocks/attn/v/bias", "blocks/attn/o/kernel", "blocks/mlp/gate/kernel",
                      "blocks/mlp/up/kernel", "blocks/mlp/down/kernel", "blocks/attn/sinks", "embed/embedding",
                      "lm_head/kernel", *(f"blocks/mlp/experts_{name}" for name in ("gate", "up", "down", "gate_bias",
                                                                                   "up_bias", "down_bias")))


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "tests.decoding.mesh_worker", *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def _result(process: subprocess.Popen, timeout: float = 900) -> dict:
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        process.kill()
    assert process.returncode == 0, stderr[-4000:]
    return json.loads(stdout.splitlines()[-1])


def _check_chunked(chunked: list[list[int]], greedy: list[list[int]]) -> None:
    """The chunked engine run (``mesh_worker._chunked``): the greedy tokens, the last prompt arriving later,
    and a copy of the first prompt aborted a few steps in (a prefix of its tokens)."""
    assert chunked[:len(greedy)] == greedy
    aborted = chunked[len(greedy)]
    assert len(aborted) < len(greedy[0]) and aborted == greedy[0][:len(aborted)]


def _check_mesh_run(result: dict, spec: str, *, kv_heads: tuple[int, int]) -> None:
    """Tokens as on one device, no compile after warm-up, caches updated in place, and each device
    holding 1/model of every sharded weight, 1/(data * model) of the target cache."""
    shape, _, draft_placement = spec.partition(":")
    data, model = (int(x) for x in shape.split(","))
    run = result["meshes"][spec]
    assert run["tokens"] == {mode: result["expected"][mode] for mode in run["tokens"]}, spec
    assert set(run["tokens"]) >= {"greedy", "streamed", "chunked", "tight", "controlled"}, spec
    assert result["expected"]["controlled"] != result["expected"]["greedy"]     # the controls took effect
    assert run["tokens"]["streamed"] == run["tokens"]["greedy"], spec
    _check_chunked(run["tokens"]["chunked"], run["tokens"]["greedy"])
    assert run["tokens"]["tight"] == run["tokens"]["greedy"] * 3, spec
    assert run["preemptions"] > 0 or data == 8, spec      # 8 shards: each runs about one request
    assert run["prefix_hits"] > 0 or data > 1, spec        # one pool: the repeated prompts reuse their blocks
    assert run["warmup_compiles"] > 0 and run["compiles_after_warmup"] == 0, spec
    assert run["overlaps"], spec                           # one step in flight (the default) on a mesh too
    assert all(v == 0 for stats in run["graph"].values() for v in stats.values()), run["graph"]
    assert run["free_blocks"] == 64
    target_kv, draft_kv = kv_heads
    draft_split = draft_placement == "model"
    # KV heads fewer than the model axis are replicated up to it (vLLM's rule); a replicated draft keeps its own
    assert run["cache_kv_heads"] == [max(target_kv, model), max(draft_kv, model) if draft_split else draft_kv]
    for cache, split in (("target_cache", True), ("draft_cache", draft_split)):
        for pages in run[cache].values():
            assert pages["device_bytes"] == [pages["nbytes"] // (data * (model if split else 1))] * (data * model), \
                (spec, cache, pages)
    for state, split in (("target_state", True), ("draft_state", draft_split)):
        for name, array in run[state].items():
            layerless = "/".join(part for part in name.split("/") if not part.isdigit())   # blocks/0/... (per_layer)
            share = model if split and layerless in SHARDED_PARAMETERS else 1
            assert array["device_bytes"] == [array["nbytes"] // share] * (data * model), (spec, state, name, array)
    # the decode steps' collectives: all-reduces and all-gathers of activations, logits and probabilities,
    # never of a cache (they are as large as a device's share of the target cache's pages / 4 at most here)
    pages = run["target_cache"]["k_pages"]["device_bytes"][0] // 4
    kinds = {op for op, _, _ in run["collectives"]}
    assert run["collectives"] and kinds <= {"all-reduce", "all-gather", "collective-permute"}, run["collectives"]
    # (the carry moving a request's rows on and the rows of the replicated logit controls gathered for a data
    # shard's requests permute a few per-request values: the rows' bad-word tables at most, never a
    # vocabulary-sized row)
    assert all(size <= 8 * 16 * 8 and run["vocab_size"] not in shape
               for op, size, shape in run["collectives"] if op == "collective-permute"), run["collectives"]
    assert max(size for _, size, _ in run["collectives"]) < pages, (spec, pages, run["collectives"])


@pytest.mark.slow
def test_demo_pair_on_meshes_decodes_as_on_one_device():
    """The demo target has 6 query and 2 KV heads: on a model axis of 4 each KV head is replicated twice
    and each query group padded to 4 heads (a model axis of 8 is the qwen pair's). The demo EAGLE-3 head on (2, 4): the target's tokens, the head replicated but for the
    embedding it shares (vocabulary-split like the target's), its cache over "data" only. Structured output
    (JSON schema, choice) on (2, 4), after its warm-up."""
    result = _result(_start("--pair", "demo", "--meshes", "2,4", "--head", "2,4", "--structured", "2,4"))
    _check_mesh_run(result, "2,4", kv_heads=(2, 1))
    assert "structured" in result["meshes"]["2,4"]["tokens"]
    # the structured steps donate in place too (but for the controls' state, which XLA copies as on one device:
    # docs/sampling.md)
    assert all(stats["unaliased"] == stats["fallbacks"] == 0
               for stats in result["meshes"]["2,4"]["structured_graph"].values())
    # structured output: the JSON schema's request and the choice's follow their constraint
    structured = result["expected"]["structured"]
    assert bytes(structured[0]).startswith(b'{"id":'), structured[0]
    assert bytes(structured[1]) in (b"import sys", b"import os"), structured[1]
    assert structured[2] != structured[1]
    assert 0.3 < result["meshes"]["2,4"]["acceptance"] < 1.0
    head = result["head"]["2,4"]
    assert head["tokens"] == {"greedy": result["expected"]["greedy"], "streamed": result["expected"]["greedy"]}
    assert 0.3 < head["acceptance"] < 1.0 and head["free_blocks"] == 64
    assert all(v == 0 for stats in head["graph"].values() for v in stats.values()), head["graph"]
    for name, array in head["head_state"].items():
        share = 4 if name == "embed/embedding" else 1
        assert array["device_bytes"] == [array["nbytes"] // share] * 8, (name, array)
    assert set(head["head_cache"]) == {"kv/k_pages", "kv/v_pages", "features", "tokens"}
    for name, pages in head["head_cache"].items():
        assert pages["device_bytes"] == [pages["nbytes"] // 2] * 8, (name, pages)
    assert result["head_rows"]      # the head cache's rows, read and written per data shard, as on one device
    assert result["head_error"] == ("SpeculativeDecoder: an EAGLE-3 head runs replicated over the mesh's model "
                                    "axis: ShardingConfig.draft must be 'replicated', got 'model'")


@pytest.mark.slow
def test_qwen_style_pair_on_meshes_greedy_and_sampled():
    """q/k/v biases, an untied LM head (vocabulary-parallel), gpt-oss's attention (sinks split with their
    heads, an output bias, a windowed and a full layer, YaRN) and mixture of experts (8 experts split over
    "model": expert-parallel), 2 KV heads on a model axis of 4, the draft tensor-parallel too, on a (1, 4)
    mesh (one pool: the prefix cache's hits; a data axis is the demo pair's and the two processes' case);
    sampling with the same seed gives the one-device tokens. (A dense MLP is the demo pair's case. One mesh:
    each further one costs the suite ~50 s.)"""
    result = _result(_start("--pair", "qwen", "--meshes", "1,4:model", "--sample", "--extras"))
    _check_mesh_run(result, "1,4:model", kv_heads=(2, 2))
    assert 0.2 < result["meshes"]["1,4:model"]["acceptance"] < 0.9            # partial acceptance exercised
    assert result["expected"]["sampled"] != result["expected"]["greedy"]
    assert result["sharded_commit"] == {"xla": True, "interpret": True}
    errors = result["errors"]
    assert errors["axis_names"] == ("ValueError: mesh must have the axes ('data', 'model') (in that order), "
                                    "got ('batch', 'tensor')")
    assert "num_kv_heads (3) cannot be split over the mesh's model axis (4)" in errors["kv_heads"]
    assert "ffn_dim (90) must be a multiple of the mesh's model axis (4)" in errors["ffn_dim"]
    assert "num_experts (6) must be a multiple of the mesh's model axis (4) (the experts are split" in \
        errors["num_experts"]
    assert "DecoderConfig.num_blocks (63) must be a multiple of the mesh's data axis (2)" in errors["num_blocks"]
    assert "data * model = 2 * 8 = 16 devices, but only 8 are available" in errors["too_many_devices"]


@pytest.mark.slow
def test_two_processes_decode_as_one_device():
    """``jax.distributed.initialize`` with 2 processes of 4 CPU devices each (gloo collectives), a (2, 4)
    mesh over all 8: both processes get the one-device tokens (process 0's one-device run: the same prompts
    and models in each process, so the second leaves it out), requests with penalties, a bias, bad words and
    allowed ids among them; an adaptive engine that process 0 drives, not warmed up, runs the same steps on
    both (generate refuses adaptive k there)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workers = [_start("--pair", "qwen", "--meshes", "2,4", "--devices", "4", "--num-processes", "2",
                      "--process-id", str(i), "--coordinator", f"127.0.0.1:{port}", *(["--no-expected"] if i else []))
               for i in range(2)]
    try:
        results = [_result(w) for w in workers]
    finally:
        for w in workers:          # one failing process leaves the other waiting for it
            w.kill()
    expected = results[0]["expected"]
    assert set(expected) == {"greedy", "streamed", "chunked", "tight", "controlled"} and results[1]["expected"] == {}
    _check_chunked(expected["chunked"], expected["greedy"])
    for i, result in enumerate(results):
        assert (result["process"], result["devices"], result["local_devices"]) == (i, 8, 4)
        run = result["meshes"]["2,4"]
        assert run["mesh_processes"] == [[0] * 4, [1] * 4]          # "model" within a process, "data" across
        # adaptive k: process 0 decides it, every process runs the same steps (each k as many times)
        assert result["adaptive_error"].startswith("DecoderConfig.adaptive: over several processes process 0")
        assert result["adaptive"]["k_histogram"] == results[0]["adaptive"]["k_histogram"]
        assert len(result["adaptive"]["k_histogram"]) > 1, result["adaptive"]
        assert result["adaptive"]["tokens"] == (None if i else expected["greedy"])
        # the chunked run's engine: process 0 drives it (adding and aborting requests), process 1 follows
        assert run["tokens"] == {**expected, "chunked": None if i else expected["chunked"]}
        assert run["compiles_after_warmup"] == 0
        assert run["target_cache"]["k_pages"]["device_bytes"] == [run["target_cache"]["k_pages"]["nbytes"] // 8] * 4
