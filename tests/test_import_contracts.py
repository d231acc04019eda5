"""The package's architecture as import contracts: ``lint-imports`` keeps the contracts of
``pyproject.toml`` ([tool.importlinter]: the layers, ``pallas_kernels`` a leaf, host-only modules free of
jax), breaks them on an upward import, and no two modules import each other through any chain (grimp's
graph: module-level imports, imports inside functions and under ``TYPE_CHECKING`` alike).
docs/contributing.md, "Layers and import contracts", draws the layers."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tomllib

import pytest

grimp = pytest.importorskip("grimp")

ROOT = pathlib.Path(__file__).parents[1]
LINT_IMPORTS = pathlib.Path(sys.executable).with_name("lint-imports")
CONTRACTS = {c["name"]: c for c in
             tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]}
LAYERS = "scv_jax layers, top to bottom"
LEAF = "pallas_kernels is a leaf (no scv_jax, no flax)"
HOST_ONLY = "host-only modules import no jax"
ROLES = "decoding: the roles, top to bottom"

# ``scv_jax/__init__.py`` resolves its public names with importlib, which no static graph sees: a module
# that imports the root package may reach any layer. Only the top layer does.
ROOT_IMPORTERS_ALLOWED = ("scv_jax.__main__", "scv_jax.cli", "scv_jax.serving")


def _graph(*packages: str) -> grimp.ImportGraph:
    return grimp.build_graph(*packages, exclude_type_checking_imports=False, cache_dir=None)


def _cycles(graph: grimp.ImportGraph, prefix: str) -> list[frozenset[str]]:
    """The strongly connected components of more than one module among the modules under ``prefix``
    (Tarjan's algorithm, iterative)."""
    modules = sorted(m for m in graph.modules if m == prefix or m.startswith(prefix + "."))
    inside = set(modules)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m) & inside) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in modules:
        if start in index:
            continue
        work = [(start, iter(edges[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(edges[succ])))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(frozenset(component))
    return components


def _describe(graph: grimp.ImportGraph, component: frozenset[str]) -> str:
    """One cycle through the component, each import with its line: ``a -> b (line 3: import b)``."""
    first = min(component)
    second = min(m for m in graph.find_modules_directly_imported_by(first) if m in component)
    back = graph.find_shortest_chain(importer=second, imported=first)
    path = [first, *back]
    hops = []
    for importer, imported in zip(path, path[1:]):
        details = graph.get_import_details(importer=importer, imported=imported)
        where = "; ".join(f"line {d['line_number']}: {d['line_contents']}" for d in details) or "?"
        hops.append(f"  {importer} -> {imported} ({where})")
    return f"cycle among {sorted(component)}:\n" + "\n".join(hops)


@pytest.fixture(scope="module")
def graph():
    return _graph("scv_jax")


def test_the_cycle_finder_sees_function_level_and_type_checking_imports(tmp_path, monkeypatch):
    package = tmp_path / "cyclic"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cyclic import b\n")
    (package / "b.py").write_text("def f():\n    from cyclic import c\n")
    (package / "c.py").write_text("import cyclic.a\n")
    (package / "d.py").write_text("import cyclic.a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = _graph("cyclic")
    assert _cycles(graph, "cyclic") == [frozenset({"cyclic.a", "cyclic.b", "cyclic.c"})]
    described = _describe(graph, frozenset({"cyclic.a", "cyclic.b", "cyclic.c"}))
    assert "cyclic.a -> cyclic.b (line 3:" in described and "cyclic.c -> cyclic.a (line 1:" in described


def test_no_import_cycle(graph):
    """No two scv_jax modules import each other, directly or through others, counting imports inside
    functions and under TYPE_CHECKING (each cycle is a strongly connected component of the graph)."""
    cycles = _cycles(graph, "scv_jax")
    assert not cycles, "import cycles:\n" + "\n".join(_describe(graph, c) for c in cycles)


def test_only_the_top_layer_imports_the_lazy_root_package(graph):
    importers = sorted(m for m in graph.find_modules_that_directly_import("scv_jax")
                       if not m.startswith(ROOT_IMPORTERS_ALLOWED))
    assert importers == [], f"import the defining module, not the scv_jax root package: {importers}"


def _lint_imports(cwd: pathlib.Path) -> subprocess.CompletedProcess:
    if not LINT_IMPORTS.exists():
        pytest.skip(f"no {LINT_IMPORTS} (pip install -e '.[test]' installs import-linter)")
    env = {**os.environ, "PYTHONPATH": str(cwd), "COLUMNS": "200"}
    return subprocess.run([str(LINT_IMPORTS), "--no-logo", "--no-cache"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_lint_imports_keeps_every_contract():
    out = _lint_imports(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"Contracts: {len(CONTRACTS)} kept, 0 broken." in out.stdout, out.stdout


@pytest.mark.parametrize("module, addition, broken", [
    # an op importing the HTTP server: upward across five layers
    ("scv_jax/ops/registry.py", "import scv_jax.serving.app\n", LAYERS),
    # the same inside a function: it counts
    ("scv_jax/verify/step.py", "def _later():\n    from scv_jax.decoding import decoder\n", LAYERS),
    # a kernel importing the package that calls it, under TYPE_CHECKING: it counts
    ("pallas_kernels/fp8.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import scv_jax.arguments\n",
     LEAF),
    # jax reached indirectly, through scv_jax.checks
    ("scv_jax/decoding/positions.py", "from scv_jax.checks import as_array\n", HOST_ONLY),
    # the scheduler reaching into the runner (its sibling role): a type hint pointing sideways counts
    ("scv_jax/decoding/scheduler.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
     "    from scv_jax.decoding.runner import StepRunner\n", ROLES),
], ids=["upward", "function-level", "type-checking", "indirect-jax", "sideways-role"])
def test_lint_imports_breaks_a_contract_on_a_bad_import(tmp_path, module, addition, broken):
    assert broken in CONTRACTS
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "weights")
    for package in ("scv_jax", "pallas_kernels"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with open(tmp_path / module, "a") as f:
        f.write(addition)
    out = _lint_imports(tmp_path)
    assert out.returncode != 0, out.stdout
    assert f"{broken} BROKEN" in out.stdout, out.stdout
    kept = sum(f"{name} KEPT" in out.stdout for name in CONTRACTS)
    assert kept < len(CONTRACTS) and f"Contracts: {kept} kept, {len(CONTRACTS) - kept} broken." in out.stdout
