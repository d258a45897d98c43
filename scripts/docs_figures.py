#!/usr/bin/env python
"""The figures the docs quote, written from the committed files they come from.

README.md and the pages under docs/ quote figures from committed sources: the
report.json files under docs/report/, docs/compat.json, docs/cpu_timings.json (CPU times
with their calibration), and the H200 phase profile in fsdp_retain/report/_results.py.
Each such figure sits inside a marker, and this script writes it from its source (the
markers are HTML comments: GitHub shows the figure only).

One figure::

    <!-- fig: docs/report/report.json rows[backend=fsdp2,label=keep:every]/time_ratio fmt={:.2f}x -->0.77x<!-- /fig -->

- SOURCE: a path from the repository root, a ``.json`` file or a ``.py`` file whose
  module-level literals (``H200_PHASES = {...}``) are read without importing it;
- PATH: keys joined by ``/`` (a list takes an index); ``rows[backend=fsdp2,label=keep:every]``
  is the one element of the list ``rows`` that has those values;
- options: ``scale=MiB`` (or ``GiB``; ``M``: millions; ``ms``: seconds shown in
  milliseconds), then ``fmt=``, a ``str.format`` template that takes the rest of the
  marker (default ``{}``): ``fmt={:+.1f} MiB``, ``fmt={:.0%}``.

``derived NAME [ARGS]`` in place of SOURCE PATH takes a figure computed from the sources
by a function of DERIVED below (a share, a maximum), for figures no one value holds;
``derived column SOURCE BACKEND FIELD LABEL...`` is one field of several rows, written
``14, 10, 6`` (each formatted with ``fmt``).

A table or list made from the sources::

    <!-- begin: NAME [ARGS] -->
    ...
    <!-- end: NAME -->

NAME is one of TABLES below; ARGS (source files, modes) go to its function.

Usage::

    python scripts/docs_figures.py                   # rewrite every marked figure and block
    python scripts/docs_figures.py --check           # change nothing; list what differs, exit 1
    python scripts/docs_figures.py --get docs/report/report.json 'rows[backend=fsdp1,label=probe:every]'

Run it after regenerating a source, and commit the pages with the source.
tests/docs/test_docs_figures.py fails when a marked figure or block differs from what its
source gives now, and when a page states a figure or an absolute time without a
committed source (``docs_scan.py`` beside this script: the scan, and ALLOWED with each
exception's reason; ``--check`` lists both).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import functools
import itertools
import json
import re
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from docs_scan import BLOCK, FIG, TIME_LIKE, pages, unmarked, unused_allowances  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MiB, GiB = 2**20, 2**30
SCALES = {"MiB": 1 / MiB, "GiB": 1 / GiB, "M": 1e-6, "ms": 1e3}

class FigureError(ValueError):
    """A marker whose source, path or table does not give a figure."""


# Sources #

@functools.cache
def source(path: str) -> Any:
    """A committed source: a JSON file, or the module-level literals of a Python file."""
    file = ROOT / path
    if not file.is_file():
        raise FigureError(f"{path}: no such file")
    if file.suffix == ".json":
        return json.loads(file.read_text())
    if file.suffix == ".py":
        found = {}
        for node in ast.parse(file.read_text()).body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                    and isinstance(node.targets[0], ast.Name):
                try:
                    found[node.targets[0].id] = ast.literal_eval(node.value)
                except ValueError:
                    continue
        return found
    raise FigureError(f"{path}: a source is a .json or a .py file")


def lookup(data: Any, path: str) -> Any:
    """``rows[backend=fsdp2,label=keep:every]/time_ratio`` in ``data``."""
    node = data
    for step in path.split("/"):
        match = re.fullmatch(r"([^\[\]]*)(?:\[([^\]]*)\])?", step)
        if match is None:
            raise FigureError(f"{path}: cannot read the step {step!r}")
        key, select = match.groups()
        try:
            if key:
                node = node[int(key)] if isinstance(node, list) else node[key]
        except (KeyError, IndexError, ValueError, TypeError):
            raise FigureError(f"{path}: no {key!r} here") from None
        if select is not None:
            want = dict(part.split("=", 1) for part in select.split(","))
            found = [e for e in node if isinstance(e, dict)
                     and all(str(e.get(k)) == v for k, v in want.items())]
            if len(found) != 1:
                raise FigureError(f"{path}: {len(found)} elements match [{select}], not one")
            node = found[0]
    return node


def _row(path: str, backend: str, label: str) -> dict | None:
    found = [r for r in source(path)["rows"] if r["backend"] == backend and r["label"] == label]
    return found[0] if found else None


# Figures no one value holds #

def _h200_second_forward_share() -> float:
    """The second forward's share of one RL actor step on one H200 (the phase profile
    the report projects the probe pass onto)."""
    phases = source("fsdp_retain/report/_results.py")["H200_PHASES"]
    return phases["forward2"] / sum(phases.values())


def _max_overhead(path: str, label: str) -> float:
    """The largest peak added to ``two_forward``'s over the backends of one mode (bytes)."""
    return max(r["memory_overhead_bytes"] for r in source(path)["rows"]
               if r["label"] == label and r["ok"])


def _column(path: str, backend: str, field: str, *labels: str) -> list:
    """One field of several rows of a backend, in the order given (a list of figures)."""
    return [lookup(source(path), f"rows[backend={backend},label={label}]/{field}")
            for label in labels]


def _kept_units(path: str, label: str) -> int:
    """How many units a budget mode (``keep50:every``) of a run keeps: the library's
    own choice (``kept_count``) at that share of the unsharded bytes."""
    from fsdp_retain.report._fit import _fraction, kept_count

    cfg = source(path)["config"]
    fraction = _fraction(label)
    if fraction is None:
        raise FigureError(f"kept_units {path} {label}: not a budget mode")
    return kept_count(cfg["unit_bytes"], int(fraction * cfg["unsharded_param_bytes"]))


def _calibration(path: str, *wheres: str) -> str:
    """The calibration recorded at each of ``wheres`` in a source (dicts of ``python_s``
    and ``torch_s``: ``python -m fsdp_retain.report calibrate``), to name beside the CPU
    times measured at it: one value per workload, or its range over them."""
    values = [lookup(source(path), where) for where in wheres]
    if not values or not all(isinstance(v, dict) and {"python_s", "torch_s"} <= v.keys()
                             for v in values):
        raise FigureError(f"calibration {path} {' '.join(wheres)}: name one or more dicts "
                          "of python_s and torch_s (quickstart/calibration)")
    parts = []
    for name in ("python", "torch"):
        low, high = (f"{f(v[f'{name}_s'] for v in values):.3f}" for f in (min, max))
        parts.append(f"{name} {low} s" if low == high else f"{name} {low} to {high} s")
    return ", ".join(parts)


def _root_share(path: str) -> float:
    """The root unit's (embedding and output layer) share of the unsharded bytes."""
    cfg = source(path)["config"]
    return cfg["unit_bytes"][0] / cfg["unsharded_param_bytes"]


DERIVED: dict[str, Callable[..., Any]] = {
    "calibration": _calibration,
    "column": _column,
    "h200_second_forward_share": _h200_second_forward_share,
    "h200_without_second_forward": lambda: 1 - _h200_second_forward_share(),
    "kept_units": _kept_units,
    "max_overhead": _max_overhead,
    "root_share": _root_share,
}


def figure(spec: str) -> str:
    """The text a ``<!-- fig: SPEC -->`` marker holds."""
    head, _, template = spec.partition(" fmt=")
    words = head.split()
    options = dict(w.split("=", 1) for w in words if w.startswith("scale="))
    words = [w for w in words if not w.startswith("scale=")]
    if words[:1] == ["derived"] and len(words) >= 2 and words[1] in DERIVED:
        value = DERIVED[words[1]](*words[2:])
    elif len(words) == 2 and words[0] != "derived":
        value = lookup(source(words[0]), words[1])
    else:
        raise FigureError(f"{spec!r}: write SOURCE PATH or derived NAME "
                          f"(one of {', '.join(DERIVED)}), then scale=/fmt=")
    scale = options.get("scale")
    if scale is not None and scale not in SCALES:
        raise FigureError(f"{spec!r}: scale is one of {', '.join(SCALES)}")
    values = value if isinstance(value, list) else [value]
    if scale is not None:
        values = [v * SCALES[scale] for v in values]
    try:
        return ", ".join((template or "{}").format(v) for v in values)
    except (ValueError, TypeError) as exc:
        raise FigureError(f"{spec!r}: fmt={template} on {value!r}: {exc}") from None


# Tables #

# Cost tables: the backends in the header's order, the header, (what the row says, the
# report's mode) per row, and whether the collectives cell shows their bytes.
COST_TABLES: dict[str, tuple[list[str], str, list[tuple[str, str]], bool]] = {
    "readme": (
        ["fsdp2", "fsdp1"],
        "| per step | step time vs two forwards (FSDP2 / FSDP1) | all-gathers / reduce-scatters "
        "| peak memory vs two forwards |",
        [("two forwards (baseline)", "two_forward"),
         ("defaults", "keep:every"),
         ('`sync_grads="last"`', "keep:last"),
         ("backward 1 a probe pass", "probe:every"),
         ("`keep_unsharded=<50% of the bytes>`", "keep50:every"),
         ("`keep_unsharded=False`", "regather:every"),
         ("`check_saved_tensors=True`", "check:every"),
         ("FSDP2 alone, its recipe (pytorch #172543; no library)", "fsdp2_recipe:every")],
        False),
    "deepspeed": (
        ["deepspeed"],
        "| ZeRO-3 | step time vs two-forward | all-gathers / reduce-scatters per step "
        "| peak memory vs two-forward |",
        [("two-forward", "two_forward"),
         ('`keep_unsharded=True`, `"every"`', "keep:every"),
         ('`keep_unsharded=True`, `"last"`', "keep:last"),
         ('backward 1 a probe pass (`"every"`)', "probe:every"),
         ('`check_saved_tensors=True` (`"every"`)', "check:every"),
         ("`keep_unsharded=False`", "regather:every"),
         ("plain `retain_graph=True`", "naive")],
        True),
}


# The crashes a failed row names (the start of plain ZeRO-3's and FSDP1's messages).
CRASH = re.compile(r"size of tensor a \(0\)|setStorage")


def cost_table(path: str, which: str) -> str:
    """Step time, collectives and peak memory against two forwards, a row per mode of
    ``COST_TABLES[which]``, the backends side by side in one cell (``-`` where a mode did
    not run on one; the value once where they agree); a mode no backend ran crashed."""
    backends, head, rows, with_bytes = COST_TABLES[which]
    if source(path)["config"]["backends"] != backends:
        raise FigureError(f"cost-table {path} {which}: the header names the backends "
                          f"{backends}, the run has {source(path)['config']['backends']}")
    lines = [head, "|---|--:|--:|--:|"]
    for text, label in rows:
        found = [_row(path, b, label) for b in backends]
        ran = [r for r in found if r is not None and r["ok"]]
        if not ran:
            errors = [r["error"] for r in found if r is not None]
            crash = CRASH.search(" ".join(errors))
            why = f" (`{crash.group(0)}`)" if crash else ""
            lines.append(f"| {text} | crashes{why} | | |")
            continue
        times = [f"{r['time_ratio']:.2f}x" if r is not None and r["ok"] else "-" for r in found]
        comms = []
        for r in ran:
            cell = f"{r['all_gathers_per_step']} / {r['reduce_scatters_per_step']}"
            if with_bytes:
                cell += (f" ({r['all_gather_bytes_per_step'] / MiB:.1f} / "
                         f"{r['reduce_scatter_bytes_per_step'] / MiB:.1f} MiB)")
            comms.append(cell)
        if label == "two_forward":
            memory = [f"{r['peak_bytes'] / MiB:.1f}" for r in ran]
        else:
            memory = [f"{r['memory_overhead_bytes'] / MiB:+.1f}" for r in ran]
        comm = comms[0] if len(set(comms)) == 1 else "; ".join(
            f"{c} ({r['backend']})" for c, r in zip(comms, ran))
        mem = memory[0] if len(set(memory)) == 1 else " / ".join(memory)
        lines.append(f"| {text} | {' / '.join(times)} | {comm} | {mem} MiB |")
    return "\n".join(lines) + "\n"


def fit_peaks(path: str) -> str:
    """The table a ``--simulate-world-size`` run prints last (``render_fit_table``): peak
    per rank per mode and backend, against ``two_forward`` in brackets."""
    from fsdp_retain.report._output import render_fit_table
    from fsdp_retain.report._rows import Report

    return render_fit_table(Report.from_json(source(path)))


def model_peaks(*paths: str) -> str:
    """A row per run (model): its size, two-forward's peak per rank and the block's modes
    against it (verl.md's memory table)."""
    modes = [("two-forward", "two_forward"), ('`keep_unsharded=True`, `"every"`', "keep:every"),
             ('`keep_unsharded=True`, `"last"`', "keep:last"),
             ('`keep_unsharded=False`, `"every"`', "regather:every")]
    lines = ["| peak per rank (GiB) | " + " | ".join(m for m, _ in modes) + " |",
             "|---|" + "--:|" * len(modes)]
    for path in paths:
        cfg = source(path)["config"]
        base = _row(path, cfg["backends"][0], "two_forward")
        assert base is not None
        cells = [f"Qwen2.5-{cfg['size'].upper()} (unsharded {cfg['dtype']} params "
                 f"{cfg['unsharded_param_bytes'] / GiB:.1f} GiB; activations "
                 f"{base['breakdown']['activations'] / GiB:.1f})"]
        for _, label in modes:
            found = [r for b in cfg["backends"] if (r := _row(path, b, label)) and r["ok"]]
            peaks = [f"{r['peak_bytes'] / GiB:.1f}" for r in found]
            extra = [f"{r['memory_overhead_bytes'] / GiB:+.1f}" for r in found]
            if len(set(peaks)) == 1:
                cell = peaks[0] if label == "two_forward" else f"{peaks[0]} ({extra[0]})"
            else:
                names = [r["backend"].upper() for r in found]
                cell = ", ".join(f"{p} {n}" for p, n in zip(peaks, names))
                cell += "" if label == "two_forward" else f" ({', '.join(extra)})"
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _budget_fit_reports() -> list[str]:
    paths = [str(p.relative_to(ROOT)) for p in (ROOT / "docs/report/budget_fit").glob("*/report.json")]
    return sorted(paths, key=lambda p: (source(p)["config"]["param_count"],
                                        source(p)["config"]["activation_checkpointing"]))


def _budget_fit_rows() -> list[tuple[dict, int, list[str]]]:
    """(config, GPU bytes, cells of a row of ``render_budget_fit``: backend, sync_grads,
    mode, budget, units kept, peak, all-gathers) for every run and GPU memory."""
    from fsdp_retain.report._fit import parse_bytes, render_budget_fit

    found = []
    for path in _budget_fit_reports():
        report = source(path)
        cfg = report["config"]
        words = shlex.split(cfg["command"])
        sizes = [parse_bytes(w) for w in itertools.takewhile(
            lambda w: not w.startswith("--"), words[words.index("--gpu-memory") + 1:])]
        for size in sorted(sizes):
            for line in render_budget_fit(report, size).splitlines():
                cells = [c.strip() for c in line.strip("|").split("|")]
                if cells[0] in cfg["backends"]:
                    found.append((cfg, size, cells))
    return found


def budget_fit(*backends: str) -> str:
    """The largest ``keep_unsharded`` that fits, per model, activation checkpointing, GPU
    memory, backend and sync_grads, from docs/report/budget_fit/*/report.json (the rows
    each run's budget_fit.md has: ``render_budget_fit``); ARGS: the backends to show
    (then without a backend column), or none for all."""
    if backends:
        lines = ["| model | AC | GPU (GiB) | sync_grads | largest mode that fits | budget (GiB) "
                 "| units kept | peak (GiB) | all-gathers / step |",
                 "|---|---|--:|---|---|--:|--:|--:|--:|"]
    else:
        lines = ["| model | activation checkpointing | GPU memory (GiB) | backend | sync_grads "
                 "| largest mode that fits | budget (GiB) | units kept | peak (GiB) "
                 "| all-gathers per step |",
                 "|---|---|--:|---|---|---|--:|--:|--:|--:|"]
    for cfg, size, cells in _budget_fit_rows():
        if backends and cells[0] not in backends:
            continue
        ac = "yes" if cfg["activation_checkpointing"] else "no"
        row = [cfg["size"].upper(), ac, f"{size / GiB:.0f}", *(cells[1:] if backends else cells)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def budget_fit_differences() -> str:
    """The cases of ``budget_fit`` where the backends pick different modes."""
    picks: dict[tuple, list[str]] = {}
    for cfg, size, cells in _budget_fit_rows():
        ac = "with AC" if cfg["activation_checkpointing"] else "without AC"
        key = (cfg["size"].upper(), ac, f"{size / GiB:.0f} GiB", f'`sync_grads="{cells[1]}"`')
        peak = f" ({cells[5]} GiB)" if cells[5] else ""
        picks.setdefault(key, []).append(f"{cells[0].upper()} {cells[2]}{peak}")
    lines = [f"- {' '.join(key[:2])}, {key[2]}, {key[3]}: " + ", ".join(found)
             for key, found in picks.items()
             if len({p.split(" ", 1)[1].split(" (")[0] for p in found}) > 1]
    return "\n".join(lines or ["- none"]) + "\n"


def will_it_fit() -> str:
    """will_it_fit.md's table: the simulated runs under docs/report/fit/ (``fit_table``)."""
    from fsdp_retain.report._fit_figure import fit_table
    from fsdp_retain.report._fit import parse_bytes
    from fsdp_retain.report._rows import Report

    reports = [Report.from_json(source(str(p.relative_to(ROOT))))
               for p in sorted((ROOT / "docs/report/fit").glob("*/report.json"))]
    return fit_table(reports, [parse_bytes("80GiB"), parse_bytes("141GiB")])


def compat_rows() -> str:
    """docs/compat.json's full-suite rows grouped by the commit they ran on."""
    entries = source("docs/compat.json")
    by_commit: dict[tuple[str, int, str], list[str]] = {}
    for version in sorted(entries, key=lambda v: tuple(int(p) for p in re.findall(r"\d+", v))):
        e = entries[version]
        tests = sum(e["counts"].values())
        suite = "subset" if e["subset"] else "full suite"
        by_commit.setdefault((e.get("commit", "?"), tests, suite), []).append(version)
    lines = []
    for (commit, tests, suite), versions in by_commit.items():
        dates = sorted({entries[v]["date"] for v in versions})
        lines.append(f"- {', '.join(versions)}: {suite}, {tests} tests, on {commit}, "
                     f"run {', '.join(dates)}")
    return "\n".join(lines) + "\n"


def command_output(path: str) -> str:
    """A committed command's output (``fit``'s answer, a ``farm-bench`` timing), the command
    in its first line after ``$``, as a code block; ARGS: the file. Output with an absolute
    time must name the calibration it ran at (a ``calibration:`` line, as ``fit``'s answers
    and ``scripts/cpu_timing.py --output`` write)."""
    text = (ROOT / path).read_text()
    if TIME_LIKE.search(text) and "calibration: python " not in text:
        raise FigureError(f"<!-- begin: output {path} -->: its times name no calibration; add "
                          "the line `python -m fsdp_retain.report calibrate` prints on the "
                          "machine that ran it (scripts/cpu_timing.py --output does)")
    return "```\n" + text.rstrip("\n") + "\n```\n"


TABLES: dict[str, Callable[..., str]] = {
    "output": command_output,
    "cost-table": cost_table,
    "fit-peaks": fit_peaks,
    "model-peaks": model_peaks,
    "budget-fit": budget_fit,
    "budget-fit-differences": budget_fit_differences,
    "will-it-fit": will_it_fit,
    "compat-rows": compat_rows,
}


def table(name: str, args: str) -> str:
    if name not in TABLES:
        raise FigureError(f"<!-- begin: {name} -->: no such table (one of {', '.join(TABLES)})")
    return TABLES[name](*args.split())


# Checking and rewriting #

def rewrite(text: str) -> str:
    """``text`` with every marked figure and block written from its source."""
    def block(m: re.Match) -> str:
        whole, start = m.group(0), m.start()
        body = table(m.group("name"), m.group("args"))
        return whole[:m.start("body") - start] + body + whole[m.end("body") - start:]

    text = BLOCK.sub(block, text)
    return FIG.sub(lambda m: m.group(0).replace(
        f"-->{m.group('text')}<!--", f"-->{figure(m.group('spec'))}<!--", 1), text)


def stale(text: str) -> list[str]:
    """Each marked figure or block whose text is not what its source gives now."""
    found = []
    for m in FIG.finditer(text):
        want = figure(m.group("spec"))
        if m.group("text") != want:
            line = text.count("\n", 0, m.start()) + 1
            found.append(f"line {line}: {m.group('text')!r}, the source gives {want!r} "
                         f"({m.group('spec')})")
    for m in BLOCK.finditer(text):
        want = table(m.group("name"), m.group("args"))
        if m.group("body") != want:
            line = text.count("\n", 0, m.start()) + 1
            diff = difflib.unified_diff(m.group("body").splitlines(), want.splitlines(),
                                        "on the page", "from the source", lineterm="")
            found.append(f"line {line}: the {m.group('name')} block differs from its source:\n"
                         + "\n".join(diff))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; list stale and unmarked figures, exit 1 if any")
    parser.add_argument("--get", nargs=2, metavar=("SOURCE", "PATH"),
                        help="print a value of a source (to write a marker)")
    args = parser.parse_args(argv)
    if args.get:
        print(json.dumps(lookup(source(args.get[0]), args.get[1]), indent=1))
        return 0
    problems = []
    for path in pages():
        name = str(path.relative_to(ROOT))
        text = path.read_text()
        if args.check:
            problems += [f"{name}: {p}" for p in stale(text)]
        else:
            new = rewrite(text)
            if new != text:
                path.write_text(new)
                print(f"rewrote {name}")
        problems += [f"{name}: unmarked figure {p}" for p in unmarked(name, text)]
    problems += [f"ALLOWED entry matches nothing: {p}" for p in unused_allowances()]
    if problems:
        print("\n".join(problems))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
