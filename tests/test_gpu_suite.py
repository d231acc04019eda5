"""The GPU suite's dry run: the same code path as on an H200, on CPU at tiny sizes (interpret)."""

import json
import os
import subprocess
import sys

import pytest

from tests.benchmark_modules import benchmark_module

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_gpu_suite_dry_run(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "gpu_suite.py"), "--dry-run",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "suite.json").read_text())
    assert report["environment"]["launch_floor_us"] > 0 and report["environment"]["copy_gbps"] > 0
    checks = report["checks"]
    assert all(c["ok"] for c in checks), checks       # each check function once (DRY.checks; every one on a GPU)
    assert [c["check"] for c in checks] == list(benchmark_module("gpu_suite").DRY.checks)
    timings = report["timings"]
    assert {r["op"] for r in timings["acceptance"]} == {"greedy", "greedy-logits", "rejection"}
    assert {r["backend"] for r in timings["acceptance"] + timings["commit"]} == {"interpret", "xla"}
    assert all("device_seconds" in r for r in timings["acceptance"])              # device time for every kernel
    assert all("all_device_s" in r for r in timings["commit"]) and not timings["skipped"]
    assert {(r["heads"], r["head_dim"]) for r in timings["commit"]} >= {(1, 64)}  # a "tiled" layout shape
    assert report["peer"]["status"] in ("ran", "skipped")
    assert {r["backend"] for r in timings["attention"]} == {"interpret", "xla"}
    assert any(c["check"].startswith("attention") for c in checks)
    assert report["pytest"]["returncode"] == 0
    engine = report["engine"]                  # the engine rows ran through scv_jax.Engine, all passing
    rows = engine["rows"]
    assert rows and all(r["ok"] for r in rows), rows
    assert {(r["config"], r["mode"]) for r in rows} >= {("autoregressive", "greedy"), ("autoregressive", "sampled")}
    # 9 configurations (2 with overlap off) x greedy / sampled; the dry run runs 4 of them (each drafter kind,
    # a chain and a tree, overlap on and off: ENGINE_DRY.configs), the drafters' greedy only (ENGINE_DRY.sampled),
    # and its budget skips none
    assert len(engine["skipped"]) == 5 and len(rows) == 6, engine["skipped"]
    assert {(r["config"], r["mode"]) for r in rows} == {
        ("autoregressive", "greedy"), ("autoregressive", "sampled"), ("autoregressive, overlap off", "greedy"),
        ("autoregressive, overlap off", "sampled"), ("draft-model chain k=2, overlap off", "greedy"),
        ("EAGLE-3 head tree (2 deep, 2 wide, 4 nodes)", "greedy")}
    assert all(r["ms_per_step"] > 0 and r["tokens_per_s"] > 0 and r["memory_floor_us"] > 0 for r in rows)
    assert all(r["detail"] == "identical to target-only" for r in rows if r["mode"] == "greedy"
               and r["config"] != "autoregressive")
    markdown = (tmp_path / "suite.md").read_text()
    assert "Native correctness" in markdown and "Timings" in markdown and "vLLM peer" in markdown
    assert "Engine end to end" in markdown and "x memory floor" in markdown


def test_peer_runs_when_its_script_is_present(tmp_path, monkeypatch):
    """The suite runs .peer/vllm_peer_ab.py (given torch and triton) and keeps its report."""
    gpu_suite = benchmark_module("gpu_suite")
    script = tmp_path / "vllm_peer_ab.py"
    script.write_text("import os, sys\nout = sys.argv[sys.argv.index('--out') + 1]\nos.makedirs(out)\n"
                      "open(os.path.join(out, 'peer_ab.md'), 'w').write('| op | vLLM graph |' + str(sys.argv[1:]))\n")
    monkeypatch.setattr(gpu_suite, "PEER_SCRIPT", str(script))
    monkeypatch.setattr(gpu_suite.importlib.util, "find_spec", lambda name: object())
    peer = gpu_suite.run_peer(gpu_suite.DRY, str(tmp_path / "out"), budget_s=30, dry_run=True)
    assert peer["status"] == "ran" and peer["returncode"] == 0
    assert "| op | vLLM graph |" in peer["markdown"] and "--dry-run" in peer["markdown"]
    assert "vLLM graph" in gpu_suite.peer_section(peer)
    monkeypatch.setattr(gpu_suite, "PEER_SCRIPT", str(tmp_path / "missing.py"))
    assert gpu_suite.run_peer(gpu_suite.DRY, str(tmp_path), 30, True)["status"] == "skipped"



@pytest.mark.slow
def test_gpu_loop_run_dry_run(tmp_path):
    """The decoding loop's one-command device run (benchmarks/gpu_loop_run.sh) on CPU at tiny sizes: every
    step finishes within its limit and leaves its table in $OUT, and a dry run appends nothing."""
    results = os.path.join(REPO, "benchmarks", "RESULTS.md")
    before = open(results).read()
    proc = subprocess.run(["bash", os.path.join(REPO, "benchmarks", "gpu_loop_run.sh")], capture_output=True,
                          text=True, timeout=600, env=dict(os.environ, DRY_RUN="1", OUT=str(tmp_path),
                                                           PYTHON=sys.executable))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for step, table in (("host_step", "| batch | cold caches (MB) | autoregressive |"),
                        ("controller", "| batch | steps per request |"),
                        ("e2e_model", "| stdlib | model | 1 | 0 | adaptive |")):     # (n-gram: not in a dry run)
        log = (tmp_path / f"{step}.log").read_text()
        assert "rc=0 " in log and table in log, (step, log[-2000:])
    assert (tmp_path / "RESULTS.md").read_text() == before == open(results).read()


def test_timings_names_a_known_group(tmp_path, capsys):
    """``--timings`` takes the groups' own names and refuses another with a one-line usage error."""
    gpu_suite = benchmark_module("gpu_suite")
    names = [name for name, _, _ in gpu_suite.timing_groups(gpu_suite.DRY, ("interpret", "xla"), {})]
    assert "paged attention" in names and "commit" in names
    try:
        gpu_suite.main(["--dry-run", "--out", str(tmp_path), "--timings", "paged attention,bogus"])
    except SystemExit as stop:
        assert stop.code == 2
    else:
        raise AssertionError("an unknown --timings group was accepted")
    assert "--timings: unknown group(s) ['bogus']" in capsys.readouterr().err
    assert not (tmp_path / "suite.json").exists()        # refused before any section ran
