"""The README and docs/ stay navigable: relative links and anchors resolve, and the
README's test command is the one CI (``.ci/run``) runs, verbatim."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.harness import ROOT

DOCS = ["README.md", "CHANGELOG.md", *(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))]


def _anchors(path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes."""
    found = set()
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            text = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return found


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_resolve(doc):
    path = ROOT / doc
    for link in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if link.startswith(("http://", "https://", "mailto:")):
            continue
        target_part, _, anchor = link.partition("#")
        target = (path.parent / target_part).resolve() if target_part else path
        assert target.exists(), f"{doc}: {link} does not exist"
        if anchor and target.suffix == ".md":
            assert anchor in _anchors(target), f"{doc}: no heading for #{anchor} in {target_part}"


def test_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    (command,) = [b for b in blocks if "pytest" in b]
    assert command in (ROOT / ".ci" / "run").read_text().splitlines()


def test_quick_start_venv_gets_numpy():
    """The README's quick start installs torch and the package alone; without numpy torch
    warns "Failed to initialize NumPy" once per rank on the newcomer's first screen."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "numpy" in [re.split(r"[<>=!~ ;\[]", d)[0] for d in project["dependencies"]]
    readme = (ROOT / "README.md").read_text()
    assert "pip install torch==2.13.0 -e . &&" in readme


# Where a path into tests/ may be named: the docs, the tools, the package, the tests.
_NAMING = ("README.md", "CHANGELOG.md", "pyproject.toml", ".ci/run", "docs/**/*.md",
           "docs/**/*.json", "scripts/*", "examples/**/*.py", "fsdp_retain/**/*.py",
           "tests/**/*.py", "tests/**/*.md", "tests/*.txt")
_TEST_PATH = re.compile(r"(?<![\w/.\-])tests/[\w./*\-]*")
# A module name; one followed by "(" is a call on a variable of that name.
_TEST_MODULE = re.compile(r"(?<![\w.])tests(?:\.\w+)+(?![\w(])")


def _stale_test_names(text: str) -> list[str]:
    """The paths into tests/ (globs too) and the ``tests.`` module names in ``text`` that
    name nothing in this checkout."""
    stale = []
    for path in _TEST_PATH.findall(text):
        path = path.rstrip(".,;:")
        if not _exists(path):
            stale.append(path)
    for name in _TEST_MODULE.findall(text):
        parts = name.split(".")
        # The longest prefix that is a module or package: a name may end in an attribute.
        if not any((ROOT.joinpath(*parts[:n]).with_suffix(".py")).is_file()
                   or (ROOT.joinpath(*parts[:n]) / "__init__.py").is_file()
                   for n in range(2, len(parts) + 1)):
            stale.append(name)
    return stale


def _exists(path: str) -> bool:
    return any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()


def test_named_test_paths_exist():
    """Every "Tested (tests/...)" line, script and docstring names test files that exist:
    a move of tests/ that left a name behind fails here."""
    named = {f for pattern in _NAMING for f in ROOT.glob(pattern) if f.is_file()}
    named.discard(Path(__file__).resolve())  # its own examples below name nothing
    stale, seen = {}, 0
    for f in sorted(named):
        text = f.read_text()
        seen += len(_TEST_PATH.findall(text))
        if found := _stale_test_names(text):
            stale[str(f.relative_to(ROOT))] = found
    assert seen > 100, f"only {seen} test paths found: the pattern broke"
    assert not stale, f"names of tests that do not exist (moved? renamed?): {stale}"
    assert _stale_test_names("see tests/test_ddp.py and tests.cases_ddp, tests.get(x)") == [
        "tests/test_ddp.py", "tests.cases_ddp"]
