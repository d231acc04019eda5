"""Every Python snippet of README.md and docs/*.md runs, and what it says it prints is what it prints.

The convention (docs/contributing.md repeats it):

- The ```python blocks of one page run in order, in one namespace, in a fresh interpreter per page
  (``JAX_PLATFORMS=cpu``, from the repository root). Other fences (```bash, ```text, ...) never run.
- ``print(expr)  # -> expected`` asserts that the line prints ``expected`` (both stripped of surrounding
  whitespace; ``...`` in ``expected`` matches any text). Such a print fits on one line. A wrong claim
  fails with the page and line.
- A block whose first line is ``# doc-test: skip (reason)`` is not run: a snippet that needs a GPU,
  several hosts or files that are not in the repository. Give the reason.

Run one page by hand: ``python tests/test_docs_snippets.py docs/ops.md``.
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import re
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]
SKIP_MARK = "# doc-test: skip"
_FENCE = re.compile(r"^```\s*(\S*)")
_CLAIM = re.compile(r"^(\s*)print\((.*)\)\s*#\s*->\s?(.*?)\s*$")


def pages() -> list[pathlib.Path]:
    """README.md and every docs/*.md page."""
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def python_blocks(text: str) -> list[tuple[int, str]]:
    """The runnable ```python blocks of a page: (line of the block's first code line, code)."""
    blocks, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, end = i + 1, i + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        code = lines[start:end]
        if m.group(1) in ("python", "py") and not (code and code[0].startswith(SKIP_MARK)):
            blocks.append((start + 1, "\n".join(code)))
        i = end + 1
    return blocks


def with_claims_checked(code: str) -> str:
    """``code`` with each ``print(x)  # -> y`` line checking what it prints (line numbers kept)."""
    out = []
    for line in code.split("\n"):
        m = _CLAIM.match(line)
        if m:
            indent, args, expected = m.groups()
            line = f"{indent}with __doc_expect__({expected!r}): print({args})"
        out.append(line)
    return "\n".join(out)


@contextlib.contextmanager
def _expect(expected: str):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        yield
    printed = buf.getvalue().strip()
    sys.stdout.write(buf.getvalue())
    pattern = ".*".join(re.escape(part) for part in expected.split("..."))
    if not re.fullmatch(pattern, printed, re.DOTALL):
        raise AssertionError(f"printed {printed!r}, the page says {expected!r}")


def run_page(path: pathlib.Path) -> None:
    """Runs a page's blocks in order in one namespace; raises on a failing block or a wrong claim."""
    namespace = {"__name__": "__doc_snippets__", "__doc_expect__": _expect}
    for line, code in python_blocks(path.read_text()):
        source = "\n" * (line - 1) + with_claims_checked(code)
        exec(compile(source, str(path), "exec"), namespace)


def _run_in_subprocess(path: pathlib.Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, __file__, str(path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


if __name__ == "__main__":
    run_page(pathlib.Path(sys.argv[1]))
    sys.exit(0)

import pytest  # noqa: E402  (the page runner above needs only the standard library)


@pytest.mark.parametrize("page", [p for p in pages() if python_blocks(p.read_text())],
                         ids=lambda p: str(p.relative_to(ROOT)))
@pytest.mark.slow
def test_page_snippets_run_and_their_claims_hold(page):
    result = _run_in_subprocess(page)
    assert result.returncode == 0, f"{page.relative_to(ROOT)}:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"


def test_every_fenced_python_block_is_run_or_says_why_not():
    for page in pages():
        for m in re.finditer(r"^```(?:python|py)[^\n]*\n(.*?)^```", page.read_text(), re.M | re.S):
            first = m.group(1).split("\n", 1)[0]
            if first.startswith(SKIP_MARK):
                assert re.match(rf"{re.escape(SKIP_MARK)} \(.+\)", first), f"{page.name}: skip without a reason"


# --- the extractor itself ---

_PAGE = textwrap.dedent('''\
    # A page

    ```python
    x = [1, 2]
    print(x)  # -> [1, 2]
    ```

    text, then a shell block that never runs:

    ```bash
    exit 1
    ```

    ```python
    for i in range(2):
        print(x[i] > 0)  # -> {first}
    print("took 0.123 s")  # -> took ... s
    ```

    ```python
    # doc-test: skip (needs a GPU)
    raise SystemExit(3)
    ```
    ''')


def test_blocks_are_extracted_with_their_lines():
    blocks = python_blocks(_PAGE.format(first="True"))
    assert [line for line, _ in blocks] == [4, 15]
    assert blocks[0][1] == "x = [1, 2]\nprint(x)  # -> [1, 2]"
    assert "SystemExit" not in "".join(code for _, code in blocks)


def test_claims_become_checks_on_the_same_line():
    code = with_claims_checked("if True:\n    print(f(1), 2)  # -> 3 2\nprint(1)")
    assert code.split("\n") == ["if True:", "    with __doc_expect__('3 2'): print(f(1), 2)", "print(1)"]


def test_a_true_page_passes_and_shares_one_namespace(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(_PAGE.format(first="True"))
    result = _run_in_subprocess(page)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[1,", "2]", "True", "True", "took", "0.123", "s"]


def test_a_wrong_claim_fails_naming_its_line(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(_PAGE.format(first="False"))
    result = _run_in_subprocess(page)
    assert result.returncode != 0
    assert f'File "{page}", line 16' in result.stderr
    assert "printed 'True', the page says 'False'" in result.stderr


def test_every_public_name_is_in_the_api_reference():
    import scv_jax
    import scv_jax.models

    api = (ROOT / "docs" / "api.md").read_text()
    documented = set(re.findall(r"^\.\. (?:auto\w+|py:data):: ([\w.]+)", api, re.M))
    public = {f"scv_jax.{n}" for n in scv_jax.__all__ if n != "models"}
    public |= {f"scv_jax.models.{n}" for n in scv_jax.models.__all__}
    assert public - documented == set(), "add these to docs/api.md"
    # names of the package and of scv_jax.models (deeper modules, e.g. scv_jax.serving.chat, may add theirs)
    top = {name for name in documented if name.count(".") == 1 or name.startswith("scv_jax.models.")}
    assert top - public == set(), "not public any more: remove from docs/api.md"


def test_ci_runs_the_readme_test_command_and_the_docs_build():
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    test_command = "python -m pip install -q -e '.[test]' && python -m pytest -n 2"
    assert test_command in ci.splitlines() and test_command in readme
    assert "python -m pip install -q -e '.[docs]'" in ci
    assert re.search(r"^python -m sphinx -W --keep-going (-q )?-b html docs ", ci, re.M)
    pyproject = (ROOT / "pyproject.toml").read_text()
    docs_extra = re.search(r"^docs = \[(.*)\]$", pyproject, re.M).group(1)
    assert "sphinx" in docs_extra and "myst-parser" in docs_extra
    # the import contracts, after the docs build and before the tests (tests/test_import_contracts.py)
    lines = ci.splitlines()
    lint = lines.index("lint-imports --no-logo --no-cache")
    assert any(line.startswith("python -m sphinx ") for line in lines[:lint]) and lines.index(test_command) > lint
    test_extra = re.search(r"^test = \[(.*?)\]$", pyproject, re.M | re.S).group(1)
    assert "import-linter" in test_extra


def test_a_failing_block_fails_the_page(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 1\n```\n\n```python\nx = missing_name\n```\n")
    result = _run_in_subprocess(page)
    assert result.returncode != 0 and f'File "{page}", line 6' in result.stderr and "NameError" in result.stderr
