"""One backend on one rank: build the model, then warm up, time, count and measure every mode."""

from __future__ import annotations

import gc
import os
import statistics
import time
import traceback
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

from ._config import ReportConfig
from ._hooks import NO_HOOKS, TimeHooks
from ._fit import unit_bytes
from ._model import build_model, decoder_layers, device_mesh, fsdp_units, make_batch, param_bytes, wrap
from ._modes import MARKED_MODES, Mode
from ._run_measures import StepMeasures, short_error
from ._step import train_step

TRACEBACKS_ENV = "FSDP_RETAIN_REPORT_TRACEBACKS"  # set to print each failure's traceback
NOT_APPLICABLE = "n/a"  # the error of a row whose mode is not applicable on its backend
_start = time.monotonic()  # system-wide on Linux: child processes may share it


def say(message: str) -> None:
    print(f"[report {time.monotonic() - _start:6.0f}s] {message}", flush=True)


def started() -> float:
    return _start


def start_clock(start: float) -> None:
    """Times ``say`` from ``start`` (a ``time.monotonic()`` of the parent process)."""
    global _start
    _start = start


class BackendRun(StepMeasures):
    """Builds the model once per backend (again after a failure) and runs every mode;
    what one step measures (collectives, memory) is ``StepMeasures``'."""

    def __init__(self, cfg: ReportConfig, backend: str, device, rank: int, world: int,
                 *, mesh=None, single_process: bool = False) -> None:
        self.cfg, self.backend, self.device = cfg, backend, device
        self.rank, self.world = rank, world
        self.mesh = mesh  # given when simulating: it cannot be made under fake tensors
        self.single_process = single_process
        self.modes = cfg.mode_list()
        self.results: dict[str, dict[str, Any]] = {
            m.label: {"error": None, "times": [], "forward2_times": [],
                           "backward1_times": []} for m in self.modes
        }
        self.model: Any = None
        self.optimizer: Any = None
        self.batch = make_batch(cfg, rank, device)
        self.meta: dict[str, Any] = {}
        self.rebuilt = False  # the model was rebuilt after a failure

    # bookkeeping
    def log(self, message: str) -> None:
        if self.rank == 0:
            say(f"{self.backend} {message}")

    def sync(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)

    def agree(self, error: str | None) -> str | None:
        """The first rank's error, if any rank had one (all ranks get the same answer)."""
        import torch.distributed as dist

        if self.single_process:
            return error
        errors: list[str | None] = [None] * self.world
        dist.all_gather_object(errors, error)
        for rank, err in enumerate(errors):
            if err:
                return err if self.world == 1 else f"rank {rank}: {err}"
        return None

    def build(self) -> None:
        import torch

        self.model = self.optimizer = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # after an out-of-memory failure
        model = build_model(self.cfg, self.device)
        self.meta.setdefault("model_class", type(model).__name__)
        self.meta.setdefault("param_count", sum(p.numel() for p in model.parameters()))
        self.meta.setdefault("unsharded_param_bytes", param_bytes(model))
        self.meta.setdefault("unit_bytes", unit_bytes(model, decoder_layers(model)))
        if self.backend == "deepspeed":
            from ._deepspeed import build_engine, gathered_units

            self.model, self.optimizer = build_engine(model, self.cfg.dtype)
            self.meta.setdefault("fsdp_units", gathered_units(self.model))
            return
        mesh = self.mesh
        if mesh is None:
            mesh = device_mesh(self.cfg, self.backend, self.device.type, self.world)
        self.model = wrap(model, self.backend, self.device, mesh,
                          bucket_cap_mb=self.cfg.ddp_bucket_cap_mb,
                          compile_layers=self.cfg.compile_layers)
        if self.backend != "ddp":  # DDP's buckets are counted after a step (``count``)
            self.meta["fsdp_units"] = fsdp_units(self.model, self.backend)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-5)

    @property
    def unsharded(self) -> int:
        """The model's unsharded parameter bytes (what budget modes take a fraction of)."""
        return self.meta["unsharded_param_bytes"]

    def fail(self, mode: Mode, error: str, where: str) -> None:
        self.rebuilt = True
        self.results[mode.label]["error"] = f"{where}: {error}"
        hint = "" if os.environ.get(TRACEBACKS_ENV) else f" (tracebacks: {TRACEBACKS_ENV}=1)"
        self.log(f"{mode.label}: FAILED in {where}: {error}{hint}")
        self.build()  # the failed step may have left FSDP mid-backward

    def ok_modes(self) -> list[Mode]:
        return [m for m in self.modes if self.results[m.label]["error"] is None]

    def guarded(self, mode: Mode, where: str, fn: Callable[[], None]) -> bool:
        error = None
        try:
            fn()
        except Exception:  # noqa: BLE001 - a mode's failure is a result
            error = short_error()
            if os.environ.get(TRACEBACKS_ENV):
                traceback.print_exc()
        error = self.agree(error)
        if error is not None:
            self.fail(mode, error, where)
            return False
        return True

    # phases
    def run(self) -> None:
        try:
            self.build()
        except Exception:  # noqa: BLE001 - every row records it
            error = self.agree(short_error())
            for mode in self.modes:
                self.results[mode.label]["error"] = f"setup: {error}"
            self.log(f"setup FAILED: {error}")
            return
        units = ("DDP (nothing sharded)" if self.backend == "ddp"
                 else f"{self.meta['fsdp_units']} FSDP units")
        self.log(f"{units}, {self.meta['param_count'] / 1e6:.1f}M params, world size {self.world}")
        for mode in self.modes:
            why = mode.spec.not_applicable.get(self.backend)
            if why is not None:
                self.results[mode.label]["error"] = f"{NOT_APPLICABLE} on {self.backend}: not run"
                self.log(f"{mode.label}: n/a ({why})")
        for mode in self.ok_modes():
            self.log(f"{mode.label}: {self.cfg.warmup} warm-up step(s)")
            if not self.guarded(mode, "warm-up",
                                partial(self.steps, mode, max(self.cfg.warmup, 1))):
                continue
            if self.backend == "ddp":
                self.guarded(mode, "replica check", partial(self.check_replicas, mode))
        self.time_modes()
        for mode in self.ok_modes():
            self.log(f"{mode.label}: counting collectives")
            self.guarded(mode, "counting", partial(self.count, mode))
        for mode in self.ok_modes():
            self.log(f"{mode.label}: measuring memory")
            self.guarded(mode, "memory", partial(self.memory, mode))

    def steps(self, mode: Mode, n: int) -> None:
        for _ in range(n):
            train_step(self.model, self.optimizer, self.batch, mode, unsharded_bytes=self.unsharded)

    def check_replicas(self, mode: Mode) -> None:
        """DDP: one step whose gradients must be the same on every rank (``ReplicaCheck``)."""
        from ._ddp import ReplicaCheck

        train_step(self.model, ReplicaCheck(self.optimizer, self.model), self.batch, mode,
                   unsharded_bytes=self.unsharded)

    def time_modes(self) -> None:
        """Round-robin over the modes so that load changes hit all of them alike."""
        plain = [(m, False) for m in self.ok_modes()]
        marked = [(m, True) for m, _ in plain if m.name in MARKED_MODES]
        entries = plain + marked
        if self.rebuilt:  # modes warmed up before the rebuild need one more step
            self.log("one more untimed step per mode (the model was rebuilt)")
            for mode, _ in plain:
                self.guarded(mode, "warm-up", partial(self.steps, mode, 1))
        self.log(f"timing {self.cfg.steps} interleaved steps of {len(plain)} mode(s)")
        for step in range(self.cfg.steps):
            for mode, with_marks in list(entries):
                if self.results[mode.label]["error"] is not None:
                    continue
                error = None
                try:
                    self.timed_step(mode, with_marks)
                except Exception:  # noqa: BLE001
                    error = short_error()
                error = self.agree(error)
                if error is not None:
                    self.fail(mode, error, "timing")
            if self.rank == 0 and (step + 1) % max(1, self.cfg.steps // 4) == 0:
                done = ", ".join(
                    f"{m.label} {1e3 * statistics.median(self.results[m.label]['times']):.1f} ms"
                    for m, _ in plain
                    if self.results[m.label]["times"]
                )
                self.log(f"  step {step + 1}/{self.cfg.steps}: median so far {done}")

    def timed_step(self, mode: Mode, with_marks: bool) -> None:
        hooks = TimeHooks(self.sync) if with_marks else NO_HOOKS
        self.sync()
        start = time.perf_counter()
        train_step(self.model, self.optimizer, self.batch, mode, hooks, self.unsharded)
        self.sync()
        elapsed = time.perf_counter() - start
        result = self.results[mode.label]
        if isinstance(hooks, TimeHooks):
            for phase in ("forward2", "backward1"):
                if f"{phase}_start" in hooks.stamps:
                    result[f"{phase}_times"].append(
                        hooks.stamps[f"{phase}_end"] - hooks.stamps[f"{phase}_start"]
                    )
        else:
            result["times"].append(elapsed)


def quiet_known_warnings() -> None:
    for message in (
        "Full backward hook is firing",
        ".*returned a view tensor",
        "FSDP is switching to use `NO_SHARD`",
        "The module hierarchy tracking maybe be messed up",
        "For backward hooks to be called, module output should be a Tensor",
        "Accessing the data pointer of FakeTensor",  # FSDP1 under --simulate-world-size
    ):
        warnings.filterwarnings("ignore", message=message)

