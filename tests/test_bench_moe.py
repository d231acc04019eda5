"""bench_moe's dry run in-process: distinct experts of a verify step (uniform expectation, random weights, the
tiny MoE fixtures), the compiled toy-width step's analyses and the adaptive controller on MoE vs dense costs."""

import json

import numpy as np

from tests.benchmark_modules import benchmark_module


def test_bench_moe_dry_run(tmp_path, capsys):
    bench_moe = benchmark_module("bench_moe")
    result = bench_moe.main(["--dry-run", "--json", str(tmp_path / "moe.json")])
    assert json.loads((tmp_path / "moe.json").read_text()) == json.loads(json.dumps(result))
    out = capsys.readouterr().out
    assert "| model (E, top-k) | routing | batch | k=0 |" in out and "| target cost model |" in out

    experts = result["experts"]
    assert {row["model"] for row in experts} >= {"qwen3_moe", "mixtral", "gpt_oss"}
    by_source = {}
    for row in experts:
        distinct, e, top_k = np.array(row["distinct"]), row["num_experts"], row["top_k"]
        assert np.all(np.diff(distinct) >= 0) and distinct.max() <= e                  # non-decreasing in k, <= E
        assert distinct[0] >= top_k
        assert np.allclose(row["bytes"], distinct * row["layers"] * row["expert_bytes"])
        if row["batch"] == 1:                        # one token: its own top_k experts
            assert distinct[0] == top_k
        by_source.setdefault((row["model"], row["source"]), []).append((row["batch"], distinct))
    for rows in by_source.values():                  # non-decreasing in batch (a batch's rows include the smaller's)
        rows.sort(key=lambda pair: pair[0])
        assert all(np.all(small <= large) for (_, small), (_, large) in zip(rows, rows[1:]))

    uniform = [row for row in experts if row["source"] == "uniform expectation"]
    random = {row["batch"]: np.array(row["distinct"]) for row in experts if row["source"] == "random weights"}
    for row in uniform:
        tokens = row["batch"] * (np.array(row["k"]) + 1)
        e, top_k = row["num_experts"], row["top_k"]
        assert np.allclose(row["distinct"], e * (1 - (1 - top_k / e) ** tokens))
        assert np.allclose(random[row["batch"]], row["distinct"], rtol=0.15)     # random routing ~ uniform
    assert bench_moe.expected_distinct(1, 128, 8) == 8

    for row in result["compiled"]:                   # XLA counts every expert; routing reads fewer
        assert 0 < row["routed_bytes"] < row["argument_bytes"] <= row["xla_bytes_accessed"]
        assert row["xla_flops"] > 0

    controller = result["controller"]
    max_k = len(controller[0]["step_ms"]) - 1
    assert all(0 <= row["oracle_k"] <= max_k and 0 <= row["adaptive_k"] <= max_k for row in controller)
    moe = {(row["batch"], row["alpha"]): row for row in controller if row["model"] == "MoE"}
    dense = {(row["batch"], row["alpha"]): row for row in controller if row["model"].startswith("dense, active")}
    assert moe.keys() == dense.keys()
    for key, row in moe.items():                     # experts make k dearer: a steeper step cost, a smaller best k
        assert np.all(np.diff(row["step_ms"]) > 0)
        assert row["step_ms"][-1] / row["step_ms"][0] > dense[key]["step_ms"][-1] / dense[key]["step_ms"][0]
        assert row["oracle_k"] <= dense[key]["oracle_k"]


def test_routed_experts_are_those_the_models_moe_blocks_route(monkeypatch):
    """The benchmark's per-layer capture (attention, then the router's ``moe.route``) picks the experts the
    model's own forward routes, in layer order (gpt-oss: a router bias, sinks, alternating windows)."""
    import jax
    from flax import nnx

    from scv_jax.models import moe

    bench_moe = benchmark_module("bench_moe")
    model = bench_moe.load_hf(f"{bench_moe.FIXTURES}/gpt_oss", dtype="float32").per_layer()
    tokens = jax.random.randint(jax.random.key(0), (3, 10), 0, model.config.vocab_size)

    def routed_by_forward(model, tokens):
        picked = []
        route = moe.route

        def recording(*args, **kwargs):
            weights, experts = route(*args, **kwargs)
            picked.append(experts.reshape(*tokens.shape, -1))
            return weights, experts
        monkeypatch.setattr(moe, "route", recording)
        model(tokens)
        monkeypatch.setattr(moe, "route", route)
        return jax.numpy.stack(picked)

    expected = nnx.jit(routed_by_forward)(model, tokens)
    assert expected.shape == (model.config.num_layers, 3, 10, model.config.num_experts_per_tok)
    np.testing.assert_array_equal(nnx.jit(bench_moe.routed_experts)(model, tokens), expected)
