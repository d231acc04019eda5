"""The ``scv-jax`` command (demo, generate and bench), on tiny models for speed."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import signal
import subprocess
import sys

import pytest

from scv_jax import cli
from scv_jax.decoding.config import DecoderConfig
from scv_jax.models import TransformerConfig, load_tokenizer
from tests.models.eagle3_fixtures.heads import head_config, head_tensors
from tests.models.fixtures import tiny_model
from tests.models.hub_cache import cache_repo, offline_hub
from tests.models.test_eagle3 import write_head

BYTE_TARGET = TransformerConfig(vocab_size=256, num_layers=1, d_model=32, num_heads=2, num_kv_heads=1,
                                head_dim=16, ffn_dim=64)


@pytest.fixture
def tiny_demo(monkeypatch):
    target = tiny_model(BYTE_TARGET, seed=0)
    monkeypatch.setattr("scv_jax.models.load_demo", lambda: (target, target))


def test_demo_prints_text_and_table(tiny_demo, capsys):
    assert cli.main(["demo", "--prompt", "def f(x):", "--max-new-tokens", "12", "--k", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def f(x):")
    for row in ("autoregressive", "speculative (k=3)", "speedup", "mean accepted length", "acceptance"):
        assert row in out
    assert "greedy outputs identical  yes" in out


@pytest.mark.slow
def test_demo_sampling_and_adaptive(tiny_demo, capsys, monkeypatch):
    config = cli._decoder_config        # adaptive over k in (0, 2): the default k values compile 3 more steps
    monkeypatch.setattr(cli, "_decoder_config", lambda *a, **kw: dataclasses.replace(config(*a, **kw), k_values=(0, 2)))
    assert cli.main(["demo", "--max-new-tokens", "6", "--temperature", "1.0", "--adaptive"]) == 0
    out = capsys.readouterr().out
    assert "speculative (adaptive k)" in out and "n/a (sampling" in out


@pytest.mark.slow
def test_bench_appends_table(tiny_demo, capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("scv_jax.demo.e2e.benchmark_prompts", lambda batch, **_: [[100, 101, 102]] * batch)
    results = tmp_path / "RESULTS.md"
    # adaptive picks k from (0, 2), the k=2 rows' executables (the default k values: 15 more decode steps to
    # compile for "adaptive packed" alone); batch 8: the stream's running batch below
    argv = ["bench", "--batch-sizes", "8", "--temperatures", "0", "--modes", "2", "adaptive", "--k-values", "0", "2",
            "--max-new-tokens", "5", "--repeats", "1", "--packed", "--workloads", "stdlib", "--append", str(results)]
    assert cli.main(argv) == 0
    table, err = capsys.readouterr()
    assert "stdlib] batch 8 T=0 case 1/1: compiling and warming up autoregressive (1/" in err   # progress
    assert "stdlib] batch 8 T=0 timed round 1/1" in err
    assert "| 8 | 0 | autoregressive |" in table and "| 8 | 0 | k=2 |" in table and "| 8 | 0 | k=2 packed |" in table
    written = results.read_text()
    assert "End-to-end" in written and "| 8 | 0 | k=2 |" in written and f"`scv-jax {' '.join(argv)}`" in written
    assert "Adaptive vs the best fixed k" in written and "| stdlib | model | 8 | 0 | adaptive packed | k=2" in written
    # the stream workload (32 requests, 8 running at once) with one fixed k: adaptive there compiles every
    # k at every batch bucket up to 8 (most of this test's former 8 minutes) and is the same code as above
    assert cli.main(["bench", "--temperatures", "0", "--modes", "2", "--max-new-tokens", "5", "--repeats", "1",
                     "--packed", "--workloads", "stream"]) == 0
    assert "| stream | model | 8 | 0 | k=2 packed |" in capsys.readouterr()[0]


@pytest.mark.parametrize("packed", [[], ["--packed-verify"]], ids=["dense", "packed"])
def test_demo_with_ngram_drafting(tiny_demo, capsys, packed):
    assert cli.main(["demo", "--prompt", "abcabcabcabc", "--max-new-tokens", "10", "--k", "3", "--ngram",
                     "--ngram-max", "2", *packed]) == 0
    out = capsys.readouterr().out
    assert "speculative (k=3, n-gram)" in out and "greedy outputs identical  yes" in out


def test_k_and_adaptive_are_exclusive(capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--k", "2", "--adaptive"])


def test_demo_without_speculation_prints_dashes(tiny_demo, capsys):
    assert cli.main(["demo", "--max-new-tokens", "4", "--k", "0"]) == 0
    acceptance = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("acceptance"))
    assert "nan" not in acceptance and acceptance.split() == ["acceptance", "-", "per", "position:", "-"]


def _assert_one_line_error(argv: list[str], message: str, capsys) -> None:
    """``scv-jax ARGV`` exits 2 with ``message`` on one line of stderr (argparse's errors included)."""
    try:
        code = cli.main(argv)
    except SystemExit as exit:     # argparse's own errors
        code = exit.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("argv, message", [
    (["demo", "--max-new-tokens", "0"], "argument --max-new-tokens: must be an int >= 1, got 0"),
    (["demo", "--k", "-1"], "argument --k: must be an int >= 0, got -1"),
    (["demo", "--temperature", "-2"], "argument --temperature: must be a finite number >= 0"),
    (["bench", "--batch-sizes", "0"], "argument --batch-sizes: must be an int >= 1, got 0"),
    (["demo", "--prompt", ""], "--prompt must not be empty"),
    (["bench", "--modes", "two"], "--modes: each mode must be a k >= 1 or 'adaptive'"),
    (["bench", "--workloads", "server"], "argument --workloads: invalid choice: 'server'"),
    (["demo", "--ngram", "--ngram-min", "3", "--ngram-max", "2"], "--ngram-min (3) must be <= --ngram-max (2)"),
    (["demo", "--ngram-min", "0"], "argument --ngram-min: must be an int >= 1, got 0"),
])
def test_user_mistakes_are_one_line_errors_before_loading_weights(argv, message, monkeypatch, capsys):
    def no_weights():
        raise AssertionError("weights loaded before the arguments were checked")
    monkeypatch.setattr("scv_jax.models.load_demo", no_weights)
    _assert_one_line_error(argv, message, capsys)


def test_help_shows_every_default():
    assert cli.parse_args(["bench"]).k_values == list(DecoderConfig.k_values)
    for command, defaults in (("demo", ["192", "6", "0.0", "1", "3"]),
                              ("bench", ["[1, 4, 16]", "96", "3", "[0, 2, 4, 6, 8]"])):
        out = subprocess.run([sys.executable, "-m", "scv_jax", command, "--help"], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0
        text = " ".join(out.stdout.split())
        assert all(f"(default: {d})" in text for d in defaults), text


def test_module_entry_point_help():
    out = subprocess.run([sys.executable, "-m", "scv_jax", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "demo" in out.stdout and "bench" in out.stdout


FIXTURE = "tests/models/hf_fixtures/qwen2"


@pytest.mark.parametrize("drafter, label", [(["--draft", FIXTURE], "k=3"), (["--suffix"], "k=3, suffix")])
def test_generate_continues_text_with_a_checkpoint(capsys, drafter, label):
    argv = ["generate", "--model", FIXTURE, *drafter, "--prompt", "hello hello hello", "--max-new-tokens", "8",
            "--dtype", "float32", "--k", "3", "--compare"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("hello") and f"speculative ({label})" in out and "speedup" in out
    assert "greedy outputs identical  yes" in out


def test_generate_mistakes_are_one_line_errors(capsys, monkeypatch, tmp_path):
    assert cli.main(["generate", "--model", str(tmp_path), "--prompt", "x"]) == 2
    assert "tokenizer.json not found" in capsys.readouterr().err
    other = tmp_path / "other"
    other.mkdir()
    small = {pathlib.Path(FIXTURE): tiny_model(BYTE_TARGET), other: tiny_model(TransformerConfig(vocab_size=300))}
    monkeypatch.setattr("scv_jax.models.load_hf", lambda path, dtype: small[path])
    assert cli.main(["generate", "--model", FIXTURE, "--draft", str(other), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--draft {other} has vocab_size 300" in err and "must share the vocabulary" in err


@pytest.mark.slow
def test_generate_with_hub_ids(capsys, monkeypatch, tmp_path):
    """--model and --draft (at --draft-revision) as Hugging Face Hub ids, from an offline cache: the text
    of the model's directory."""
    cache = offline_hub(monkeypatch, tmp_path / "hub")
    cache_repo(cache, "org/qwen2", pathlib.Path(FIXTURE))
    cache_repo(cache, "org/draft", pathlib.Path(FIXTURE), refs=("v1",))      # no main: the revision is needed
    common = ["--prompt", "hello hello hello", "--max-new-tokens", "8", "--dtype", "float32", "--k", "3"]
    assert cli.main(["generate", "--model", FIXTURE, "--draft", FIXTURE, *common]) == 0
    text = capsys.readouterr().out.split("\n\n")[0]
    hub_ids = ["--model", "org/qwen2", "--draft", "org/draft", "--draft-revision", "v1"]
    assert cli.main(["generate", *hub_ids, *common]) == 0
    out = capsys.readouterr().out
    assert out.split("\n\n")[0] == text and text.startswith("hello") and "speculative (k=3)" in out


@pytest.mark.parametrize("argv, message", [
    (["--model", "org/missing"], "error: --model org/missing is not a local directory and not (completely) in "
                                 "the Hugging Face cache at {cache}, and HF_HUB_OFFLINE is set"),
    (["--model", FIXTURE, "--draft", "org/missing"], "error: --draft org/missing is not a local directory"),
    (["--model", FIXTURE, "--revision", "v1"],
     f"error: --model {FIXTURE} is a local directory: a revision ('v1') applies to Hub ids only"),
    (["--model", FIXTURE, "--draft-revision", "v1"], "error: --draft-revision needs --draft"),
    (["--model", "./missing"], "error: --model missing not found"),
])
def test_checkpoint_mistakes_are_one_line_errors(argv, message, monkeypatch, tmp_path, capsys):
    cache = offline_hub(monkeypatch, tmp_path / "hub")
    _assert_one_line_error(["generate", *argv, "--prompt", "x"], message.format(cache=cache), capsys)


# an EAGLE-3 head for FIXTURE (hidden size 32, 96 ids; 2 layers: aux layer ids in [0, 2))
HEAD = dict(hidden=32, heads=2, kv_heads=1, head_dim=16, ffn=64, target_vocab=96, draft_vocab=48)
GREEDY = ["--prompt", "hello hello hello", "--max-new-tokens", "8", "--dtype", "float32", "--k", "3"]


@pytest.fixture
def eagle3_head(tmp_path) -> pathlib.Path:
    return write_head(tmp_path / "head", head_tensors(**HEAD, seed=3), head_config(**HEAD, aux_layers=(0, 1, 1)))


def _text_and_drafting(out: str) -> tuple[str, list[str]]:
    """generate's text, and the stats rows that do not depend on the timing (the drafting mode and what
    was accepted)."""
    text, table = out.split("\n\n", 1)
    rows = [row for row in table.splitlines() if row.startswith(("speculative", "mean accepted", "acceptance"))]
    return text, [row.split("  ")[0] if row.startswith("speculative") else row for row in rows]


@pytest.mark.slow
def test_generate_with_an_eagle3_head(capsys, monkeypatch, tmp_path, eagle3_head):
    """--eagle3 DIR drafts with the head and prints the target's greedy text (--compare: the target
    alone), in --dtype, with --packed-verify too; the head as a Hub id at a revision, named by
    --speculative-config, does the same."""
    from scv_jax.models import load_eagle3

    heads = []
    monkeypatch.setattr("scv_jax.models.load_eagle3", lambda *args, **kwargs: heads.append(
        load_eagle3(*args, **kwargs)) or heads[-1])
    assert cli.main(["generate", "--model", FIXTURE, "--eagle3", str(eagle3_head), *GREEDY, "--compare"]) == 0
    out = capsys.readouterr().out
    assert "speculative (k=3, EAGLE-3 head)" in out and "greedy outputs identical  yes" in out and "per position: 0" in out, out
    # with --packed-verify it prints the same
    assert cli.main(["generate", "--model", FIXTURE, "--eagle3", str(eagle3_head), *GREEDY, "--packed-verify"]) == 0
    assert _text_and_drafting(capsys.readouterr().out) == _text_and_drafting(out)
    cache = offline_hub(monkeypatch, tmp_path / "hub")
    cache_repo(cache, "org/head", eagle3_head, refs=("v1",))        # no main: the revision is needed
    config = {"method": "eagle3", "model": "org/head", "revision": "v1", "num_speculative_tokens": 3}
    assert cli.main(["generate", "--model", FIXTURE, "--speculative-config", json.dumps(config), *GREEDY[:-2]]) == 0
    assert _text_and_drafting(capsys.readouterr().out) == _text_and_drafting(out)
    assert [head.config.dtype for head in heads] == ["float32"] * 3


@pytest.mark.parametrize("config, flags", [
    ({"method": "eagle3", "model": "org/head", "revision": "v1", "num_speculative_tokens": 2},
     ["--eagle3", "org/head", "--eagle3-revision", "v1", "--k", "2"]),
    ({"method": "draft_model", "model": FIXTURE}, ["--draft", FIXTURE]),
    ({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
     ["--ngram", "--k", "5", "--ngram-min", "2", "--ngram-max", "4"]),
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 8, "suffix_decoding_max_spec_factor": 2.5,
      "suffix_decoding_min_token_prob": 0.5, "suffix_decoding_max_cached_requests": 0},
     ["--suffix", "--suffix-max-depth", "8", "--suffix-max-spec-factor", "2.5", "--suffix-min-token-prob", "0.5",
      "--suffix-max-cached-requests", "0"]),
], ids=["eagle3", "draft_model", "ngram", "suffix"])
def test_speculative_config_sets_what_the_flags_set(config, flags, monkeypatch, capsys):
    """vLLM's --speculative-config runs generate with the settings of the flags it stands for."""
    seen = []

    def record(args):
        seen.append({name: value for name, value in vars(args).items()
                     if name not in ("speculative_config", "command_line")})
        raise ValueError("recorded")
    monkeypatch.setattr(cli, "checkpoints", record)
    common = ["generate", "--model", FIXTURE, "--prompt", "x"]
    assert cli.main([*common, "--speculative-config", json.dumps(config)]) == 2
    assert cli.main([*common, *flags]) == 2
    assert seen[0] == seen[1] and capsys.readouterr().err.count("recorded") == 2


HEAD_CONFIG = {"method": "eagle3", "model": "HEAD"}


@pytest.mark.parametrize("argv, message", [
    (["--eagle3", "HEAD", "--draft", FIXTURE], "argument --draft: not allowed with argument --eagle3"),
    (["--ngram", "--eagle3", "HEAD"], "argument --eagle3: not allowed with argument --ngram"),
    (["--eagle3-revision", "v1"], "error: --eagle3-revision needs --eagle3"),
    (["--eagle3", "HEAD", "--eagle3-revision", "v1"], "error: --eagle3 HEAD is a local directory: a revision ('v1') "
                                                     "applies to Hub ids only"),
    (["--eagle3", "org/missing"], "error: --eagle3 org/missing is not a local directory and not (completely) in "
                                  "the Hugging Face cache at {cache}, and HF_HUB_OFFLINE is set"),
    (["--speculative-config", "{method: eagle3}"],
     "error: argument --speculative-config: not valid JSON (Expecting property name enclosed in double quotes: "
     "line 1 column 2"),
    (["--speculative-config", "[]"], "error: argument --speculative-config: must be a JSON object, got '[]'"),
    (["--speculative-config", {"method": "medusa", "model": "HEAD"}],
     "argument --speculative-config: method must be one of 'eagle3', 'draft_model', 'ngram', 'suffix', got 'medusa'"),
    (["--speculative-config", {"model": "HEAD"}], "argument --speculative-config: method must be one of"),
    (["--speculative-config", {"method": ["eagle3"]}], "argument --speculative-config: method must be one of"),
    (["--speculative-config", {"method": "eagle3", "num_speculative_tokens": 2}],
     "argument --speculative-config: method 'eagle3' needs a model (a directory or a Hugging Face Hub id)"),
    (["--speculative-config", {**HEAD_CONFIG, "model": 7}], "argument --speculative-config: model must be a "
                                                           "non-empty string, got 7"),
    (["--speculative-config", {**HEAD_CONFIG, "num_speculative_tokens": 0}],
     "argument --speculative-config: num_speculative_tokens must be an int >= 1, got 0"),
    (["--speculative-config", {**HEAD_CONFIG, "num_speculative_tokens": 2.5}],
     "argument --speculative-config: num_speculative_tokens must be an int >= 1, got '2.5'"),
    (["--speculative-config", {"method": "suffix", "suffix_decoding_min_token_prob": 2}],
     "argument --speculative-config: suffix_decoding_min_token_prob must be a number in [0, 1], got '2'"),
    (["--speculative-config", {**HEAD_CONFIG, "prompt_lookup_max": 3}],
     "argument --speculative-config: prompt_lookup_max applies to method 'ngram', not 'eagle3'"),
    (["--speculative-config", {"method": "ngram", "model": "HEAD"}],
     "argument --speculative-config: model applies to method 'eagle3' or 'draft_model', not 'ngram'"),
    (["--speculative-config", {**HEAD_CONFIG, "draft_tensor_parallel_size": 1}],
     "argument --speculative-config: unknown field 'draft_tensor_parallel_size' (scv-jax reads method, model, "
     "revision, num_speculative_tokens, prompt_lookup_min"),
    (["--speculative-config", HEAD_CONFIG, "--eagle3", "HEAD"],
     "argument --eagle3: not allowed with argument --speculative-config"),
    (["--draft", FIXTURE, "--speculative-config", HEAD_CONFIG],
     "argument --speculative-config: not allowed with argument --draft"),
    (["--speculative-config", {**HEAD_CONFIG, "num_speculative_tokens": 2}, "--adaptive"],
     "error: --adaptive: not allowed with --speculative-config's num_speculative_tokens"),
    (["--speculative-config", HEAD_CONFIG, "--eagle3-revision", "v1"],
     'error: --eagle3-revision: not allowed with --speculative-config (give its "revision")'),
])
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_eagle3_mistakes_are_one_line_errors_before_loading_weights(command, argv, message, monkeypatch, tmp_path,
                                                                     eagle3_head, capsys):
    """``HEAD`` in an argument stands for the head's directory; a dict for its JSON."""
    def no_weights(*args, **kwargs):
        raise AssertionError("weights loaded before the arguments were checked")
    monkeypatch.setattr("scv_jax.models.load_hf", no_weights)
    cache = offline_hub(monkeypatch, tmp_path / "hub")
    argv = [json.dumps(a).replace('"HEAD"', json.dumps(str(eagle3_head))) if isinstance(a, dict)
            else a.replace("HEAD", str(eagle3_head)) for a in argv]
    prompt = ["--prompt", "x"] if command == "generate" else []
    _assert_one_line_error([command, "--model", FIXTURE, *argv, *prompt],
                           message.replace("HEAD", str(eagle3_head)).format(cache=cache), capsys)


def test_serve_takes_a_head_on_a_mesh(monkeypatch, eagle3_head):
    """``serve --eagle3 ... --mesh`` builds the engine on the mesh with the head as its drafter (decoding
    with a head on meshes: tests/decoding/test_mesh.py)."""
    from scv_jax import launch
    from scv_jax.decoding.caches import HeadCache
    from scv_jax.decoding.placement import OnMesh
    from scv_jax.models.eagle3 import Eagle3Head
    from scv_jax.serving import server

    parsed = []
    monkeypatch.setattr(server, "serve", lambda args: parsed.append(args) or 0)
    assert cli.main(["serve", "--model", FIXTURE, "--eagle3", str(eagle3_head), "--mesh", "1,1", "--dtype",
                     "float32"]) == 0
    runner = server.make_engine(parsed[0], launch.checkpoints(parsed[0])).engine.runner
    assert isinstance(runner.placement, OnMesh) and runner.placement.mesh.shape == {"data": 1, "model": 1}
    assert isinstance(runner.draft.merge(runner.draft_params), Eagle3Head)
    assert isinstance(runner.caches.take()[1], HeadCache)


@pytest.mark.parametrize("flags, overlap, draft_ahead", [([], True, False), (["--no-overlap"], False, False),
                                                         (["--draft-ahead"], True, True)])
def test_serve_flags_set_one_step_in_flight(monkeypatch, flags, overlap, draft_ahead):
    """``serve --no-overlap`` / ``--draft-ahead`` set ``DecoderConfig.overlap`` / ``draft_ahead``."""
    from scv_jax import launch
    from scv_jax.serving import server

    parsed = []
    monkeypatch.setattr(server, "serve", lambda args: parsed.append(args) or 0)
    assert cli.main(["serve", "--model", FIXTURE, "--ngram", "--dtype", "float32", *flags]) == 0
    engine = server.make_engine(parsed[0], launch.checkpoints(parsed[0])).engine
    assert engine.overlaps == overlap and engine.runner.config.draft_ahead == draft_ahead


def _recording_generate(monkeypatch, capsys):
    """Records every ``SpeculativeDecoder.generate`` call's tokens and what stdout held when it returned."""
    from scv_jax.decoding.decoder import SpeculativeDecoder

    calls, generate = [], SpeculativeDecoder.generate

    def recorded(self, *args, **kwargs):
        out = generate(self, *args, **kwargs)
        calls.append((out.tokens[0], capsys.readouterr().out))
        return out
    monkeypatch.setattr(SpeculativeDecoder, "generate", recorded)
    return calls


def test_generate_streams_once_and_stops_at_every_eos(tmp_path, monkeypatch, capsys):
    """One generation per decoder (a warm-up compiles, none runs twice), its text on stdout as it is made,
    every EOS id of generation_config.json honoured, a target-only run labelled as such."""
    model = tmp_path / "model"
    shutil.copytree(FIXTURE, model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": []}))
    calls = _recording_generate(monkeypatch, capsys)
    argv = ["generate", "--model", str(model), "--prompt", "hello", "--max-new-tokens", "12", "--dtype", "float32"]
    assert cli.main(argv) == 0
    (tokens, streamed), = calls
    text = load_tokenizer(model).decode(tokens)
    assert len(tokens) == 12 and text and streamed == "hello" + text     # printed before generate returned
    table = capsys.readouterr().out
    assert "target only (no drafter)" in table and "speculative" not in table and "12 steps" in table
    stop = next(i for i in range(2, 12) if tokens.index(tokens[i]) == i)
    never = next(i for i in range(96) if i not in tokens)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [never, tokens[stop]]}))
    calls.clear()
    assert cli.main(argv) == 0
    assert [tokens for tokens, _ in calls] == [tokens[:stop + 1]]


def test_k_above_the_budget_is_lowered(tiny_demo, capsys):
    assert cli.main(["demo", "--max-new-tokens", "5", "--k", "1000"]) == 0
    captured = capsys.readouterr()
    assert "--k 1000 lowered to 4" in captured.err and "speculative (k=4)" in captured.out


@pytest.mark.parametrize("argv, message", [
    (["generate", "--model", FIXTURE, "--prompt", "caf\udce9"], "--prompt is not valid UTF-8 (at character 3)"),
    (["demo", "--prompt", "\udcff"], "--prompt is not valid UTF-8"),
    (["generate", "--model", FIXTURE, "--prompt", "x " * 500, "--max-new-tokens", "100"],
     "exceed the model's max_position_embeddings 512"),
    (["demo", "--max-new-tokens", "1000000000"], "--max-new-tokens: the KV caches for 1000000032 positions need"),
    (["demo", "--seed", str(2 ** 32)], "argument --seed: must be an int in [0, 2**32)"),
])
def test_run_mistakes_are_one_line_errors(tiny_demo, argv, message, capsys):
    _assert_one_line_error(argv, message, capsys)


def test_generate_memory_error_names_its_flags(capsys, monkeypatch):
    """The KV caches that would not fit are a one-line error naming ``generate``'s flags that size them."""
    monkeypatch.setattr("scv_jax.models.load_hf", lambda path, dtype: tiny_model(BYTE_TARGET))
    _assert_one_line_error(["generate", "--model", FIXTURE, "--prompt", "x", "--max-new-tokens", str(10 ** 11)],
                           "lower --max-new-tokens or shorten --prompt", capsys)


@pytest.mark.parametrize("broken", ["config", "weights"])
def test_broken_checkpoints_are_one_line_errors(tmp_path, capsys, broken):
    model = tmp_path / "model"
    shutil.copytree(FIXTURE, model)
    if broken == "config":
        (model / "config.json").write_text("[]")
    else:
        (model / "model.safetensors").write_bytes(b"\0" * 5)
    assert cli.main(["generate", "--model", str(model), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    name = "config.json: must hold a JSON object" if broken == "config" else "model.safetensors is not a readable"
    assert err.count("\n") == 1 and name in err, err


def test_interrupt_is_one_line_with_status_130():
    """Ctrl-C (SIGINT) while the command works: one line on stderr, exit status 130, no traceback."""
    # nice (it execs the command): on a busy machine this test gets to signal before the command is done.
    # A SIGINT this process ignores (as a pytest-xdist worker may) would be ignored by the command too:
    # a handler (unlike SIG_IGN) is not inherited, so the command starts with SIGINT at its default.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        process = subprocess.Popen(["nice", "-n", "19", sys.executable, "-m", "scv_jax", "generate", "--model",
                                    FIXTURE, "--prompt", "hello", "--max-new-tokens", "500", "--dtype", "float32"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        while not process.stderr.readline().startswith("compiling"):    # the model is loaded: it works now
            assert process.poll() is None
        process.send_signal(signal.SIGINT)
        err = process.stderr.read()
        assert process.wait(timeout=120) == 130
    finally:
        process.kill()
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "scv-jax generate: interrupted", err


def test_text_printer_prints_whole_characters_and_lines(capsys):
    """Streamed text equals the text decoded at the end: a UTF-8 character split over tokens waits for
    its last byte, and a decoder that strips its text's leading space loses nothing after a newline."""
    text = "héllo\n wörld €\n\n end"
    stream, printed = cli.TextPrinter(lambda ids: bytes(ids).decode("utf-8", errors="replace")), ""
    for byte in text.encode():
        stream(0, [byte])
        printed += capsys.readouterr().out
        assert "\ufffd" not in printed and text.startswith(printed)
    stream.close()
    assert printed + capsys.readouterr().out == text + "\n"
    pieces = ["a", "\n", " b", "\n", " c"]               # SentencePiece-like: a text's first space is dropped
    stream = cli.TextPrinter(lambda ids: "".join(pieces[i] for i in ids).lstrip(" "))
    for i in range(len(pieces)):
        stream(0, [i])
    stream.close()
    assert capsys.readouterr().out == "a\n b\n c\n"
