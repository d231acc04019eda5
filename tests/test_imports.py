"""Import hygiene: the kernels are a leaf, ``import scv_jax`` is cheap and loads Flax only when a
model or the decoder is used, and every public name resolves (each check in a fresh interpreter)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import tomllib

import pytest

import scv_jax

HOST_ONLY_MODULES = next(c["source_modules"] for c in tomllib.loads(
    (pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    if c["name"] == "host-only modules import no jax")
KERNEL_MODULES = sorted(p.stem for p in (pathlib.Path(__file__).parents[1] / "pallas_kernels").glob("*.py")
                        if p.stem != "__init__")


def _fresh(code: str) -> dict:
    """Runs ``code`` (which sets ``result``) in a new interpreter and returns ``result``."""
    script = f"import json, sys, time\n{code}\nprint(json.dumps(result))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={"JAX_PLATFORMS": "cpu", "PATH": ""})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def _loaded(prefixes: str) -> str:
    return f"sorted({{m.split('.')[0] for m in sys.modules if m.split('.')[0] in {prefixes!r}}})"


@pytest.mark.parametrize("module", KERNEL_MODULES)
def test_kernels_are_a_leaf(module):
    loaded = _fresh(f"import pallas_kernels.{module}\nresult = {_loaded(('flax', 'scv_jax'))}")
    assert loaded == []


def test_import_scv_jax_is_cheap_and_lazy():
    result = _fresh("start = time.perf_counter()\nimport scv_jax\nseconds = time.perf_counter() - start\n"
                    f"result = dict(seconds=seconds, loaded={_loaded(('jax', 'flax', 'pallas_kernels'))})")
    assert result["loaded"] == [] and result["seconds"] < 0.5, result


def test_the_adaptive_controller_loads_no_jax():
    """The controller is host-side numpy (the simulator and host benchmarks run without jax)."""
    assert _fresh(f"import scv_jax\nscv_jax.AdaptiveController\nresult = {_loaded(('jax',))}") == []


@pytest.mark.parametrize("module", HOST_ONLY_MODULES)
def test_host_only_modules_load_no_jax(module):
    """What lint-imports checks statically ("host-only modules import no jax", pyproject.toml), at run
    time: the module, its parent packages' ``__init__`` and, for a package, its submodules."""
    code = (f"import importlib, pkgutil\nm = importlib.import_module({module!r})\n"
            "for info in pkgutil.walk_packages(getattr(m, '__path__', []), m.__name__ + '.'):\n"
            "    importlib.import_module(info.name)\n"
            f"result = {_loaded(('jax', 'jaxlib', 'flax'))}")
    assert _fresh(code) == []


def test_ops_load_no_flax_and_the_decoder_loads_it():
    result = _fresh("import scv_jax\nscv_jax.accept_greedy, scv_jax.commit_draft_kv, scv_jax.verify_step\n"
                    f"ops = {_loaded(('flax',))}\nscv_jax.SpeculativeDecoder\n"
                    f"result = dict(ops=ops, decoder={_loaded(('flax',))})")
    assert result == {"ops": [], "decoder": ["flax"]}


def test_models_load_no_checkpoint_library():
    """``scv_jax.models`` never imports torch/transformers; safetensors and tokenizers load only inside
    ``load_hf`` and ``load_tokenizer``."""
    libraries = ("torch", "transformers", "safetensors", "tokenizers")
    assert _fresh(f"import scv_jax.models\nresult = {_loaded(libraries)}") == []


def test_xla_backend_never_loads_a_kernel():
    result = _fresh("import scv_jax, jax.numpy as jnp\n"
                    "scv_jax.accept_greedy([1], [0, 1], [1], [2], max_spec_len=1, backend='xla')\n"
                    "scv_jax.accept_tree_greedy([[1]], [[-1]], [1], [[1, 2]], max_depth=1, backend='xla')\n"
                    "cache = scv_jax.PagedKVCache.create(1, 2, 4, 1, 128)\n"
                    "scv_jax.commit_draft_kv(cache, jnp.ones((1, 1, 1, 128)), jnp.ones((1, 1, 1, 128)), [0])\n"
                    "scv_jax.paged_attention(jnp.ones((1, 1, 1, 128)), cache, 0, [[0]], [3], backend='xla',\n"
                    "                        new_keys=jnp.ones((1, 1, 1, 128)), new_values=jnp.ones((1, 1, 1, 128)))\n"
                    "result = sorted(m for m in sys.modules if m.startswith(('pallas_kernels.', 'jax.experimental.pallas')))")
    # only the arithmetic the reference shares with the kernels, never a kernel or Pallas itself
    assert set(result) <= {"pallas_kernels.fp8", "pallas_kernels.ragged_batch", "pallas_kernels.sampling_math",
                           "pallas_kernels.tree_mask"}, result


def test_every_public_name_resolves():
    missing = [name for name in scv_jax.__all__ if not hasattr(scv_jax, name)]
    assert missing == []
    assert set(scv_jax.__all__) <= set(dir(scv_jax))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        scv_jax.nope  # noqa: B018
