"""The report's committed figures (docs/report/*.png): present, at most 1600 px wide, text
readable at 800 px ([Note: readable figures] in fsdp_retain/report/_figures.py), and
regenerated from the committed report.json files by the command docs/report/README.md
names. Fast, no ranks: matplotlib only."""

from __future__ import annotations

import glob
import importlib.util
import json
import re
import shlex
import struct
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from fsdp_retain.report._figures import (  # noqa: E402
    MAX_WIDTH_PX,
    MIN_TEXT_PX,
    error_text,
    model_name,
    report_figure,
    smallest_text_px,
    tradeoff_figure,
)
from fsdp_retain.report._fit import parse_bytes  # noqa: E402
from fsdp_retain.report._fit_figure import fit_figure  # noqa: E402
from fsdp_retain.report._modes import OPTION_TEXTS, option_text  # noqa: E402
from fsdp_retain.report._rows import Report  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs/report"
FIGURES = ("report.png", "tradeoff.png", "will_it_fit.png")
GPU_MEMORY = [parse_bytes("80GiB"), parse_bytes("141GiB")]


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", path
    return struct.unpack(">II", head[16:24])


def figures_command() -> list[str]:
    """The figures command of docs/report/README.md, its globs expanded (as a shell
    would, from the repository root)."""
    text = (DOCS / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", text, re.S)
    (command,) = [b for b in blocks if "-m fsdp_retain.report.figures" in b]
    words = shlex.split(command.replace("\\\n", " "))
    assert words[:3] == ["python", "-m", "fsdp_retain.report.figures"], words
    expanded: list[str] = []
    for word in words[3:]:
        expanded += sorted(glob.glob(word, root_dir=ROOT)) if "*" in word else [word]
    return expanded


def _reports() -> tuple[Report, list[Report]]:
    args = figures_command()
    report = args[args.index("--report") + 1]
    start = args.index("--fit") + 1
    fits = [a for a in args[start:start + 100] if a.endswith(".json")]
    read = lambda p: Report.from_json(json.loads((ROOT / p).read_text()))  # noqa: E731
    return read(report), [read(p) for p in fits]


@pytest.mark.parametrize("name", FIGURES)
def test_committed_figures_exist_and_fit_the_width(name):
    width, height = png_size(DOCS / name)
    assert 400 <= width <= MAX_WIDTH_PX and height > 0, (name, width, height)


def test_readme_shows_the_figures():
    assert "docs/report/tradeoff.png" in (ROOT / "README.md").read_text()
    text = (DOCS / "README.md").read_text()
    for name in FIGURES:
        assert f"]({name})" in text, name


def test_docs_command_regenerates_the_figures(tmp_path):
    """The README's command, on the committed report.json files, writes every figure at
    its committed size and the table the README shows beside will_it_fit.png."""
    args = figures_command()
    args[args.index("--out") + 1] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "fsdp_retain.report.figures", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in FIGURES:
        assert png_size(tmp_path / name) == png_size(DOCS / name), name
    table = (tmp_path / "will_it_fit.md").read_text()
    assert table == (DOCS / "will_it_fit.md").read_text()
    assert table in (DOCS / "README.md").read_text()


def test_smallest_text_readable_at_800_px():
    """Every text of every figure is at least 11 px high shown 800 px wide: font size
    (pt) * dpi / 72 * 800 / width (px)."""
    report, fits = _reports()
    figures = {"report": report_figure(report), "tradeoff": tradeoff_figure(report),
               "will_it_fit": fit_figure(fits, GPU_MEMORY)}
    for name, fig in figures.items():
        assert fig is not None, name
        assert fig.get_figwidth() * fig.dpi <= MAX_WIDTH_PX, name
        assert smallest_text_px(fig) >= MIN_TEXT_PX, (name, smallest_text_px(fig))


def test_tradeoff_draws_the_budget_curve_and_the_recipe():
    """Per backend a panel; the budgets joined from False to True; the FSDP2 recipe rows
    placed on the FSDP2 panel."""
    report, _ = _reports()
    fig = tradeoff_figure(report)
    backends = list(dict.fromkeys(r.backend for r in report.rows))
    assert [ax.get_title().split(":")[0] for ax in fig.axes] == backends
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert any(t.startswith("keep_unsharded=False -> budgets -> True") for t in legend)
    assert option_text("two_forward") in legend
    assert option_text("fsdp2_recipe:every") in legend
    labels = {t.get_text() for ax in fig.axes for t in ax.texts}
    assert {"False", "True"} <= {part for text in labels for part in text.split(", ")}


def test_simulated_report_has_no_tradeoff():
    _, fits = _reports()
    assert tradeoff_figure(fits[0]) is None


def test_figures_command_names_the_fix(tmp_path, capsys):
    from fsdp_retain.report.figures import main

    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path)])
    assert exc.value.code == 2 and "pass --report and/or --fit" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--report", str(tmp_path / "missing.json"), "--out", str(tmp_path)])
    assert "run python -m fsdp_retain.report first" in capsys.readouterr().err


def _readme_cost_rows() -> list[tuple[str, str]]:
    """(row text without backticks, mode) of the README's cost table, from
    scripts/docs_figures.py, which writes it."""
    spec = importlib.util.spec_from_file_location("docs_figures", ROOT / "scripts/docs_figures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    readme = (ROOT / "README.md").read_text()
    rows = module.COST_TABLES["readme"][2]
    for text, _ in rows:
        assert f"| {text} |" in readme, text
    return [(text.replace("`", ""), label) for text, label in rows]


def test_option_texts_are_the_readme_cost_table_rows():
    """The figures' mode names (``OPTION_TEXTS``) are the README cost table's rows."""
    rows = _readme_cost_rows()
    assert rows and {label: OPTION_TEXTS[label] for _, label in rows} == {
        label: text for text, label in rows}


def test_tradeoff_legend_uses_the_option_names():
    """FSDP2 and FSDP1 report: every legend entry of a mode off the curve is its option
    name as the README's cost table writes it, never a mode label (``check:every``)."""
    report, _ = _reports()
    fig = tradeoff_figure(report)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert not [t for t in legend if re.fullmatch(r"\w+:(every|last)", t)], legend
    curves = [t for t in legend if t.startswith("keep_unsharded=False -> budgets -> True")]
    labels = {r.label for r in report.rows if r.ok and r.time_ratio is not None}
    assert set(legend) - set(curves) <= {option_text(label) for label in labels}, legend
    readme = dict(_readme_cost_rows())
    for label in ("two_forward", "keep:last", "probe:every", "check:every",
                  "fsdp2_recipe:every"):
        assert [t for t in readme if readme[t] == label][0] in legend, label


def test_tradeoff_labels_overlapping_points():
    """check:every and fsdp2_recipe:every land on one place of the FSDP2 panel: both are
    named beside it, and the filled check marker is drawn over the hollow recipe one."""
    report, _ = _reports()
    row = {r.label: r for r in report.rows if r.backend == "fsdp2"}
    check, recipe = row["check:every"], row["fsdp2_recipe:every"]
    assert abs((check.memory_overhead_bytes or 0) - (recipe.memory_overhead_bytes or 0)) < 2**20
    fig = tradeoff_figure(report)
    fsdp2 = fig.axes[0]
    named = {t.get_text().replace("\n", " ") for t in fsdp2.texts}
    assert {option_text("check:every"), option_text("fsdp2_recipe:every")} <= named, named
    near = [c for c in fsdp2.collections if c.get_offsets().shape[0] == 1
            and abs(c.get_offsets()[0][1] - check.time_ratio) < 0.02
            and abs(c.get_offsets()[0][0] - (check.memory_overhead_bytes or 0) / 2**20) < 1]
    filled = [c for c in near if c.get_facecolor().size and c.get_facecolor()[0][3] > 0]
    hollow = [c for c in near if c not in filled]
    assert len(filled) == len(hollow) == 1, near
    assert filled[0].get_zorder() > hollow[0].get_zorder()


def test_report_figure_fsdp2_only_rows_not_applicable_on_fsdp1():
    """FSDP1 rows of the FSDP2-only modes say "n/a (FSDP2 only)"; "expected crash" is
    only plain FSDP1's two-pass ``naive``."""
    report, _ = _reports()
    fsdp1 = {r.label: r for r in report.rows if r.backend == "fsdp1"}
    assert error_text(fsdp1["fsdp2_recipe:every"]) == "n/a (FSDP2 only)"
    assert error_text(fsdp1["naive"]) == "expected crash"
    failed = [r for r in report.rows if not r.ok]
    fig = report_figure(report)
    texts = [t.get_text().strip() for ax in fig.axes for t in ax.texts]
    panels = 2  # memory and time
    crashes = [r for r in failed if r.mode == "naive"]
    assert texts.count("expected crash") == panels * len(crashes) == panels
    assert texts.count("n/a (FSDP2 only)") == panels * (len(failed) - len(crashes)) > 0


def test_fit_figure_names_models_readably():
    """The will_it_fit.png models are readable names (no file stem like llama3_70b)."""
    _, fits = _reports()
    fig = fit_figure(fits, GPU_MEMORY)
    ticks = {t.get_text() for ax in fig.axes for t in ax.get_xticklabels()}
    assert "Llama-3-70B (70.6B)" in ticks and "Qwen2.5-7B (7.6B)" in ticks, ticks
    assert not [t for t in ticks if "_" in t], ticks
    shape = dict(fits[0].config, model="MistralForCausalLM", model_config="x/my_model.json",
                 layers=40, hidden=5120, vocab=131072)
    assert "_" not in model_name(shape) and "Mistral" in model_name(shape)
