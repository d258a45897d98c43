"""``fit``: simulated steps in forked processes, the model built once before them.

Each simulation is one memory-tracked step (``BackendRun.memory``, what
``--simulate-world-size`` runs per mode) in a child forked from the process that built
the model under fake tensors: no rebuild, every step starts from the same state, and
up to ``jobs`` run at once (``_forks.py``). Without ``fork`` they run one after the other
in this process.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from ._config import ReportConfig
from ._fit import human_bytes
from ._fit_search import BudgetSearch
from ._forks import Forks, can_fork, frozen
from ._modes import Mode
from ._runner import BackendRun, short_error
from ._simulate import simulated_rank

# The options ``fit`` shows beside the budget: label -> the mode that runs it.
# ``"True, last"`` holds what ``True`` holds and the unsharded gradients: it is
# simulated only when ``True`` fits.
OPTIONS = {
    "True": Mode("keep", "every"),
    "False": Mode("regather", "every"),
    "True, last": Mode("keep", "last"),
}


@dataclasses.dataclass
class NodeFit:
    """``--node-size``: the same search with ``reshard_to=node_size`` (the units a budget
    does not keep are resharded to one node between passes); ``peaks`` as ``FitRun``'s,
    ``"False"`` being ``keep_unsharded=False, reshard_to=node_size``. ``hybrid``: FSDP1,
    searched on a model wrapped with ``HYBRID_SHARD`` over shard groups of ``node_size``
    (every all-gather inside a node; ``reshard_to`` only checks that layout), its own
    ``"True"`` simulated."""

    node_size: int
    peaks: dict[str, int]
    search: BudgetSearch
    hybrid: bool = False


@dataclasses.dataclass
class FitRun:
    """What ``run_fit`` found: the model's facts (``BackendRun.meta``), the peak of each
    of ``OPTIONS`` simulated and the search, which holds the budgets' peaks and the answer;
    ``node``: the search with ``reshard_to`` (``--node-size``)."""

    meta: dict[str, Any]
    peaks: dict[str, int]
    search: BudgetSearch
    node: NodeFit | None = None


def run_fit(cfg: ReportConfig, backend: str, gpu_memory: int, jobs: int,
            log: Callable[[str], None], node_size: int | None = None) -> FitRun:
    """Simulates ``OPTIONS`` and the budgets ``BudgetSearch`` asks for on rank 0 of
    ``cfg.simulate_world_size`` (with ``node_size``, the budgets again with
    ``reshard_to=node_size``; on FSDP1 on a second model wrapped with ``HYBRID_SHARD``
    over shard groups of ``node_size``); raises ``RuntimeError`` when a step fails."""
    with simulated_rank(cfg, backend) as run:
        _build(run, log)
        with frozen():
            found = _search(run, gpu_memory, jobs, log)
            if node_size is not None and backend == "fsdp2":
                peaks, search = _search(run, gpu_memory, jobs, log, node_size,
                                        found.peaks["True"])
                found.node = NodeFit(node_size, peaks, search)
    if node_size is not None and backend == "fsdp1":
        hybrid = dataclasses.replace(cfg, node_size=node_size, fsdp1_sharding="HYBRID_SHARD")
        with simulated_rank(hybrid, backend) as run:
            _build(run, log, " with HYBRID_SHARD")
            with frozen():
                peaks, search = _search(run, gpu_memory, jobs, log, node_size)
        found.node = NodeFit(node_size, peaks, search, hybrid=True)
    return found


def _build(run: BackendRun, log: Callable[[str], None], how: str = "") -> None:
    start = time.monotonic()
    run.build()
    log(f"{run.meta['fsdp_units']} FSDP units, {run.meta['param_count'] / 1e6:.1f}M "
        f"params ({time.monotonic() - start:.0f}s to build{how} under fake tensors)")


def _search(run: BackendRun, gpu_memory: int, jobs: int, log: Callable[[str], None],
            reshard_to: int | None = None, true_peak: int | None = None) -> Any:
    """Runs the options and the search's budgets, ``jobs`` at a time, until it is done:
    a ``FitRun``; with ``reshard_to`` the budgets (and ``False``) with that option, next
    to ``keep_unsharded=True``'s peak (``true_peak``: keeping every unit, it reshards
    nothing), as ``(peaks, search)``."""
    # A kept unit adds its bytes less the 1/reshard_to share it holds when not kept.
    slope = 1.0 if reshard_to is None else 1 - 1 / reshard_to
    search = BudgetSearch(run.meta["unit_bytes"], gpu_memory, slope)
    peaks: dict[str, int] = {}
    todo = ["False", "True"]
    if true_peak is not None:
        todo.remove("True")
        peaks["True"] = true_peak
        search.record(search.total, true_peak)
    grouped = "" if reshard_to is None else f", reshard_to={reshard_to}"
    if run.cfg.fsdp1_sharding == "HYBRID_SHARD" and run.backend == "fsdp1":
        grouped += " (HYBRID_SHARD)"
    sims = Forks(jobs) if can_fork() else None
    running: dict[Any, str | int] = {}  # a simulation -> its option label or budget

    def next_task() -> str | int | None:
        # False first (the search starts from it), then True; no budget until True's
        # peak is in (if it fits, no budget is needed).
        if todo:
            return todo.pop(0)
        if "True" not in peaks:
            return None
        return search.next_probe([t for t in running.values() if isinstance(t, int)])

    def mode_of(task: str | int) -> Mode:
        if isinstance(task, int):
            return Mode("keep", "every", budget_bytes=task, reshard_to=reshard_to)
        if task == "False" and reshard_to is not None:
            return dataclasses.replace(OPTIONS[task], reshard_to=reshard_to)
        return OPTIONS[task]

    def record(task: str | int, peak: int, seconds: float) -> None:
        if isinstance(task, str):
            peaks[task] = peak
            budget = {"True": search.total, "False": 0}.get(task)
            if budget is not None:
                search.record(budget, peak)
            if task == "True" and peak <= gpu_memory and reshard_to is None:
                todo.append("True, last")
            name = f"keep_unsharded={task}".replace(", last", ', sync_grads="last"')
        else:
            search.record(task, peak)
            name = f"keep_unsharded={task}"
        log(f"{name}{grouped}: peak {human_bytes(peak)} per rank ({seconds:.0f}s)")

    try:
        while True:
            while sims is None or sims.free():
                task = next_task()
                if task is None:
                    break
                mode = mode_of(task)
                if sims is None:
                    began = time.monotonic()
                    record(task, _peak(run, mode), time.monotonic() - began)
                else:
                    running[sims.start(_peak, run, mode)] = task
            if not running:
                break
            for handle, peak, seconds in sims.wait() if sims else ():
                record(running.pop(handle), peak, seconds)
    finally:
        if sims is not None:
            sims.stop()
    assert search.done() and not todo, "fit: the search stopped before its answer"
    if reshard_to is not None:
        return peaks, search
    return FitRun(dict(run.meta), peaks, search)


def _peak(run: BackendRun, mode: Mode) -> int:
    result = run.results.setdefault(mode.label, {"error": None})
    try:
        run.memory(mode)
    except Exception as exc:  # noqa: BLE001 - named with its option below
        raise RuntimeError(f"{mode.label}: the simulated step failed: {short_error()}") from exc
    return result["peak_bytes"]
