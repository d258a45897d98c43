"""``--simulate-world-size``: per-rank memory for N ranks, without N processes.

A fake process group stands in for the other ranks and fake tensors for the
data, so nothing is computed and no memory is allocated; torch's memory
trackers see every allocation a rank would make, and ``CommDebugMode`` (in the
same step) every collective with the size of its process group. With more than
one core, the backends after the first run in processes of their own, in parallel.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from typing import Any

from ._config import ReportConfig
from ._forks import Forks, can_fork, default_jobs, frozen
from ._model import device_mesh, make_batch
from ._modes import Mode
from ._results import finish, merge_ranks
from ._rows import ReportRow
from ._runner import BackendRun, quiet_known_warnings, say, short_error, start_clock, started


def simulate(cfg: ReportConfig) -> dict:
    """Per-rank memory for ``cfg.simulate_world_size`` ranks; writes and returns the report."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        raise ValueError("--simulate-world-size runs in one process: do not use torchrun")
    world = cfg.simulate_world_size
    assert world, "simulate() needs cfg.simulate_world_size"
    say(f"simulating {world} ranks with a fake process group and fake tensors: "
        f"{', '.join(cfg.backends)} x {len(cfg.modes)} modes")
    first, *others = cfg.backends
    helpers = min(len(others), (os.cpu_count() or 1) - 1)
    if helpers > 0:  # the other backends in other processes, the first one here
        spawn = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(helpers, mp_context=spawn, initializer=start_clock,
                                 initargs=(started(),)) as pool:
            futures = [pool.submit(_simulate_backend, cfg, backend) for backend in others]
            per_backend = [_simulate_backend(cfg, first)] + [f.result() for f in futures]
    else:
        per_backend = [_simulate_backend(cfg, backend) for backend in cfg.backends]
    rows: list[ReportRow] = []
    meta: dict[str, Any] = {}
    for backend_rows, backend_meta in per_backend:
        rows += backend_rows
        meta = {**backend_meta, **meta}
    return finish(cfg, rows, meta, world, torch.device("cpu"))


def _simulate_backend(cfg: ReportConfig, backend: str) -> tuple[list[ReportRow], dict[str, Any]]:
    """Rows and model facts of one backend, under a fake process group of this process."""
    with simulated_rank(cfg, backend) as run:
        _measure(run)
        return merge_ranks(cfg, backend, [run.results], run.meta, cfg.simulate_world_size or 1,
                           True), run.meta


@contextlib.contextmanager
def simulated_rank(cfg: ReportConfig, backend: str) -> Iterator[BackendRun]:
    """Rank 0 of ``cfg.simulate_world_size`` under a fake process group of this process,
    inside a ``FakeTensorMode`` with its batch made; ``run.build()`` builds the model."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as exc:
        raise RuntimeError(
            f"--simulate-world-size needs torch's fake process group, missing in torch "
            f"{torch.__version__}"
        ) from exc
    quiet_known_warnings()
    # A mode that fails under fake tensors is a row with its error; not a logged traceback.
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    world = cfg.simulate_world_size
    assert world
    device = torch.device("cpu")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = device_mesh(cfg, backend, "cpu", world)  # not under FakeTensorMode
        run = BackendRun(cfg, backend, device, 0, world, mesh=mesh, single_process=True)
        with FakeTensorMode():
            run.batch = make_batch(cfg, 0, device)
            yield run
    finally:
        dist.destroy_process_group()


def _measure(run: BackendRun) -> None:
    # No warm-up step: FSDP's lazy initialisation allocates nothing a tracker
    # sees, and the peaks come out the same without it.
    try:
        run.build()
    except Exception:  # noqa: BLE001 - every row records it
        error = short_error()
        for mode in run.modes:
            run.results[mode.label]["error"] = f"setup: {error}"
        run.log(f"setup FAILED: {error}")
        return
    run.log(f"{run.meta['fsdp_units']} FSDP units, {run.meta['param_count'] / 1e6:.1f}M params")
    jobs = default_jobs()
    if can_fork() and jobs > 1 and len(run.modes) > 1:
        _measure_forked(run, jobs)
        return
    for mode in run.modes:
        start = time.monotonic()
        if run.guarded(mode, "memory", partial(run.memory, mode, count=True)):
            peak = run.results[mode.label]["peak_bytes"]
            run.log(f"{mode.label}: peak {_shown(peak)} per rank ({time.monotonic() - start:.0f}s)")


def _step(run: BackendRun, mode: Mode) -> tuple[bool, dict[str, Any]]:
    """One mode's memory-tracked, counted step: whether it ran, and its results."""
    ok = run.guarded(mode, "memory", partial(run.memory, mode, count=True))
    return ok, run.results[mode.label]


def _measure_forked(run: BackendRun, jobs: int) -> None:
    """The modes' steps ``jobs`` at a time, each in a child forked from the built model
    (``_forks.py``): the same peaks and counts as one after the other."""
    todo = list(run.modes)
    running: dict[Any, Mode] = {}
    with frozen():
        forks = Forks(jobs)
        try:
            while todo or running:
                while todo and forks.free():
                    mode = todo.pop(0)
                    running[forks.start(_step, run, mode)] = mode
                for handle, (ok, result), seconds in forks.wait():
                    mode = running.pop(handle)
                    run.results[mode.label] = result
                    if ok:
                        run.log(f"{mode.label}: peak {_shown(result['peak_bytes'])} per rank "
                                f"({seconds:.0f}s)")
        finally:
            forks.stop()


def _shown(peak: int) -> str:
    return f"{peak / 2**30:.2f} GiB" if peak >= 2**30 else f"{peak / 2**20:.1f} MiB"
