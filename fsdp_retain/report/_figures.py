"""The report's figures, drawn with matplotlib from reports (``Report``).

- ``report_figure``: peak memory (stacked by breakdown) and step time per row
  (``report.png``);
- ``tradeoff_figure``: per backend, step time against extra memory, both
  relative to ``two_forward``, the ``keep_unsharded`` budgets joined from
  ``False`` to ``True`` (``tradeoff.png``; timed runs only);
- ``fit_figure`` and ``fit_table`` (in ``_fit_figure.py``): per-rank peaks of simulated
  runs of several models and world sizes against GPU memory lines (``will_it_fit.png``
  and ``will_it_fit.md``).

[Note: readable figures] Every figure is ``WIDTH_IN`` inches wide at ``DPI``
(at most ``MAX_WIDTH_PX``), and its smallest text is ``MIN_FONT_PT``: shown
800 px wide, as a README shows it, a text of ``s`` points is
``s * DPI / 72 * 800 / (WIDTH_IN * DPI)`` px high, at least ``MIN_TEXT_PX``
(``smallest_text_px`` measures it; ``tests/report/test_report_figures.py`` checks).
"""

from __future__ import annotations

import functools
import textwrap
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ._modes import MODES, mode_legend, option_text
from ._rows import BREAKDOWN_KEYS, Report, ReportRow

WIDTH_IN = 8.0
DPI = 160
MAX_WIDTH_PX = 1600
SHOWN_PX = 800  # the width a README shows an image at
MIN_TEXT_PX = 11  # the smallest text, in px, at that width
MIN_FONT_PT = 9.0  # >= MIN_TEXT_PX * 72 / SHOWN_PX * WIDTH_IN = 7.92
TITLE_PT = 11.0
_GIB = 2**30

# The keep_unsharded curve: mode -> (budget share, point label).
_BUDGETS = {"regather": (0.0, "False"), "keep": (1.0, "True")}
_MARKERS = "osD^vP*Xh<>p"


_RC = {"figure.dpi": DPI, "font.size": MIN_FONT_PT, "axes.titlesize": TITLE_PT,
       "axes.labelsize": MIN_FONT_PT + 1, "legend.fontsize": MIN_FONT_PT,
       "xtick.labelsize": MIN_FONT_PT, "ytick.labelsize": MIN_FONT_PT,
       "figure.titlesize": TITLE_PT}
_F = TypeVar("_F", bound=Callable[..., Any])


def _plt():
    import matplotlib

    major, minor = (int(part) for part in matplotlib.__version__.split(".")[:2])
    if (major, minor) < (3, 7):  # legends "outside" the axes
        raise ImportError(f"the figures need matplotlib 3.7 or later, found "
                          f"{matplotlib.__version__}")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _styled(draw: _F) -> _F:
    """Runs ``draw`` with the figures' sizes (``_RC``), leaving matplotlib's as they were."""
    @functools.wraps(draw)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _plt().rc_context(_RC):
            return draw(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def smallest_text_px(fig, shown_px: float = SHOWN_PX) -> float:
    """The smallest visible text of ``fig``, in px, with the image shown ``shown_px`` wide."""
    from matplotlib.text import Text

    sizes = [t.get_fontsize() for t in fig.findobj(Text) if t.get_visible() and t.get_text()]
    width_px = fig.get_figwidth() * fig.dpi
    return min(sizes) * fig.dpi / 72 * shown_px / width_px


def save(fig, path) -> None:
    fig.savefig(path, dpi=DPI)
    import matplotlib.pyplot as plt

    plt.close(fig)


def _unit(rows: Sequence[ReportRow]) -> tuple[str, int]:
    largest = max((abs(r.peak_bytes or 0) for r in rows), default=0)
    for name, size in (("GiB", 2**30), ("MiB", 2**20)):
        if largest >= 10 * size:
            return name, size
    return "KiB", 2**10


def _title(cfg: dict[str, Any]) -> str:
    simulated = " (simulated)" if cfg["simulated"] else ""
    return (f"{model_name(cfg)}, {cfg['dtype']}, batch {cfg['batch_per_rank']} x "
            f"{cfg['seq_len']}, {cfg['device']} world size {cfg['world_size']}{simulated}")


# Readable names of ``--model-config`` shapes: (model class, layers, hidden, vocab) -> name.
_KNOWN_MODELS: dict[tuple[str, Any, Any, Any], str] = {
    ("Llama", 32, 4096, 128256): "Llama-3-8B",
    ("Llama", 80, 8192, 128256): "Llama-3-70B",
    ("Llama", 126, 16384, 128256): "Llama-3.1-405B",
}


def _params(cfg: dict[str, Any]) -> str:
    count = cfg.get("param_count") or 0
    return f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"


def _family(cfg: dict[str, Any]) -> str:
    return str(cfg["model"]).split()[0].removesuffix("ForCausalLM")


def model_name(cfg: dict[str, Any]) -> str:
    """``Llama-3-70B (70.6B)``: a readable name of the preset or the ``--model-config``
    shape (``_KNOWN_MODELS``, else the model class, layers and hidden size), and the
    parameter count; the figures' names."""
    if cfg.get("model_config"):
        shape = (_family(cfg), cfg.get("layers"), cfg.get("hidden"), cfg.get("vocab"))
        name = _KNOWN_MODELS.get(shape) or f"{shape[0]} {shape[1]} layers x {shape[2]}"
    elif str(cfg.get("size", "")).endswith("b"):
        name = f"Qwen2.5-{cfg['size'].upper()}"
    else:
        name = f"{_family(cfg)} {cfg.get('size')}"
    return f"{name} ({_params(cfg)})"


def _mode_notes(labels: Sequence[str]) -> str:
    lines = [f"{label}: {mode_legend(label, short=True)}" for label in labels]
    wrapped = [textwrap.fill(line, 88, subsequent_indent="    ") for line in lines]
    return "Modes (library modes: no_reshard_between_backwards, backwards=2)\n" + "\n".join(wrapped)


# report.png #
@_styled
def report_figure(report: Report):
    """Horizontal bars, one per row: peak memory (stacked by breakdown) and, for a timed
    run, the median step time beside it; the modes' options under them."""
    plt = _plt()
    from matplotlib.transforms import blended_transform_factory

    cfg, rows = report.config, report.rows
    unit, size = _unit(rows)
    timed = not cfg["simulated"]
    notes = _mode_notes(list(dict.fromkeys(r.label for r in rows)))
    legend_in = 0.4
    notes_in = legend_in + 0.1 + 0.17 * (notes.count("\n") + 1)
    bars_in = 1.6 + 0.26 * len(rows)
    fig = plt.figure(figsize=(WIDTH_IN, bars_in + notes_in), layout="constrained")
    grid = fig.add_gridspec(2, 2 if timed else 1, height_ratios=[bars_in, notes_in])
    names = [f"{r.backend} {r.label}" for r in rows]
    ys = list(range(len(rows)))[::-1]
    ax = fig.add_subplot(grid[0, 0])
    left = [0.0] * len(rows)
    for key in BREAKDOWN_KEYS:
        widths = [((r.breakdown or {}).get(key, 0) / size) if r.ok else 0 for r in rows]
        ax.barh(ys, widths, left=left, label=key.replace("_", " "))
        left = [a + w for a, w in zip(left, widths)]
    for y, row in zip(ys, rows):
        if not row.ok:
            _error_mark(ax, y, row)
        elif row.peak_bytes is not None:
            ax.plot([row.peak_bytes / size] * 2, [y - 0.4, y + 0.4], color="black", lw=1.2)
    ax.set_xlim(0, 1.05 * max([*left, *((r.peak_bytes or 0) / size for r in rows)], default=1))
    ax.set_yticks(ys, names)
    ax.set_xlabel(f"peak memory per rank ({unit})")
    ax.set_title("Peak memory (black: the peak)")
    breakdown = ax.get_legend_handles_labels()
    if timed:
        ax = fig.add_subplot(grid[0, 1], sharey=ax)
        ax.tick_params(labelleft=False)
        times = [1e3 * r.step_time_s if r.ok and r.step_time_s else 0 for r in rows]
        ax.barh(ys, times, color="tab:gray")
        ax.set_xlim(0, 1.05 * max(times, default=1) or 1)
        for y, row in zip(ys, rows):
            if not row.ok:
                _error_mark(ax, y, row)
            elif row.mode == "two_forward" and row.forward2_time_s and row.step_time_s:
                same = [yy for yy, r in zip(ys, rows) if r.backend == row.backend]
                ideal = 1e3 * (row.step_time_s - row.forward2_time_s)
                ax.vlines(ideal, min(same) - 0.4, max(same) + 0.4, ls="--", lw=1,
                          color="tab:green")
        ax.set_xlabel("median step time (ms)")
        ax.set_title("Step time (dashed: ideal)")
    fig.suptitle(_title(cfg))
    notes_ax = fig.add_subplot(grid[1, :])
    notes_ax.axis("off")
    notes_ax.legend(*breakdown, loc="upper center", bbox_to_anchor=(0.5, 1.0),
                    ncol=len(BREAKDOWN_KEYS), frameon=False, handlelength=1.2,
                    columnspacing=1.0)
    notes_ax.text(0.01, 1 - legend_in / notes_in, notes, va="top", ha="left",
                  family="monospace",
                  transform=blended_transform_factory(fig.transFigure, notes_ax.transAxes))
    return fig


def error_text(row: ReportRow) -> str:
    """What a failed row's bar says: ``n/a (nothing sharded)`` for a mode that only changes
    what DDP does not have (``ModeSpec.not_applicable``), ``n/a (FSDP2 only)`` for an
    FSDP2-only mode on another backend (it cannot run there), ``wrong gradients`` (plain
    DDP's ``naive``: it ran, and the ranks' gradients disagree), ``expected crash`` (plain
    FSDP1's or ZeRO-3's ``naive``), else ``error``."""
    spec = MODES.get(row.mode)
    if spec is not None and row.backend in spec.not_applicable:
        return "n/a (nothing sharded)"
    if spec is not None and not spec.applies_to(row.backend):
        return "n/a (FSDP2 only)"
    if row.expected_error and "ReplicasDisagree" in (row.error or ""):
        return "wrong gradients"  # plain DDP's naive: it ran, the ranks disagree
    return "expected crash" if row.expected_error else "error"


def _error_mark(ax, y: float, row: ReportRow) -> None:
    text = error_text(row)
    ax.text(0, y, f" {text}", ha="left", va="center",
            color="red" if text == "error" else "tab:gray")


# tradeoff.png #
def _budget(mode: str) -> tuple[float, str] | None:
    """A mode's share of the unsharded bytes and its point label, on the budget curve."""
    if mode in _BUDGETS:
        return _BUDGETS[mode]
    spec = MODES.get(mode)
    if spec is None or spec.budget is None:
        return None
    return spec.budget, f"{spec.budget:.0%}"


def _placed(row: ReportRow) -> bool:
    return row.ok and row.time_ratio is not None and row.memory_overhead_bytes is not None


@_styled
def tradeoff_figure(report: Report):
    """One panel per backend: step time over ``two_forward``'s (y) against the peak
    memory added to ``two_forward``'s (x), a point per mode; the budgets from
    ``regather`` (``False``) to ``keep`` (``True``) joined per ``sync_grads``.
    ``None`` for a simulated run (no times)."""
    cfg, rows = report.config, report.rows
    placed = [r for r in rows if _placed(r)]
    backends = list(dict.fromkeys(r.backend for r in placed))
    if cfg["simulated"] or not backends:
        return None
    plt = _plt()
    unit, size = _unit([r for r in rows if r.mode == "two_forward"])
    curves = {b: _curves([r for r in placed if r.backend == b]) for b in backends}
    on_curve = {r.label for per in curves.values() for curve in per.values() for r in curve}
    off_curve = [label for label in dict.fromkeys(r.label for r in placed)
                 if label not in on_curve and label != "two_forward"]
    style = {label: (_MARKERS[i % len(_MARKERS)], f"C{(i + 2) % 10}")
             for i, label in enumerate(off_curve)}
    legend_in = 0.3 + 0.2 * ((len(style) + 4) // 2)
    height = 4.4 * len(backends) + legend_in + 0.5
    fig, axes = plt.subplots(len(backends), 1, figsize=(WIDTH_IN, height), squeeze=False,
                             layout="constrained")
    handles: dict[str, Any] = {}
    for ax, backend in zip((a[0] for a in axes), backends):
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.axvline(0.0, color="gray", lw=0.8, ls="--")
        handles[option_text("two_forward")] = ax.scatter(
            [0], [1.0], marker="*", s=220, color="black", zorder=5)
        for sync, curve in curves[backend].items():
            xs = [(r.memory_overhead_bytes or 0) / size for r in curve]
            ys = [r.time_ratio or 0 for r in curve]
            (line,) = ax.plot(xs, ys, "-o", color="tab:blue" if sync == "every" else "tab:red",
                              lw=2, ms=6, zorder=3)
            handles[curve_text(sync)] = line
            _label_points(ax, curve, xs, ys)
        points = [r for r in placed if r.backend == backend and r.label in style]
        for row in points:
            marker, color = style[row.label]
            # FSDP2's recipe hollow and larger, under the filled library markers: it often
            # lands on a library mode's point, and both stay visible.
            recipe = row.mode == "fsdp2_recipe"
            handles[option_text(row.label)] = ax.scatter(
                [(row.memory_overhead_bytes or 0) / size], [row.time_ratio], marker=marker,
                s=170 if recipe else 60, facecolors="none" if recipe else color,
                edgecolors=color, linewidths=2 if recipe else 1, zorder=4 if recipe else 5)
        _label_overlaps(ax, points, size, placed)
        ax.set_title(f"{backend}: step time against extra memory")
        ax.set_xlabel(f"peak memory vs two forwards ({unit})")
        ax.set_ylabel("step time / two forwards'")
        ax.margins(0.12)
    fig.suptitle(_title(cfg))
    fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncol=2,
               frameon=False)
    return fig


def curve_text(sync: str | None) -> str:
    """The legend of a ``keep_unsharded`` curve, in the README's option names."""
    last = "" if sync == "every" else f', sync_grads="{sync}"'
    return f"keep_unsharded=False -> budgets -> True{last}" + (" (defaults)" if not last else "")


def _label_overlaps(ax, points: Sequence[ReportRow], size: int,
                    placed: Sequence[ReportRow]) -> None:
    """Names the points off the curve that land on one another (e.g. ``check_saved_tensors``
    and the FSDP2 recipe), each label on its own line beside the shared place, an arrow to
    it: the markers stay at their measured values."""
    where = [((r.memory_overhead_bytes or 0) / size, r.time_ratio or 0.0) for r in placed]
    span_x = (max(x for x, _ in where) - min(x for x, _ in where)) or 1.0
    span_y = (max(y for _, y in where) - min(y for _, y in where)) or 1.0
    mid_x = (max(x for x, _ in where) + min(x for x, _ in where)) / 2
    groups: list[list[tuple[float, float, ReportRow]]] = []
    for row in points:
        x, y = (row.memory_overhead_bytes or 0) / size, row.time_ratio or 0.0
        for group in groups:
            gx, gy, _ = group[0]
            if abs(gx - x) < 0.03 * span_x and abs(gy - y) < 0.03 * span_y:
                group.append((x, y, row))
                break
        else:
            groups.append([(x, y, row)])
    for group in (g for g in groups if len(g) > 1):
        left = group[0][0] > mid_x  # labels on the side with room
        for k, (x, y, row) in enumerate(group):
            ax.annotate(textwrap.fill(option_text(row.label), 32), (x, y),
                        xytext=(-22 if left else 22, 22 + 30 * (len(group) - 1 - k)),
                        textcoords="offset points", ha="right" if left else "left",
                        va="bottom", bbox=dict(facecolor="white", edgecolor="none", pad=1),
                        arrowprops=dict(arrowstyle="-", color="0.4", lw=0.8))


def _curves(rows: Sequence[ReportRow]) -> dict[str | None, list[ReportRow]]:
    """Per ``sync_grads``: regather, the byte budgets and keep in budget order, where at
    least three of them ran."""
    found: dict[str | None, list[tuple[float, ReportRow]]] = {}
    for row in rows:
        budget = _budget(row.mode)
        if budget is not None:
            found.setdefault(row.sync_grads, []).append((budget[0], row))
    return {sync: [r for _, r in sorted(points, key=lambda p: p[0])]
            for sync, points in found.items() if len(points) >= 3}


def _label_points(ax, curve: Sequence[ReportRow], xs: Sequence[float],
                  ys: Sequence[float]) -> None:
    """The budget of each point; points at the same place share one label."""
    span_x = (max(xs) - min(xs)) or 1.0
    span_y = (max(ys) - min(ys)) or 1.0
    groups: list[tuple[float, float, list[str]]] = []
    for row, x, y in zip(curve, xs, ys):
        text = (_budget(row.mode) or (0.0, "?"))[1]
        for gx, gy, texts in groups:
            if abs(gx - x) < 0.03 * span_x and abs(gy - y) < 0.05 * span_y:
                texts.append(text)
                break
        else:
            groups.append((x, y, [text]))
    for x, y, texts in groups:
        ax.annotate(", ".join(texts), (x, y), xytext=(6, 6), textcoords="offset points")
