"""Every rank's results merged into rows, the comparisons with ``two_forward``, the report."""

from __future__ import annotations

import datetime
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from ._config import ReportConfig
from ._ddp import ddp_setup
from ._modes import BACKWARDS, MODES, RECIPE
from ._output import render_fit_table, write_report
from ._rows import Report, ReportRow
from ._runner import say


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def merge_ranks(cfg: ReportConfig, backend: str, per_rank: list[dict], meta: dict,
                 world: int, simulated: bool) -> list[ReportRow]:
    """One row per mode from every rank's results (peaks: the largest rank)."""
    rows = []
    for mode in cfg.mode_list():
        results = [r[mode.label] for r in per_rank]
        first = results[0]
        error = next((r["error"] for r in results if r.get("error")), None)
        expected = mode.spec.expected_crash.get(backend)
        row = ReportRow(
            mode=mode.name,
            label=mode.label,
            backend=backend,
            sync_grads=mode.sync_grads,
            keep_unsharded=(
                mode.block_options(meta.get("unsharded_param_bytes") or 0)["keep_unsharded"]
                if mode.uses_library else None
            ),
            reshard_to=mode.reshard_to,
            backwards=mode.spec.passes if mode.uses_library else None,
            ok=error is None,
            error=error,
            expected_error=(expected if error is not None and not error.startswith("setup:")
                            else None),
            world_size=world,
            simulated=simulated,
            fsdp_units=meta.get("fsdp_units"),
            memory_source=first.get("memory_source"),
        )
        if error is None:
            peaks = [r.get("peak_bytes") for r in results]
            if all(p is not None for p in peaks):
                top = max(range(len(peaks)), key=lambda i: peaks[i])
                row.peak_bytes = peaks[top]
                row.peak_bytes_per_rank = peaks
                row.tracker_peak_bytes = results[top].get("tracker_peak_bytes")
                row.breakdown = results[top].get("breakdown")
                row.breakdown_detail = results[top].get("breakdown_detail")
                row.breakdown_error = results[top].get("breakdown_error")
            # A step ends when its slowest rank does.
            times = [max(ts) for ts in zip(*(r["times"] for r in results))]
            forward2 = [max(ts) for ts in zip(*(r["forward2_times"] for r in results))]
            backward1 = [max(ts) for ts in zip(*(r.get("backward1_times", []) for r in results))]
            row.step_time_s, row.timed_steps = _median(times), len(times)
            row.forward2_time_s, row.backward1_time_s = _median(forward2), _median(backward1)
            counts = first.get("counts")
            if counts is not None:
                row.all_gathers_per_step = counts.get("all_gather", 0)
                row.reduce_scatters_per_step = counts.get("reduce_scatter", 0)
                row.all_reduces_per_step = counts.get("all_reduce", 0)
                row.all_gather_bytes_per_step = counts.get("all_gather_bytes", 0)
                row.reduce_scatter_bytes_per_step = counts.get("reduce_scatter_bytes", 0)
                _group_split(row, first, cfg.node_size)
            prefetch = first.get("prefetch")
            if prefetch is not None:
                row.prefetched_all_gathers = list(prefetch)
        rows.append(row)
    return rows


def _group_split(row: ReportRow, result: dict, node_size: int | None) -> None:
    """All-gather bytes by group size, and those between passes that leave a node: on a
    group of more than ``node_size`` ranks (FSDP2's groups are consecutive ranks, and
    launchers number the ranks node by node)."""
    first = result.get("all_gather_group_bytes", {})
    later = result.get("later_all_gather_group_bytes", {})
    row.all_gather_bytes_by_group = {
        str(ranks): first.get(ranks, 0) + later.get(ranks, 0)
        for ranks in sorted({*first, *later}, reverse=True)}
    row.all_gather_bytes_between_passes = {str(ranks): n for ranks, n in later.items()}
    if node_size is not None:
        row.inter_node_all_gather_bytes_between_passes = sum(
            n for ranks, n in later.items() if ranks > node_size)


def unexpected_failures(report: dict[str, Any]) -> list[ReportRow]:
    """The rows of ``report`` (as ``report.json`` holds it) that could not be produced:
    failed, and not an expected crash."""
    rows = [ReportRow.from_json(r) for r in report.get("rows", [])]
    return [r for r in rows if not r.ok and not r.expected_error]


def memory_bound(row: ReportRow, baseline_peak: int,
                 unsharded_bytes: int) -> tuple[int | None, str]:
    """The most memory ``row``'s mode may add over ``two_forward``, and why.

    ``keep``: ``1 + KEEP_SLACK`` times the unsharded parameters of all units
    (kept from forward to the last backward), with ``sync_grads="last"`` and their
    unsharded gradients, which wait for the last backward. ``regather``:
    ``REGATHER_SLACK`` times the ``two_forward`` peak. On DDP (nothing kept): the block's
    flat copy of the gradients it all-reduces. See ``ModeSpec.bound`` in ``_modes.py``.
    """
    bound = MODES[row.mode].bound_on(row.backend)
    if bound is None:
        return None, ""
    return bound(row.sync_grads, baseline_peak, unsharded_bytes, row.reshard_to)


# One RL actor step on one H200 (forward, log-prob backward, second forward, loss
# backward; seconds): what the probe pass's measured ratio is projected onto.
H200_PHASES = {"forward1": 0.576, "backward1": 0.880, "forward2": 0.566, "backward2": 1.033}


def projected_step_ratio(backward1_ratio: float, phases: dict = H200_PHASES) -> float:
    """(F1 + r*B1 + B2) / (F1 + B1 + F2 + B2): one forward, backward 1 ``r`` times as long."""
    kept = phases["forward1"] + backward1_ratio * phases["backward1"] + phases["backward2"]
    return kept / sum(phases.values())


def _same_run_keep(rows: list[ReportRow], row: ReportRow) -> ReportRow | None:
    """The ``keep`` row of ``row``'s backend, sync_grads and world size."""
    return next((r for r in rows if r.backend == row.backend and r.mode == "keep"
                 and r.sync_grads == row.sync_grads and r.world_size == row.world_size), None)


def add_probe_comparisons(rows: list[ReportRow]) -> None:
    """Probe rows: backward 1 against the full backward of the same loss (the ``keep``
    row of the same backend and sync_grads, timed in the same run), and that ratio
    projected onto the H200 step profile."""
    for row in rows:
        if row.mode != "probe":
            continue
        row.probe_backward_ratio = row.projected_h200_step_ratio = None
        full = _same_run_keep(rows, row)
        if full is None or not (row.backward1_time_s and full.backward1_time_s):
            continue
        ratio = row.backward1_time_s / full.backward1_time_s
        row.probe_backward_ratio = ratio
        row.projected_h200_step_ratio = projected_step_ratio(ratio)


def add_check_comparisons(rows: list[ReportRow]) -> None:
    """Check rows: step time against the ``keep`` row of the same backend and
    sync_grads (the same options without ``check_saved_tensors``), same run."""
    for row in rows:
        if row.mode != "check":
            continue
        row.check_cost_ratio = None
        keep = _same_run_keep(rows, row)
        if keep is not None and row.step_time_s and keep.step_time_s:
            row.check_cost_ratio = row.step_time_s / keep.step_time_s


def add_one_pass_comparisons(rows: list[ReportRow]) -> None:
    """``one_pass`` rows: step time against the ``one_backward`` row of the same backend
    and run (the same step without the library)."""
    for row in rows:
        if row.mode != "one_pass":
            continue
        row.one_pass_ratio = None
        plain = next((r for r in rows if r.mode == "one_backward" and r.backend == row.backend
                      and r.world_size == row.world_size and r.ok), None)
        if plain is not None and row.step_time_s and plain.step_time_s:
            row.one_pass_ratio = row.step_time_s / plain.step_time_s


def add_recipe_comparisons(rows: list[ReportRow]) -> None:
    """``fsdp2_recipe`` rows: the step time of each library row of one forward per step
    with the same sync_grads (``last``: against the recipe with gradient sync off for
    backward 1), same backend and run, over the recipe's."""
    for row in rows:
        if row.mode != RECIPE:
            continue
        row.library_time_ratios = None
        if not row.step_time_s:
            continue
        ratios = {
            r.label: r.step_time_s / row.step_time_s for r in rows
            if MODES[r.mode].block is not None and MODES[r.mode].step is None
            and r.backend == row.backend and r.sync_grads == row.sync_grads
            and r.world_size == row.world_size and r.step_time_s
        }
        row.library_time_ratios = ratios or None


def add_comparisons(rows: list[ReportRow], unsharded_bytes: int) -> None:
    """Fills savings and overheads against the ``two_forward`` row of each backend."""
    for row in rows:
        base = next((r for r in rows if r.backend == row.backend
                     and r.mode == "two_forward" and r.world_size == row.world_size), None)
        row.time_ratio = row.saved_time_s = row.ideal_saving_s = None
        row.share_of_ideal_saving = None
        row.memory_overhead_bytes = row.memory_bound_bytes = None
        row.memory_bound = row.within_bound = None
        if base is None or not base.ok or not row.ok:
            continue
        if row.step_time_s is not None and base.step_time_s:
            saved = base.step_time_s - row.step_time_s
            ideal = base.forward2_time_s
            row.time_ratio = row.step_time_s / base.step_time_s
            row.saved_time_s = saved
            row.ideal_saving_s = ideal
            row.share_of_ideal_saving = saved / ideal if ideal else None
        if row.peak_bytes is not None and base.peak_bytes is not None:
            overhead = row.peak_bytes - base.peak_bytes
            bound, why = memory_bound(row, base.peak_bytes, unsharded_bytes)
            row.memory_overhead_bytes = overhead
            row.memory_bound_bytes = bound
            row.memory_bound = why or None
            row.within_bound = None if bound is None else overhead <= bound


def config_dict(cfg: ReportConfig, world: int, meta: dict, device) -> dict[str, Any]:
    import torch

    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    dims = cfg.dims()
    out = {
        "command": cfg.command,
        "backends": list(cfg.backends),
        "modes": list(cfg.modes),
        "device": str(device.type),
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                        else f"cpu ({os.cpu_count()} cores)"),
        "process_group": ("fake" if cfg.simulate_world_size
                          else "nccl" if device.type == "cuda" else "gloo"),
        "world_size": world,
        "node_size": cfg.node_size,
        **({"fsdp1_sharding": cfg.fsdp1_sharding} if "fsdp1" in cfg.backends else {}),
        "simulated": bool(cfg.simulate_world_size),
        "dtype": cfg.dtype,
        "size": None if cfg.model_config else cfg.size,
        "model_config": cfg.model_config,
        "model": f"{meta.get('model_class', 'Qwen2ForCausalLM')} (random weights)",
        **{k: dims[k] for k in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab")},
        "tie_word_embeddings": dims["tie"],
        "seq_len": dims["seq_len"],
        "batch_per_rank": dims["batch"],
        "param_count": meta.get("param_count"),
        "unsharded_param_bytes": meta.get("unsharded_param_bytes"),
        "unit_bytes": meta.get("unit_bytes"),
        **({"ddp": ddp_setup(cfg.ddp_bucket_cap_mb)} if "ddp" in cfg.backends else {}),
        "activation_checkpointing": cfg.activation_checkpointing,
        **({"compile_layers": cfg.compile_layers} if cfg.compile_layers else {}),
        "backwards_per_step": BACKWARDS,
        "warmup_steps": cfg.warmup,
        "timed_steps": 0 if cfg.simulate_world_size else cfg.steps,
        "optimizer": "SGD(lr=1e-5)",
        "torch": torch.__version__,
        "transformers": tf_version,
        "python": sys.version.split()[0],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    return out


def finish(cfg: ReportConfig, rows: list[ReportRow], meta: dict, world: int, device) -> dict:
    """Compares the rows, writes the files; returns what ``report.json`` holds."""
    add_comparisons(rows, meta.get("unsharded_param_bytes") or 0)
    add_probe_comparisons(rows)
    add_check_comparisons(rows)
    add_one_pass_comparisons(rows)
    add_recipe_comparisons(rows)
    report = Report(config_dict(cfg, world, meta, device), rows)
    paths = write_report(report, Path(cfg.out))
    if not cfg.simulate_world_size:
        print(paths["md_text"], flush=True)
    say("wrote " + ", ".join(str(p) for k, p in paths.items() if k != "md_text"))
    if cfg.simulate_world_size:
        print(render_fit_table(report), flush=True)
    if cfg.gpu_memory:
        from ._fit import render_budget_fit

        fit = "\n".join(render_budget_fit(report.to_json(), size) for size in cfg.gpu_memory)
        (Path(cfg.out) / "budget_fit.md").write_text(fit)
        print(fit, flush=True)
    return report.to_json()
