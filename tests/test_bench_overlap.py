"""benchmarks/bench_overlap.py at its smallest, in-process: each row is measured without one step in flight,
with it and (a host drafter) with its chains drafted ahead; the n-gram drafter and the EAGLE-3 head emit
tokens in each."""

import json

import pytest

from tests.benchmark_modules import benchmark_module


@pytest.mark.slow
def test_bench_overlap_measures_each_row_both_ways(tmp_path):
    bench_overlap = benchmark_module("bench_overlap")
    out = tmp_path / "rows.json"
    assert bench_overlap.main(["--device-ms", "1", "--batches", "2", "--drafters", "ngram", "eagle3", "--steps", "3",
                               "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    for drafter, modes in (("ngram", ("ahead", "off", "on")), ("eagle3", ("off", "on"))):
        assert sorted((r["controls"], r["mode"]) for r in rows if r["drafter"] == drafter) == [
            (c, m) for c in (False, True) for m in modes]
    for row in rows:
        assert row["period_ms"] >= 0.5 and 1.0 <= row["tokens_per_step"] <= 5.0      # (D = 1 ms, timed in a window)
        assert row["overlap"] == (row["mode"] != "off")
