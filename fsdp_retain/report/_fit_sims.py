"""``fit``: simulated steps in forked processes, the model built once before them.

Each simulation is one memory-tracked step (``BackendRun.memory``, what
``--simulate-world-size`` runs per mode) in a child forked from the process that built
the model under fake tensors: no rebuild, every step starts from the same state, and
up to ``jobs`` run at once. Without ``fork`` they run one after the other in this process.
"""

from __future__ import annotations

import dataclasses
import gc
import multiprocessing
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from ._config import ReportConfig
from ._fit import human_bytes
from ._fit_search import BudgetSearch
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
class FitRun:
    """What ``run_fit`` found: the model's facts (``BackendRun.meta``), the peak of each
    of ``OPTIONS`` simulated and the search, which holds the budgets' peaks and the answer."""

    meta: dict[str, Any]
    peaks: dict[str, int]
    search: BudgetSearch


def run_fit(cfg: ReportConfig, backend: str, gpu_memory: int, jobs: int,
            log: Callable[[str], None]) -> FitRun:
    """Simulates ``OPTIONS`` and the budgets ``BudgetSearch`` asks for on rank 0 of
    ``cfg.simulate_world_size``; raises ``RuntimeError`` when a step fails."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # fake tensors compute nothing; no thread pool to fork
    try:
        with simulated_rank(cfg, backend) as run:
            start = time.monotonic()
            run.build()
            log(f"{run.meta['fsdp_units']} FSDP units, {run.meta['param_count'] / 1e6:.1f}M "
                f"params ({time.monotonic() - start:.0f}s to build under fake tensors)")
            gc.freeze()  # the forks share the model's pages: no collection walks (copies) them
            try:
                return _search(run, gpu_memory, jobs, log)
            finally:
                gc.unfreeze()
    finally:
        torch.set_num_threads(threads)


def _search(run: BackendRun, gpu_memory: int, jobs: int, log: Callable[[str], None]) -> FitRun:
    """Runs the options and the search's budgets, ``jobs`` at a time, until it is done."""
    search = BudgetSearch(run.meta["unit_bytes"], gpu_memory)
    peaks: dict[str, int] = {}
    todo = ["False", "True"]
    sims = _Forks(run, jobs) if "fork" in multiprocessing.get_all_start_methods() else None
    running: dict[Any, str | int] = {}  # a simulation -> its option label or budget

    def next_task() -> str | int | None:
        # False first (the search starts from it), then True; no budget until True's
        # peak is in (if it fits, no budget is needed).
        if todo:
            return todo.pop(0)
        if "True" not in peaks:
            return None
        return search.next_probe([t for t in running.values() if isinstance(t, int)])

    def record(task: str | int, peak: int, seconds: float) -> None:
        if isinstance(task, str):
            peaks[task] = peak
            budget = {"True": search.total, "False": 0}.get(task)
            if budget is not None:
                search.record(budget, peak)
            if task == "True" and peak <= gpu_memory:
                todo.append("True, last")
            name = f"keep_unsharded={task}".replace(", last", ', sync_grads="last"')
        else:
            search.record(task, peak)
            name = f"keep_unsharded={task}"
        log(f"{name}: peak {human_bytes(peak)} per rank ({seconds:.0f}s)")

    try:
        while True:
            while sims is None or sims.free():
                task = next_task()
                if task is None:
                    break
                mode = OPTIONS[task] if isinstance(task, str) else Mode(
                    "keep", "every", budget_bytes=task)
                if sims is None:
                    began = time.monotonic()
                    record(task, _peak(run, mode), time.monotonic() - began)
                else:
                    running[sims.start(mode)] = task
            if not running:
                break
            for handle, peak, seconds in sims.wait() if sims else ():
                record(running.pop(handle), peak, seconds)
    finally:
        if sims is not None:
            sims.stop()
    assert search.done() and not todo, "fit: the search stopped before its answer"
    return FitRun(dict(run.meta), peaks, search)


def _peak(run: BackendRun, mode: Mode) -> int:
    result = run.results.setdefault(mode.label, {"error": None})
    try:
        run.memory(mode)
    except Exception as exc:  # noqa: BLE001 - named with its option below
        raise RuntimeError(f"{mode.label}: the simulated step failed: {short_error()}") from exc
    return result["peak_bytes"]


def _child(run: BackendRun, mode: Mode, conn: Connection) -> None:
    try:
        conn.send((_peak(run, mode), None))
    except BaseException as exc:  # noqa: BLE001 - the parent raises it
        conn.send((None, str(exc)))
    finally:
        conn.close()


class _Forks:
    """Up to ``jobs`` simulations at once, each in a child forked from this process."""

    def __init__(self, run: BackendRun, jobs: int) -> None:
        self.run, self.jobs = run, max(1, jobs)
        self.context = multiprocessing.get_context("fork")
        self.running: dict[Connection, tuple[Any, float]] = {}  # its pipe -> (process, start)

    def free(self) -> bool:
        return len(self.running) < self.jobs

    def start(self, mode: Mode) -> Connection:
        receive, send = self.context.Pipe(duplex=False)
        process = self.context.Process(target=_child, args=(self.run, mode, send), daemon=True)
        process.start()
        send.close()
        self.running[receive] = (process, time.monotonic())
        return receive

    def wait(self) -> list[tuple[Connection, int, float]]:
        """The simulations that ended: ``(handle, peak, seconds)``; raises for a failed one."""
        done = []
        for conn in wait(list(self.running)):
            assert isinstance(conn, Connection)
            process, began = self.running.pop(conn)
            try:
                peak, error = conn.recv()
            except EOFError:
                peak, error = None, f"the simulating process died (exit code {process.exitcode})"
            process.join()
            conn.close()
            if error is not None:
                raise RuntimeError(error)
            done.append((conn, peak, time.monotonic() - began))
        return done

    def stop(self) -> None:
        for conn, (process, _) in self.running.items():
            process.kill()
            process.join()
            conn.close()
        self.running.clear()
