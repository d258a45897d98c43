"""The README and docs/ stay navigable: relative links and anchors resolve, and the
README's test command is the one CI (``.ci/run``) runs, verbatim."""

from __future__ import annotations

import re

import pytest

from tests.harness import ROOT

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
