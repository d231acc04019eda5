"""``benchmarks/compile_8b.py --set serve --dry-run``: serve's executables for the abstract 8B target with a
draft model and with an EAGLE-3 head, as the engine enumerates them (nothing compiled)."""

import os
import subprocess
import sys

from tests.benchmark_modules import benchmark_module

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_compile_8b_counts_serves_executables_for_both_drafters():
    out = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "compile_8b.py"), "--set", "serve",
                          "--dry-run", "--layers", "per_layer"], capture_output=True, text=True, timeout=600,
                         cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in out.stdout.splitlines()
            if line.startswith(("| draft |", "| eagle3 |"))]
    # serve's defaults: 5 batch buckets x 4 block-table widths of the prefill, the draft's catch-up and the
    # decode steps at k 0 and 4, greedy or sampled, with logprobs or without; serve waits for the two
    # prefills and per k the largest sampled step with logprobs (its stand-in for the other three kinds)
    counts = "200 (40 prefill_step, 160 decode_step) / 10 / 4"
    assert [row[:3] for row in rows] == [["draft", "per_layer", counts], ["eagle3", "per_layer", counts]]


def test_largest_temporaries_are_the_arrays_an_executable_materialises():
    import jax
    import jax.numpy as jnp
    compile_8b = benchmark_module("compile_8b")
    x = jnp.ones((4, 1000), jnp.float32)
    sorted_text = jax.jit(lambda x: jnp.sort(x * 2, axis=-1)[:, :3]).lower(x).compile().as_text()
    found = compile_8b.largest_temporaries(sorted_text, dim=1000)
    assert found and found[0][0] == 4 * 1000 * 4 and found[0][1].startswith("f32[4,1000] ")   # the sort's output
    assert compile_8b.largest_temporaries(sorted_text, dim=777) == []
    sliced_text = jax.jit(lambda x: x[:, :3] + 1).lower(x).compile().as_text()
    assert compile_8b.largest_temporaries(sliced_text, dim=1000) == []     # only the parameter holds 1000
    # a donated array updated in place is the parameter's buffer, not a temporary; the update's rows are
    scatter_text = jax.jit(lambda c, i: c.at[i].set(1.0), donate_argnums=0).lower(x, jnp.array([1, 3])).compile()
    assert [key.split()[0] for _, key in compile_8b.largest_temporaries(scatter_text.as_text(), dim=1000)] == [
        "f32[2,1,1000]"]


def test_memory_needs_compiled_executables(capsys):
    compile_8b = benchmark_module("compile_8b")
    for argv in (["--set", "serve", "--dry-run", "--memory"], ["--memory"], ["--target", "qwen2.5-7b"]):
        try:
            compile_8b.main(argv)
        except SystemExit as stop:
            assert stop.code == 2
        else:
            raise AssertionError(f"{argv} was accepted")
    assert "--memory needs --set serve" in capsys.readouterr().err
