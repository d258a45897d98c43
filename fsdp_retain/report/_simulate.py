"""``--simulate-world-size``: per-rank memory for N ranks in one process.

A fake process group stands in for the other ranks and fake tensors for the
data, so nothing is computed and no memory is allocated; torch's memory
trackers see every allocation a rank would make.
"""

from __future__ import annotations

import gc

from ._config import ReportConfig
from ._model import make_batch
from ._modes import Mode
from ._results import finish, merge_ranks
from ._runner import BackendRun, quiet_known_warnings, say, short_error

def simulate(cfg: ReportConfig) -> dict:
    """Per-rank memory for ``cfg.simulate_world_size`` ranks, in this process."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as exc:
        raise RuntimeError(
            f"--simulate-world-size needs torch's fake process group, missing in torch "
            f"{torch.__version__}"
        ) from exc
    quiet_known_warnings()
    world = cfg.simulate_world_size
    if world is None or world < 1:
        raise ValueError(f"--simulate-world-size must be >= 1, got {world}")
    if dist.is_initialized():
        raise ValueError("--simulate-world-size runs in one process: do not use torchrun")
    device = torch.device("cpu")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    rows, meta = [], {}
    try:
        for backend in cfg.backends:
            say(f"{backend}: simulating {world} ranks with fake tensors")
            mesh = init_device_mesh("cpu", (world,))  # not under FakeTensorMode
            run = BackendRun(cfg, backend, device, 0, world, mesh=mesh, single_process=True)
            with FakeTensorMode():
                run.batch = make_batch(cfg, 0, device)
                _simulate_backend(run)
            rows += merge_ranks(cfg, backend, [run.results], run.meta, world, True)
            meta = {**run.meta, **meta}
            del run
            gc.collect()
    finally:
        dist.destroy_process_group()
    return finish(cfg, rows, meta, world, device)


def _simulate_backend(run: BackendRun) -> None:
    try:
        run.build()
        run.log(f"{run.meta['fsdp_units']} FSDP units, {run.meta['param_count'] / 1e6:.1f}M params")
        run.log("warm-up step (two_forward)")
        run.steps(Mode("two_forward"), 1)
    except Exception:  # noqa: BLE001 - every row records it
        error = short_error()
        for mode in run.modes:
            run.results[mode.label]["error"] = f"setup: {error}"
        run.log(f"setup FAILED: {error}")
        return
    for mode in run.modes:
        run.log(f"{mode.label}: measuring memory")
        run.guarded(mode, "memory", lambda m=mode: run.memory(m))

