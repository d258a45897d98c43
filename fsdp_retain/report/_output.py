"""Writes a report as ``report.json``, ``report.md`` and its figures (``_figures``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ._deps import install_hint
from ._modes import KEEP_SLACK_TEXT, MODES, REGATHER_SLACK_TEXT, mode_legend
from ._rows import BREAKDOWN_KEYS, Report, ReportRow

__all__ = ["render_fit_table", "render_markdown", "write_figures", "write_report"]

_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def _unit(rows: list[ReportRow]) -> tuple[str, int]:
    largest = max((r.peak_bytes or 0 for r in rows), default=0)
    for name, size in _UNITS:
        if largest >= 10 * size:
            return name, size
    return "KiB", 2**10


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def not_applicable(row: ReportRow) -> bool:
    """The row's mode means nothing on its backend (``ModeSpec.not_applicable``): not run."""
    spec = MODES.get(row.mode)
    return spec is not None and row.backend in spec.not_applicable


def silently_wrong(row: ReportRow) -> bool:
    """The row ran but left different gradients on the ranks (plain DDP's ``naive``)."""
    return not row.ok and "ReplicasDisagree" in (row.error or "")


def _mode_cell(row: ReportRow) -> str:
    return f"`{row.label}`"


def _mib(value: int | None) -> str:
    return _num(None if value is None else value / 2**20)


def _ms(value: float | None, fmt: str = "{:.1f}") -> str:
    return _num(None if value is None else 1e3 * value, fmt)


def _header(cfg: dict, unit: str, size: int) -> list[str]:
    simulated = " (simulated: fake process group and fake tensors)" if cfg["simulated"] else ""
    unsharded = (cfg["unsharded_param_bytes"] or 0) / size
    return [
        "# fsdp-retain: memory, time and communication per mode",
        "",
        f"Command: `{cfg['command']}`" if cfg.get("command") else "",
        "",
        f"- {cfg['model']}: {cfg['layers']} layers, hidden {cfg['hidden']}, intermediate "
        f"{cfg['intermediate']}, {cfg['heads']} heads ({cfg['kv_heads']} KV), vocab "
        f"{cfg['vocab']}, {(cfg['param_count'] or 0) / 1e6:.1f}M params ({cfg['dtype']}, "
        f"unsharded {unsharded:.1f} {unit}); batch {cfg['batch_per_rank']} x "
        f"{cfg['seq_len']} tokens per rank.",
        f"- {cfg['device_name']}, {cfg['process_group']} process group, world size "
        f"{cfg['world_size']}{simulated}; torch {cfg['torch']}, transformers "
        f"{cfg['transformers']}.",
        "- One step: one forward (two for `two_forward`), a token log-prob loss backward, a "
        "policy-gradient loss backward (random advantages), SGD step. FSDP units: each decoder "
        "layer plus the root. Library modes pass `backwards=2`.",
    ] + (
        [f"- fsdp1: `HYBRID_SHARD` over shard groups of {cfg['node_size']} ranks (one node), "
         f"replicated across {cfg['world_size'] // cfg['node_size']} nodes (a `device_mesh` "
         f"of shape ({cfg['world_size'] // cfg['node_size']}, {cfg['node_size']}))."]
        if cfg.get("fsdp1_sharding") == "HYBRID_SHARD" else []
    ) + (
        ["- deepspeed: ZeRO-3 (`stage3_param_persistence_threshold: 0`, one gradient bucket of "
         "the model's size), SGD as a client optimizer, `engine.step()`. ZeRO-3 gathers per "
         "module and prefetches the traced order, so after the first step one coalesced "
         "all-gather fetches a small model per forward. The breakdown does not separate its "
         "parameters (the peak does count them)."]
        if "deepspeed" in cfg.get("backends", ()) else []
    ) + (
        ["- ddp: `DistributedDataParallel` of the whole model (" + ", ".join(
            f"{k}={v}" for k, v in (cfg.get("ddp") or {}).items()) + "; `fsdp_units` in report.json: its "
         "buckets). Nothing is sharded: every rank holds the whole model and its gradients "
         "(`sharded params` in the breakdown), so the modes that only change "
         "`keep_unsharded` or `reshard_to` are n/a, and a step's all-reduces are one per "
         "bucket per reduction. Each mode's step is checked to leave the same gradients on "
         "every rank: plain DDP's `naive` fails that check."]
        if "ddp" in cfg.get("backends", ()) else []
    )


def _legend(rows: list[ReportRow], node_size: int | None) -> list[str]:
    labels = list(dict.fromkeys(r.label for r in rows))
    return ["## Modes", "", "| mode | what runs |", "|---|---|"] + [
        f"| `{label}` | {mode_legend(label, node_size=node_size)} |" for label in labels
    ]


def _amount(value: int | None, size: int) -> str:
    """Bytes in units of ``size``; none at all is ``0``, not ``0.0``."""
    return "-" if value is None else "0" if value == 0 else f"{value / size:.1f}"


def _by_group(value: dict[str, int] | None, size: int) -> str:
    """``{"64": bytes, "8": bytes}`` -> ``64 ranks: 65.7; 8 ranks: 8.2``."""
    if value is None:
        return "-"
    if not any(value.values()):
        return "0"
    return "; ".join(f"{ranks} ranks: {_amount(n, size)}" for ranks, n in value.items() if n)


def _group_table(rows: list[ReportRow], node_size: int | None) -> list[str]:
    """All-gathers per step, and those after the first backward by the ranks of their
    group (the whole world or a node), with the bytes that leave a node."""
    counted = [r for r in rows if r.all_gather_bytes_by_group is not None]
    if not any(r.all_gathers_per_step for r in counted):  # none at all (DDP)
        return []
    largest = max((r.all_gather_bytes_per_step or 0 for r in counted), default=0)
    unit, size = next(((n, s) for n, s in _UNITS if largest >= 10 * s), ("KiB", 2**10))
    node = f"{node_size} ranks per node" if node_size else "no --node-size"
    return [
        f"## All-gathers by group (per rank, one step; {node})",
        "",
        f"| backend | mode | all-gathers | all-gather {unit} | by group ({unit}) | between "
        f"passes, by group ({unit}) | inter-node all-gather bytes between passes ({unit}) |",
        "|---|---|--:|--:|---|---|--:|",
    ] + [
        f"| {r.backend} | {_mode_cell(r)} | {_num(r.all_gathers_per_step, '{}')} | "
        f"{_amount(r.all_gather_bytes_per_step, size)} | "
        f"{_by_group(r.all_gather_bytes_by_group, size)} | "
        f"{_by_group(r.all_gather_bytes_between_passes, size)} | "
        f"{_amount(r.inter_node_all_gather_bytes_between_passes, size)} |"
        for r in counted
    ]


def _memory_table(rows: list[ReportRow], unit: str, size: int) -> list[str]:
    def scaled(value: int | None, fmt: str = "{:.1f}") -> str:
        return _num(None if value is None else value / size, fmt)

    lines = [
        "## Memory (per rank, the rank with the highest peak)",
        "",
        f"| backend | mode | peak ({unit}) | vs two_forward ({unit}) | bound ({unit}) | within | "
        + " | ".join(k.replace("_", " ") for k in BREAKDOWN_KEYS)
        + " |",
        "|---|---|--:|--:|--:|:-:|" + "--:|" * len(BREAKDOWN_KEYS),
    ]
    for row in rows:
        cells = [row.backend, _mode_cell(row)]
        if not row.ok:
            what = ("n/a" if not_applicable(row) else "wrong gradients" if silently_wrong(row)
                    else "expected crash" if row.expected_error else "error")
            cells += [f"{what} (see below)"] + [""] * (3 + len(BREAKDOWN_KEYS))
        else:
            breakdown = row.breakdown or {}
            cells += [
                scaled(row.peak_bytes),
                scaled(row.memory_overhead_bytes, "{:+.1f}"),
                scaled(row.memory_bound_bytes),
                {True: "yes", False: "**NO**", None: ""}[row.within_bound],
            ]
            cells += [scaled(breakdown.get(k, 0)) if breakdown else "-" for k in BREAKDOWN_KEYS]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _time_table(rows: list[ReportRow]) -> list[str]:
    # All-reduces (DDP's gradients) get a column where a row has any.
    all_reduces = any(r.all_reduces_per_step for r in rows)
    lines = [
        "## Time and communication (per step)",
        "",
        "| backend | mode | step (ms) | vs two_forward | saved (ms) | share of ideal saving "
        "| all-gathers | all-gather MiB | prefetched | reduce-scatters | reduce-scatter MiB |"
        + (" all-reduces |" if all_reduces else ""),
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|" + ("--:|" if all_reduces else ""),
    ]
    for row in rows:
        if row.mode == "two_forward":
            saving = [f"(2nd forward: {_ms(row.forward2_time_s)})", "baseline"]
        else:
            saving = [_ms(row.saved_time_s, "{:+.1f}"), _share(row.share_of_ideal_saving)]
        cells = [
            row.backend, _mode_cell(row), _ms(row.step_time_s),
            _num(row.time_ratio, "{:.2f}x"), *saving,
            _num(row.all_gathers_per_step, "{}"), _mib(row.all_gather_bytes_per_step),
            _prefetched(row.prefetched_all_gathers),
            _num(row.reduce_scatters_per_step, "{}"), _mib(row.reduce_scatter_bytes_per_step),
        ] + ([_num(row.all_reduces_per_step, "{}")] if all_reduces else [])
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _prefetched(pair: list[int] | None) -> str:
    """``prefetched/could be`` backward all-gathers; ``-`` when none was re-gathered."""
    if not pair or not pair[1]:
        return "-"
    return f"{pair[0]}/{pair[1]}"


def _probe_lines(rows: list[ReportRow]) -> list[str]:
    probes = [r for r in rows if r.probe_backward_ratio is not None]
    if not probes:
        return []
    lines = [
        "## Probe pass (backward 1 with `param_grads=False`)",
        "",
        "| backend | mode | backward 1 (ms) | full backward 1 (ms) | ratio | projected H200 step |",
        "|---|---|--:|--:|--:|--:|",
    ]
    for r in probes:
        # Set together (add_probe_comparisons): the ratio is computed from backward 1.
        assert r.backward1_time_s is not None and r.probe_backward_ratio is not None, r
        full = r.backward1_time_s / r.probe_backward_ratio
        lines.append(
            f"| {r.backend} | {_mode_cell(r)} | {_ms(r.backward1_time_s)} | {_ms(full)} "
            f"| {r.probe_backward_ratio:.2f}x | {r.projected_h200_step_ratio:.2f}x |"
        )
    lines += [
        "",
        "Full backward 1: the `keep` row with the same sync_grads, timed in the same run. "
        "Projected step: (F1 + ratio x B1 + B2) / (F1 + B1 + F2 + B2) on one H200's phase "
        "profile (0.576, 0.880, 0.566, 1.033 s); removing the second forward alone gives 0.81x.",
    ]
    return lines


def _check_lines(rows: list[ReportRow]) -> list[str]:
    checks = [r for r in rows if r.check_cost_ratio is not None]
    if not checks:
        return []
    return ["Cost of `check_saved_tensors=True` (step time against the `keep` row with the "
            "same sync_grads, same run): "
            + ", ".join(f"{r.backend} {r.check_cost_ratio:.2f}x" for r in checks) + "."]


def _one_pass_lines(rows: list[ReportRow]) -> list[str]:
    ones = [r for r in rows if r.one_pass_ratio is not None]
    if not ones:
        return []
    return ["One backward in the block against the same step without the library (the "
            "`one_pass` row over the `one_backward` row, same run): "
            + ", ".join(f"{r.backend} {r.one_pass_ratio:.3f}x" for r in ones) + "."]


def _recipe_lines(rows: list[ReportRow]) -> list[str]:
    recipes = [r for r in rows if r.library_time_ratios]
    if not recipes:
        return []
    parts = [
        f"{r.backend} " + ", ".join(f"`{label}` {ratio:.2f}x"
                                    for label, ratio in (r.library_time_ratios or {}).items())
        + f" (of {_mode_cell(r)})"
        for r in recipes
    ]
    return ["The block's own cost over FSDP2 alone (step time against `fsdp2_recipe` with the "
            "same sync_grads, same run; `:last` against the recipe with gradient sync off for "
            "backward 1): " + "; ".join(parts) + "."]


def render_markdown(report: Report) -> str:
    """A table a user can paste in an issue, with the command and the setup above it."""
    cfg, rows = report.config, report.rows
    unit, size = _unit(rows)
    ok_rows = [r for r in rows if r.ok]
    lines = (_header(cfg, unit, size) + [""] + _legend(rows, cfg.get("node_size")) + [""]
             + _memory_table(rows, unit, size))
    groups = _group_table(ok_rows, cfg.get("node_size"))
    if groups:
        lines += [""] + groups
    if not cfg["simulated"]:
        lines += [""] + _time_table(ok_rows)
        for extra in (_probe_lines(ok_rows), _check_lines(ok_rows), _recipe_lines(ok_rows)):
            if extra:
                lines += [""] + extra
    no_breakdown = [r for r in ok_rows if r.breakdown_error]
    if no_breakdown:
        lines += ["", "No breakdown (torch's memory tracker failed; the peak stands):", ""]
        lines += [f"- {r.backend} {_mode_cell(r)}: `{r.breakdown_error}`" for r in no_breakdown]
    failed = [r for r in rows if not r.ok]
    if failed:
        lines += ["", "## Errors", ""]
        for r in failed:
            if not_applicable(r):
                lines.append(f"- {r.backend} {_mode_cell(r)}: n/a: {r.expected_error}.")
            elif r.expected_error and silently_wrong(r):
                lines.append(f"- {r.backend} {_mode_cell(r)}: wrong gradients, as expected: "
                             f"{r.expected_error}. Recorded: `{r.error}`")
            elif r.expected_error:
                where = (" Under fake tensors it surfaces as a different error."
                         if cfg["simulated"] else "")
                lines.append(f"- {r.backend} {_mode_cell(r)}: the expected crash: "
                             f"{r.expected_error}.{where} Recorded: `{r.error}`")
            else:
                lines.append(f"- {r.backend} {_mode_cell(r)}: `{r.error}`")
        if cfg["simulated"] and any(not r.expected_error for r in failed):
            lines.append("- (Simulated: an error may come from fake tensors, not from FSDP.)")
    lines += ["", "## How to read this", ""]
    lines += _notes(cfg, rows)
    return "\n".join(lines) + "\n"


def _notes(cfg: dict, rows: list[ReportRow]) -> list[str]:
    sources = sorted({r.memory_source for r in rows if r.ok and r.memory_source})
    trackers = sorted({(r.breakdown_detail and "tracker") or "" for r in rows} - {""})
    notes = [
        f"- Peak: {', '.join(sources) or 'n/a'}; breakdown at the peak from torch's "
        "`FSDPMemTracker` (FSDP2) or `MemTracker` (FSDP1; all-gather outputs count as "
        "unsharded params, reduced tensors as grads). `other`: gradients of activations "
        "and other temporaries of backward, inputs, buffers, optimizer state."
        if trackers else "- Peak: n/a.",
        "- Bounds on the overhead against `two_forward`: `keep` at most the unsharded params of "
        f"all units {KEEP_SLACK_TEXT} (with `sync_grads=\"last\"` also their unsharded grads, "
        f"which wait for the last backward); `regather` at most {REGATHER_SLACK_TEXT} of the "
        "`two_forward` peak; `regather_node` that plus 2/`reshard_to` of the unsharded "
        f"params {KEEP_SLACK_TEXT} (each rank's share of its node's copy between passes, "
        "and as much again, at most, for the all-gather input of a unit re-gathered from "
        "it).",
    ]
    if any(r.backend == "ddp" for r in rows):
        notes.append(
            "- On DDP nothing is kept (every rank holds the whole model and its gradients in "
            f"every mode): the library's rows may add the block's flat copy of the gradients "
            f"it all-reduces, the unsharded grads {KEEP_SLACK_TEXT}. `two_forward` all-reduces "
            "each bucket once per backward, `keep:every` once per pass, `keep:last` once per "
            "step.")
    if any(r.all_gathers_per_step for r in rows if r.all_gather_bytes_by_group is not None):
        notes.append(
            "- All-gathers by group: bytes of each all-gather's output (per rank) under "
            "`CommDebugMode`, by the ranks of the process group that issued it. Between "
            "passes: issued after the first backward (the later passes' re-gathers; for "
            "`two_forward` its second forward and backward). Inter-node: of those, on groups "
            "of more ranks than `--node-size` (a group of FSDP2's is consecutive ranks, and "
            "launchers number ranks node by node).")
    if not cfg["simulated"]:
        notes += [
            f"- Step time: median of {cfg['timed_steps']} steps after {cfg['warmup_steps']} "
            "warm-up step(s), all modes interleaved step by step, no instrumentation; a step "
            "lasts until its slowest rank is done. Ideal saving: the median time of the second "
            "forward (with its all-gathers) in `two_forward`, timed in extra steps of its own. "
            "Share of ideal saving = saved / ideal; above 100% the mode also saves "
            "communication the ideal does not count (the backward re-gathers of units that "
            "resharded after forward).",
            "- Collectives: one step under `CommDebugMode`; bytes are the unsharded side per "
            "rank (all-gather output, reduce-scatter input). Prefetched: of the backward "
            "all-gathers of units after the first in backward order, how many were issued "
            "while the unit before ran its backward (FSDP's backward prefetch) rather than at "
            "the unit's own pre-backward hook (see `fsdp_retain/report/_prefetch.py`).",
        ]
        if cfg["world_size"] == 1 and "fsdp1" in cfg["backends"]:
            notes.append(
                "- World size 1: FSDP1 switches to `NO_SHARD` (no all-gathers, parameters "
                "never freed), so its rows only show the cost of the second forward; FSDP2 "
                "still frees and re-gathers (a local copy)."
            )
        if cfg["device"] == "cpu":
            notes.append(
                "- CPU (gloo) timings: compare the ratios, not the absolute times; a shared CPU "
                "adds noise."
            )
    return notes


def render_fit_table(report: Report) -> str:
    """Per-rank peak memory, one row per mode and one column per backend ("will it fit?")."""
    cfg, rows = report.config, report.rows
    unit, size = _unit(rows)
    backends = list(dict.fromkeys(r.backend for r in rows))
    labels = list(dict.fromkeys(r.label for r in rows))
    by_key = {(r.backend, r.label): r for r in rows}

    def cell(row: ReportRow | None) -> str:
        if row is None:
            return ""
        if not row.ok:
            return ("n/a" if not_applicable(row) else "wrong (expected)" if silently_wrong(row)
                    else "crashes (expected)" if row.expected_error else "error")
        change = row.memory_overhead_bytes
        assert row.peak_bytes is not None, row  # measured in every row that ran
        peak = _num(row.peak_bytes / size)
        return peak if change is None or row.mode == "two_forward" else (
            f"{peak} ({change / size:+.1f})")

    simulated = " (simulated)" if cfg["simulated"] else ""
    lines = [
        f"Peak memory per rank ({unit}; in brackets: vs two_forward), {cfg['model']} "
        f"{(cfg['param_count'] or 0) / 1e6:.1f}M params, {cfg['dtype']}, batch "
        f"{cfg['batch_per_rank']} x {cfg['seq_len']} per rank, world size "
        f"{cfg['world_size']}{simulated}:",
        "",
        "| mode | " + " | ".join(backends) + " |",
        "|---|" + "--:|" * len(backends),
    ]
    for label in labels:
        cells = [cell(by_key.get((backend, label))) for backend in backends]
        lines.append(f"| `{label}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_report(report: Report, out_dir: Path) -> dict[str, Any]:
    """Writes ``report.json``, ``report.md``, ``report.png`` and, for a timed run,
    ``tradeoff.png``; returns their paths and the Markdown text."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Any] = {
        "json": out_dir / "report.json",
        "md": out_dir / "report.md",
    }
    paths["json"].write_text(json.dumps(report.to_json(), indent=2) + "\n")
    text = render_markdown(report)
    paths["md"].write_text(text)
    try:
        paths.update(write_figures(report, out_dir))
    except ImportError as exc:  # matplotlib is an optional dependency
        print(f"[report] no report.png, tradeoff.png: {exc} (the report extra, "
              f"{install_hint('report')})", flush=True)
    paths["md_text"] = text
    return paths


def write_figures(report: Report, out_dir: Path) -> dict[str, Path]:
    """``report.png`` and, for a timed run, ``tradeoff.png`` (see ``_figures``)."""
    from ._figures import report_figure, save, tradeoff_figure

    paths = {"png": out_dir / "report.png"}
    save(report_figure(report), paths["png"])
    tradeoff = tradeoff_figure(report)
    if tradeoff is not None:
        paths["tradeoff"] = out_dir / "tradeoff.png"
        save(tradeoff, paths["tradeoff"])
    return paths
