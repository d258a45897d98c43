"""``will_it_fit.png`` and ``will_it_fit.md``: per-rank peaks of simulated runs of several
models and world sizes against GPU memory lines, and the all-gather bytes that leave a
node between passes (``--node-size``). See [Note: readable figures] in ``_figures.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._figures import _GIB, WIDTH_IN, _budget, _plt, _styled, model_name
from ._modes import option_text
from ._rows import Report

_FIT_ORDER = ("regather:every", "keep25:every", "keep50:every", "keep75:every", "keep:every")
# The rows whose inter-node all-gather bytes between passes the table and figure show.
_REGATHERS = ("regather:every", "regather_node:every")


def _peaks(report: Report) -> dict[str, int]:
    return {r.label: r.peak_bytes for r in report.rows if r.ok and r.peak_bytes is not None}


def _inter_node(report: Report) -> dict[str, int]:
    """Label -> inter-node all-gather bytes between passes (runs with ``--node-size``)."""
    return {r.label: r.inter_node_all_gather_bytes_between_passes for r in report.rows
            if r.ok and r.inter_node_all_gather_bytes_between_passes is not None}


def _gib(value: int) -> str:
    return "0" if value == 0 else f"{value / _GIB:.1f}"


def best_fit(peaks: dict[str, int], gpu_bytes: int) -> str | None:
    """The largest ``keep_unsharded`` (regather, keep25/50/75, keep) whose peak fits."""
    fits = [label for label in _FIT_ORDER if label in peaks and peaks[label] <= gpu_bytes]
    return fits[-1] if fits else None


def _short(label: str) -> str:
    """``keep50:every`` -> ``50%``, as on the budget curve (``False``, ..., ``True``)."""
    name = label.partition(":")[0]
    return (_budget(name) or (0.0, name))[1]


def _fit_reports(reports: Sequence[Report]) -> list[Report]:
    return sorted(reports, key=lambda r: (r.config["world_size"], r.config["param_count"] or 0))


def _node_sizes(reports: Sequence[Report]) -> str:
    sizes = {r.config.get("node_size") for r in reports}
    return "/".join(str(s) for s in sorted(s for s in sizes if s is not None))


def _annotate(ax, x: float, y: float, text: str) -> None:
    ax.annotate(text, (x, y), xytext=(0, 4), textcoords="offset points", rotation=90,
                ha="center", va="bottom",
                bbox=dict(facecolor="white", edgecolor="none", pad=0.5))


@_styled
def fit_figure(reports: Sequence[Report], gpu_bytes: Sequence[int]):
    """One panel per world size; per model, bars of the peak per rank of ``two_forward``,
    the defaults (``keep:every``), the best budget for each GPU memory (the largest
    ``keep_unsharded`` that fits, named over its bar), ``keep_unsharded=False`` and, where
    run, ``reshard_to=<--node-size>`` (each named with its inter-node all-gather GiB
    between passes), with a line per GPU memory."""
    plt = _plt()
    reports = _fit_reports(reports)
    sizes = sorted(gpu_bytes)
    worlds = list(dict.fromkeys(r.config["world_size"] for r in reports))
    first = reports[0].config
    node = _node_sizes(reports)
    bars: list[tuple[str | int, str, str]] = [
        ("two_forward", option_text("two_forward"), "0.55"),
        ("keep:every", option_text("keep:every"), "C0")]
    bars += [(size, f"largest keep_unsharded within {size / _GIB:.0f} GiB (named)", f"C{2 + i}")
             for i, size in enumerate(sizes)]
    bars += [("regather:every", option_text("regather:every"), "C1")]
    if any("regather_node:every" in _peaks(r) for r in reports):
        bars += [("regather_node:every",
                  f"keep_unsharded=False, reshard_to={node or '<node size>'}", "C5")]
    fig, axes = plt.subplots(len(worlds), 1, figsize=(WIDTH_IN, 4.2 * len(worlds) + 1.4),
                             squeeze=False, sharey=True, layout="constrained")
    width = 0.8 / len(bars)
    handles: dict[str, Any] = {}
    top = max(max(_peaks(r).values()) for r in reports) / _GIB
    for ax, world in zip((a[0] for a in axes), worlds):
        mine = [r for r in reports if r.config["world_size"] == world]
        for g, report in enumerate(mine):
            peaks, inter = _peaks(report), _inter_node(report)
            for b, (key, name, color) in enumerate(bars):
                x = g + (b - (len(bars) - 1) / 2) * width
                label = best_fit(peaks, key) if isinstance(key, int) else key
                if label is None:
                    ax.text(x, 0.01 * top, " none fits", rotation=90, ha="center",
                            va="bottom")
                    continue
                if label not in peaks:
                    continue
                handles[name] = ax.bar([x], [peaks[label] / _GIB], width, color=color)
                if isinstance(key, int):
                    _annotate(ax, x, peaks[label] / _GIB, _short(label))
                elif key in _REGATHERS and key in inter:
                    _annotate(ax, x, peaks[label] / _GIB, _gib(inter[key]))
        for i, size in enumerate(sizes):
            handles[f"{size / _GIB:.0f} GiB per GPU"] = ax.axhline(
                size / _GIB, color="black", ls=("--", ":", "-.")[i % 3], lw=1.2)
        ax.set_xticks(range(len(mine)), [model_name(r.config) for r in mine])
        ax.set_ylabel("peak memory per rank (GiB)")
        ax.set_title(f"{world} ranks" + (f", {node} per node" if node else ""))
        ax.set_ylim(0, 1.3 * max(top, sizes[-1] / _GIB))
    ac = ", activation checkpointing" if first.get("activation_checkpointing") else ""
    named = ("\nover the keep_unsharded=False bars: inter-node all-gather GiB per rank "
             "between passes" if node else "")
    fig.suptitle(f"Will it fit? {first['dtype']}, batch {first['batch_per_rank']} x "
                 f"{first['seq_len']} per rank{ac}, simulated{named}")
    fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncol=2,
               frameon=False)
    return fig


def fit_table(reports: Sequence[Report], gpu_bytes: Sequence[int]) -> str:
    """The figure's numbers: peak per rank (GiB) per mode, the inter-node all-gather GiB
    between passes of ``regather`` and ``regather_node`` (runs with ``--node-size``), and
    the largest ``keep_unsharded`` that fits in each GPU memory."""
    reports = _fit_reports(reports)
    modes = ["two_forward", *_FIT_ORDER[::-1]]
    if any("regather_node:every" in _peaks(r) for r in reports):
        modes.append("regather_node:every")
    regathers = [m for m in _REGATHERS if any(m in _inter_node(r) for r in reports)]
    fits = [f"fits {size / _GIB:.0f} GiB" for size in sorted(gpu_bytes)]
    inter = [f"inter-node all-gather GiB between passes, `{m}`" for m in regathers]
    lines = ["| model | ranks | " + " | ".join(f"`{m}`" for m in modes) + " | "
             + "".join(f"{h} | " for h in inter) + " | ".join(fits) + " |",
             "|---|--:|" + "--:|" * (len(modes) + len(inter)) + "---|" * len(fits)]
    for report in reports:
        peaks, moved = _peaks(report), _inter_node(report)
        cells = [f"{peaks[m] / _GIB:.1f}" if m in peaks else "" for m in modes]
        cells += [_gib(moved[m]) if m in moved else "" for m in regathers]
        best = [best_fit(peaks, size) for size in sorted(gpu_bytes)]
        lines.append(f"| {model_name(report.config)} | {report.config['world_size']} | "
                     + " | ".join(cells) + " | "
                     + " | ".join(f"`{b}`" if b else "none" for b in best) + " |")
    return "\n".join(lines) + "\n"
