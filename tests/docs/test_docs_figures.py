"""Figures the docs quote come from the committed files they are quoted from, through
scripts/docs_figures.py's markers; the guide's code layout names every module of the
package; a ``[Note: ...]`` a page places in a file is in that file. No ranks: seconds."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("docs_figures", ROOT / "scripts" / "docs_figures.py")
assert _spec is not None and _spec.loader is not None
docs_figures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(docs_figures)

PAGES = [str(p.relative_to(ROOT)) for p in docs_figures.pages()]
FIX = "run `python scripts/docs_figures.py` and commit the pages with their source"


@pytest.mark.parametrize("page", PAGES)
def test_marked_figures_match_their_sources(page):
    """Every ``<!-- fig: ... -->`` figure and ``<!-- begin: NAME -->`` block holds what
    its source gives now."""
    stale = docs_figures.stale((ROOT / page).read_text())
    assert not stale, f"{page}: {FIX}:\n" + "\n".join(stale)


@pytest.mark.parametrize("page", PAGES)
def test_no_figure_outside_a_marker(page):
    """A ratio, memory size, percentage, millisecond or parameter count outside a marker
    fails, unless ALLOWED (scripts/docs_scan.py) names it with the reason it has no source; so does
    an absolute time (also in code), unless ALLOWED says why it needs no calibration or
    where its calibration is named."""
    found = docs_figures.unmarked(page, (ROOT / page).read_text())
    assert not found, (
        f"{page}: figures outside a marker: write each as <!-- fig: SOURCE PATH fmt=... -->"
        "...<!-- /fig --> (scripts/docs_figures.py; a CPU time from a source that records its "
        "calibration, scripts/cpu_timing.py, named beside it with `derived calibration`), or, "
        "with no committed source, add it to ALLOWED in scripts/docs_scan.py with the reason:\n" + "\n".join(found))


def test_every_allowance_still_matches():
    """An ALLOWED entry whose text left the page goes too (the list does not rot)."""
    assert not docs_figures.unused_allowances()


def test_the_checks_fail_on_a_changed_or_unmarked_figure():
    """The checks above can fail: a marked figure, a generated table and an unmarked ratio
    changed in the README's text are each caught, and rewriting puts the figures back."""
    text = (ROOT / "README.md").read_text()
    marked = next(docs_figures.FIG.finditer(text))
    changed = text.replace(marked.group(0), marked.group(0).replace(
        f"-->{marked.group('text')}<!--", "-->9.99x<!--"), 1)
    assert len(docs_figures.stale(changed)) == 1
    assert docs_figures.rewrite(changed) == text
    row = "| defaults | 0.77x / 0.79x |"
    assert row in text, "the README's cost table moved: pick another row here"
    in_table = text.replace(row, "| defaults | 0.70x / 0.79x |")
    assert len(docs_figures.stale(in_table)) == 1
    assert docs_figures.rewrite(in_table) == text
    assert not docs_figures.unmarked("README.md", text)
    loose = text.replace("## What it costs\n", "## What it costs\n\nThe step took 0.77x.\n")
    (problem,) = docs_figures.unmarked("README.md", loose)
    assert "'0.77x'" in problem
    with pytest.raises(docs_figures.FigureError, match="no 'step_ms' here"):
        docs_figures.figure("docs/report/report.json rows[backend=fsdp2,label=naive]/step_ms")


def test_times_name_their_calibration():
    """An absolute time outside a marker fails, in prose and in pasted output; one inside
    a marker, or in an `output` block (its file names its calibration), does not."""
    text = (ROOT / "docs/gpu_validation.md").read_text()
    assert not docs_figures.unmarked("docs/gpu_validation.md", text)
    for added, found in [("The dry run took 47 s.", "'47 s'"),
                         ("It took 4.1 minutes wall.", "'4.1 minutes'"),
                         ("```\nstep took 1:47\n```", "'1:47'"),
                         ("Each mode `(13s)`.", "'13s'")]:
        (problem,) = docs_figures.unmarked("docs/gpu_validation.md", text + f"\n{added}\n")
        assert found in problem and "a time" in problem, problem
    for fine in ["3 steps, 2 sequences, rows 1 to 2, 8 ranks.", "torch 2.13.0 on 2026-11-27."]:
        assert not docs_figures.unmarked("docs/gpu_validation.md", text + f"\n{fine}\n")
    spec = "derived calibration docs/cpu_timings.json quickstart/calibration"
    marked = f"<!-- fig: {spec} -->{docs_figures.figure(spec)}<!-- /fig -->"
    assert " s, torch " in marked
    assert not docs_figures.unmarked("docs/gpu_validation.md", text + f"\n{marked}\n")


def test_output_blocks_with_times_name_their_calibration(tmp_path, monkeypatch):
    """An `output` block's file that shows a time must carry a calibration line."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/out.txt").write_text("$ run\nmedian step 12.5 ms\n")
    monkeypatch.setattr(docs_figures, "ROOT", tmp_path)
    with pytest.raises(docs_figures.FigureError, match="name no calibration"):
        docs_figures.table("output", "docs/out.txt")
    (tmp_path / "docs/out.txt").write_text(
        "$ run\n# machine: calibration: python 0.090 s, torch 0.015 s\nmedian step 12.5 ms\n")
    assert "12.5 ms" in docs_figures.table("output", "docs/out.txt")


def test_calibration_figure():
    """``derived calibration``: the two values, or their range over several records."""
    ddp = docs_figures.source("docs/report/ddp/calibration.json")
    assert docs_figures.figure("derived calibration docs/report/ddp/calibration.json before") \
        == f"python {ddp['before']['python_s']:.3f} s, torch {ddp['before']['torch_s']:.3f} s"
    both = docs_figures.figure("derived calibration docs/report/ddp/calibration.json before after")
    low, high = sorted(ddp[k]["python_s"] for k in ("before", "after"))
    assert both.startswith(f"python {low:.3f} s" if low == high
                           else f"python {low:.3f} to {high:.3f} s"), both
    with pytest.raises(docs_figures.FigureError, match="dicts of python_s and torch_s"):
        docs_figures.figure("derived calibration docs/report/ddp/calibration.json command")


def test_compat_rows_show_their_calibration():
    """scripts/compat_table.py: a row's test time with the calibration torch_matrix.sh
    measured in its venv, "not recorded" for a row from before; a bad line names the fix."""
    spec = importlib.util.spec_from_file_location("compat_table", ROOT / "scripts" / "compat_table.py")
    assert spec is not None and spec.loader is not None
    compat = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compat)
    line = "calibration: python 0.095 s, torch 0.015 s (one thread; python -m fsdp_retain.report calibrate)"
    row = {"counts": {"passed": 3, "failed": 0, "skipped": 0, "error": 0}, "seconds": 600,
           "subset": False, "date": "2026-11-27", "command": "scripts/torch_matrix.sh 9.9"}
    page = compat.render({"9.9": {**row, "calibration": compat.parse_calibration(line)},
                          "9.8": row})
    assert "| 10.0 min | 0.095 s / 0.015 s |" in page
    assert "| 10.0 min | not recorded |" in page
    assert compat.parse_calibration("") is None
    with pytest.raises(ValueError, match="pass the line"):
        compat.parse_calibration("calibrate: command not found")


def test_figure_paths_select_rows_and_format():
    assert docs_figures.figure("docs/report/report.json "
                               "rows[backend=fsdp2,label=two_forward]/time_ratio fmt={:.2f}x") \
        == "1.00x"
    assert docs_figures.figure("docs/compat.json 2.13.0/counts/failed") == "0"
    phases = docs_figures.source("fsdp_retain/report/_results.py")["H200_PHASES"]
    assert docs_figures.figure("derived h200_second_forward_share fmt={:.4f}") \
        == f"{phases['forward2'] / sum(phases.values()):.4f}"
    with pytest.raises(docs_figures.FigureError, match="2 elements match"):
        docs_figures.lookup(docs_figures.source("docs/report/report.json"),
                            "rows[label=two_forward]")


# The code layout #

def _layout() -> tuple[str, str]:
    """The guide's Code layout section: the library's paragraph(s), the report's."""
    text = (ROOT / "docs/guide.md").read_text()
    section = text.split("\n## Code layout\n", 1)[1].split("\n## ", 1)[0]
    split = section.index("`fsdp_retain/report/`")
    return section[:split], section[split:]


def _listed(part: str) -> set[str]:
    """Module paths relative to their package's parent (``_policy.py``, ``_fsdp1/_block.py``)."""
    return set(re.findall(r"`(?:fsdp_retain/(?:report/)?)?((?:(?:_\w+|integrations)/)?\w+\.py)`",
                          part))


@pytest.mark.parametrize("package", ["fsdp_retain", "fsdp_retain/report"])
def test_code_layout_lists_every_module(package):
    library, report = _layout()
    listed = _listed(report if package.endswith("report") else library)
    top = ROOT / package
    actual = {str(p.relative_to(top)) for p in top.rglob("*.py")
              if package.endswith("report") or "report" not in p.relative_to(top).parts}
    assert not actual - listed, f"docs/guide.md#code-layout misses {package}: " \
        f"{sorted(actual - listed)}"
    assert not listed - actual, f"docs/guide.md#code-layout lists modules {package} " \
        f"does not have: {sorted(listed - actual)}"


def test_code_layout_check_can_fail():
    library, _ = _layout()
    assert "_deepspeed/_grads.py" in _listed(library)
    assert "_deepspeed/_grads.py" not in _listed(
        library.replace("`_deepspeed/_grads.py`", "it"))


# Named notes #

def _defined_in(note: str, path: Path) -> bool:
    """The note's own heading line (``[Note: ...]`` alone on a line) is in ``path``."""
    return any(line.strip().lstrip("#").strip() == f"[Note: {note}]"
               for line in path.read_text().splitlines())


def _cited_in_files(text: str) -> list[tuple[str, str]]:
    """(note, module) for each "[Note: X]` in `fsdp_retain/....py`" of a page, and each
    note inside the brackets that follow a module of the code layout."""
    found = [(m.group(1), m.group(2)) for m in re.finditer(
        r"\[Note: ([^\]]+)\]`?\s+in\s+`(fsdp_retain/[\w/]+\.py)`", text)]
    for m in re.finditer(r"`((?:fsdp_retain/)?(?:report/)?\w+\.py)`\s\(", text):
        depth, end = 0, m.end() - 1
        for end in range(m.end() - 1, len(text)):
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            if depth == 0:
                break
        module = m.group(1)
        found += [(note, module) for note in re.findall(r"\[Note: ([^\]]+)\]", text[m.end():end])]
    return found


@pytest.mark.parametrize("page", PAGES)
def test_notes_are_where_the_page_says(page):
    text = (ROOT / page).read_text()
    library, report = _layout() if page == "docs/guide.md" else ("", "")
    wrong = []
    for note, module in _cited_in_files(text):
        if module.startswith("fsdp_retain/"):
            path = ROOT / module
        else:  # a bare module name of the guide's code layout
            path = ROOT / ("fsdp_retain/report" if f"`{module}`" in report else "fsdp_retain") \
                / module
        if not _defined_in(note, path):
            wrong.append(f"[Note: {note}] is not in {path.relative_to(ROOT)}")
    for note in set(re.findall(r"\[Note: ([^\]]+)\]", text)):
        if not any(_defined_in(note, p) for p in (ROOT / "fsdp_retain").rglob("*.py")):
            wrong.append(f"[Note: {note}] is in no module of fsdp_retain/")
    assert not wrong, f"{page}:\n" + "\n".join(wrong)


def test_note_check_can_fail():
    cited = "See `[Note: inputs that name parameters]` in `fsdp_retain/_lifecycle.py`;"
    ((note, module),) = _cited_in_files(cited)
    assert not _defined_in(note, ROOT / module)
    assert _defined_in(note, ROOT / "fsdp_retain/_inputs.py")
