#!/usr/bin/env python
"""What the docs quote outside scripts/docs_figures.py's markers: the markers' syntax, and
the scan for figures and times a page states without a committed source.

``unmarked`` finds, in a page, figure-like numbers (``0.77x``, ``10.8 MiB``, ``19%``,
``1.2 ms``, ``7.0M``) outside markers, generated blocks, code and ALLOWED text, and
absolute times (``30 s``, ``4.1 minutes``, ``1:47``) outside markers, generated blocks and
ALLOWED text, in code too: a CPU time says little without the speed of the machine that
measured it, so each is a marker on a committed source that records its calibration
(``python -m fsdp_retain.report calibrate``; ``scripts/cpu_timing.py`` writes both), or an
ALLOWED entry whose reason says why it needs none (a limit, a GPU figure) or where its
calibration is named. ``unused_allowances`` lists the ALLOWED entries no page matches.
tests/docs/test_docs_figures.py fails on either; ``python scripts/docs_figures.py --check``
lists them.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FIG = re.compile(r"<!-- fig: (?P<spec>[^\n]*?) -->(?P<text>[^\n]*?)<!-- /fig -->")
BLOCK = re.compile(r"<!-- begin: (?P<name>[\w-]+)(?P<args>[^\n]*?) -->\n(?P<body>.*?)"
                   r"<!-- end: (?P=name) -->", re.S)
# What a figure copied from a report looks like: a ratio, a memory size, a percentage,
# milliseconds, a parameter count in millions.
FIGURE_LIKE = re.compile(
    r"(?<![\w.])(?:[+-]?\d+(?:\.\d+)?(?:\s?/\s?[+-]?\d+(?:\.\d+)?)*\s?(?:KiB|MiB|GiB|TiB|KB|MB|GB)\b"
    r"|\d+\.\d+x\b|\d+(?:\.\d+)?%|\d+(?:\.\d+)?\s?ms\b|\d+\.\d+M\b)")
# An absolute time: seconds to hours, or a wall clock's m:ss.
TIME_LIKE = re.compile(
    r"(?<![\w.])\d+(?:\.\d+)?\s?(?:ms|s|secs?|seconds?|min|mins|minutes?|h|hours?)\b"
    r"|(?<![\w.:])\d{1,2}:[0-5]\d(?![\d:])")


def pages() -> list[Path]:
    """README.md and every page under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


# Pages a tool writes whole from its source: not scanned for unmarked figures.
# (fnmatch: ``*`` crosses folders.)
GENERATED_PAGES = [
    "docs/compat.md",                # scripts/compat_table.py, from docs/compat.json
    "docs/report/*report.md",        # python -m fsdp_retain.report, from its report.json
    "docs/report/*/budget_fit.md",   # the report's --gpu-memory table
    "docs/report/will_it_fit.md",    # python -m fsdp_retain.report.figures
    "docs/report/fit/*/*.txt",       # a command's output: fit's answer, a timing
    "docs/results/*/summary.md",     # scripts/gpu_validate.sh, from the run's own files
    "docs/results/*/report/*/report.md",  # python -m fsdp_retain.report, run by the kit
]

# Figure-like numbers with no committed source: (page, the text around them, why).
# The text matches across line breaks; an entry that no longer matches fails the test.
GPU = "a GPU's memory size (H100 80 GB, H200 141 GB), not a measurement"
NOT_COMMITTED = "a run whose output is not committed (its command is on the page)"
LIMIT = "a limit or a budget, not a measurement"
NOT_RECORDED = "a CPU time from before the calibration existed: the page says it was not recorded"
ALLOWED: list[tuple[str, str, str]] = [
    ("docs/*.md", "80 GiB", GPU), ("docs/*.md", "141 GiB", GPU), ("docs/*.md", "80 GB", GPU),
    ("docs/report/README.md", "estimates 72.6 to 78.4 GiB per mode", NOT_COMMITTED),
    ("docs/report/README.md", "had 0.80x against 0.83x",
     "the previous committed report, in git history only"),
    ("docs/report/README.md", "against 48 and 99 with the root first, for 2.7 GiB more",
     "the budget_fit runs before the budget's new order, in git history only"),
    ("docs/report/README.md", "the defaults 1.1 to 1.2 ms per step over the recipe (3.0 ms",
     "scripts/bench_recipe.py's output, not committed; " + NOT_RECORDED),
    ("docs/report/README.md", "1.5 to 2.2 ms over the recipe with sync off for backward 1 "
     "(3.3 to 4.4 ms before)", "scripts/bench_recipe.py's output, not committed; " + NOT_RECORDED),
    ("docs/report/README.md", "(library / recipe 1.07x to 1.18x, `\"last\"` 0.93x to 1.11x "
     "in four runs)", "scripts/bench_recipe.py's output, not committed"),
    ("docs/report/README.md", "within 2 minutes and 8 GiB", "the issue's limits"),
    ("docs/report/README.md", "took 7.1 minutes wall (628 s user, 84 s system", NOT_RECORDED),
    ("docs/report/README.md", "waited on a lock: 1:47 wall",
     "its paragraph names its calibration (ddp/calibration.json, before and after the run)"),
    ("docs/report/README.md", "peak 88.90 GiB per rank (13s)",
     "a progress line's shape, not a timing claim"),
    ("README.md", "Each call stays under 10 minutes", LIMIT),
    ("docs/gpu_validation.md", "The default budget is 9 minutes per call", LIMIT),
    ("docs/gpu_validation.md", "(parity 2 minutes, each report backend 4, each benchmark 2 to 3,",
     "the kit's budget estimates (Plan.make in scripts/gpu_validate.py), not a measurement"),
    ("docs/report/README.md", "run within 10%", "the tolerance tests/report/test_report.py asserts"),
    ("docs/integrations/verl.md", "run within 10%", "the tolerance tests/report/test_report.py asserts"),
    ("docs/options.md", "separate benchmark gave 1.14x with FSDP2 and 0.98x",
     "scripts/bench_saved_tensor_check.py's output, not committed"),
    ("docs/options.md", "165 saved tensors / 104 MiB per forward",
     "scripts/bench_saved_tensor_check.py's output, not committed"),
    ("docs/integrations/bergson.md", "two-forward 49.3 ms, block 26.9 ms (1.83x)",
     "examples/influence_bergson.py's output (FSDP1), not committed; " + NOT_RECORDED),
    ("docs/integrations/bergson.md", "median step: two-forward 53.6 ms, block 27.9 ms",
     "examples/influence_bergson.py's output, pasted (bergson is not in the default venv); "
     + NOT_RECORDED),
    ("docs/integrations/bergson.md", "about 4 minutes on a 2-core CPU, 3 of them installing",
     "mostly the install's download; " + NOT_RECORDED),
    ("docs/backends.md", "the test sees 16% of the embedding's elements wrong",
     "what a test observed (tests/deepspeed/cases_deepspeed*.py)"),
    ("docs/backends.md", "bf16 (5% of each tensor's scale", "a test tolerance"),
    ("docs/backends.md", "about 5 GB each while it lives", "a venv's size on disk"),
    ("docs/multi_objective.md", "7e9 x 4 B / 8 = 3.5 GB per loss per rank (bf16 gradients: "
     "1.75 GB); k = 4 losses hold 14 GB (7 GB)", "arithmetic on the page"),
    ("docs/multi_objective.md", "| 2 | 0.72x |", "scripts/bench_loss_grads.py's output, "
     "not committed"),
    ("docs/multi_objective.md", "| 4 | 0.55x |", "scripts/bench_loss_grads.py's output, "
     "not committed"),
    ("docs/multi_objective.md", "| 8 | 0.61x |", "scripts/bench_loss_grads.py's output, "
     "not committed"),
]


def _allowed_spans(page: str, text: str) -> list[tuple[int, int]]:
    spans = []
    for where, quoted, _ in ALLOWED:
        if fnmatch.fnmatch(page, where):
            pattern = r"\s+".join(re.escape(w) for w in quoted.split())
            spans += [m.span() for m in re.finditer(pattern, text)]
    return spans


def _blank(text: str, spans: list[tuple[int, int]]) -> str:
    """``text`` with ``spans`` replaced by spaces (line breaks kept: line numbers hold)."""
    chars = list(text)
    for start, end in spans:
        for i in range(start, end):
            if chars[i] != "\n":
                chars[i] = " "
    return "".join(chars)


def unmarked(page: str, text: str) -> list[str]:
    """Figure-like numbers outside markers, generated blocks, code and ALLOWED text, and
    absolute times outside markers, generated blocks and ALLOWED text."""
    if any(fnmatch.fnmatch(page, g) for g in GENERATED_PAGES):
        return []
    spans = [m.span() for m in FIG.finditer(text)] + [m.span() for m in BLOCK.finditer(text)]
    spans += [m.span() for m in re.finditer(r"<!--.*?-->", text, re.S)]
    spans += _allowed_spans(page, text)
    # Code: commands (their inputs, `--gpu-memory 80GiB`) and program output pasted as it
    # printed; a marker inside code would show, so figures there cannot be marked. A time
    # there is checked all the same: pasted output (an `output` block instead names its
    # calibration in its file).
    fenced = [m.span() for m in re.finditer(r"^```.*?^```", text, re.S | re.M)]
    code = fenced + [m.span() for m in re.finditer(r"`[^`]+`", _blank(text, fenced))]
    found = {m.start(): repr(m.group(0))
             for m in FIGURE_LIKE.finditer(_blank(text, spans + code))}
    for m in TIME_LIKE.finditer(_blank(text, spans)):
        found.setdefault(m.start(), f"{m.group(0)!r} (a time: name its calibration)")
    lines = text.splitlines()
    return [f"line {text.count(chr(10), 0, at) + 1}: {found[at]} in "
            f"{lines[text.count(chr(10), 0, at)].strip()!r}" for at in sorted(found)]


def unused_allowances() -> list[str]:
    """ALLOWED entries that match no page (their figure left, or was reworded)."""
    texts = {str(p.relative_to(ROOT)): p.read_text() for p in pages()}
    unused = []
    for where, quoted, why in ALLOWED:
        pattern = r"\s+".join(re.escape(w) for w in quoted.split())
        if not any(fnmatch.fnmatch(page, where) and re.search(pattern, text)
                   for page, text in texts.items()):
            unused.append(f"{where}: {quoted!r} ({why})")
    return unused
