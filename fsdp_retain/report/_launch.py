"""Running the report: one process per rank (launched here or by torchrun), or simulated."""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ._config import MIN_TIMED_STEPS, ReportConfig
from ._deps import check_dependencies
from ._model import check_model_config
from ._results import finish, merge_ranks
from ._rows import ReportRow
from ._runner import BackendRun, quiet_known_warnings, say
from ._simulate import simulate

CONFIG_ENV = "FSDP_RETAIN_REPORT_CONFIG"


def worker(cfg: ReportConfig) -> dict | None:
    """Runs on every rank (under torchrun or as launched by ``run_report``)."""
    import torch
    import torch.distributed as dist

    quiet_known_warnings()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cfg.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.timeout))
    try:
        if cfg.steps < MIN_TIMED_STEPS and rank == 0:
            say(f"note: {cfg.steps} timed steps (< {MIN_TIMED_STEPS}): timings are rough")
        rows: list[ReportRow] = []
        meta: dict = {}
        for backend_name in cfg.backends:
            run = BackendRun(cfg, backend_name, device, rank, world)
            run.run()
            gathered: list = [None] * world
            dist.all_gather_object(gathered, run.results)
            rows += merge_ranks(cfg, backend_name, gathered, run.meta, world, False)
            meta = {**run.meta, **meta}
            del run
            gc.collect()
        report = None
        if rank == 0:
            report = finish(cfg, rows, meta, world, device)
        dist.barrier()
        return report
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(cfg: ReportConfig, world: int) -> dict:
    """Spawns ``world`` ranks of this module; rank 0 prints progress here."""
    root = str(Path(__file__).resolve().parents[2])
    port = _free_port()
    logdir = Path(tempfile.mkdtemp(prefix="fsdp_retain_report_"))
    threads = max(1, (os.cpu_count() or 1) // world)
    procs, logs = [], []
    for rank in range(world):
        env = dict(os.environ)
        env.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            PYTHONPATH=os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p]),
            PYTHONUNBUFFERED="1",
        )
        env[CONFIG_ENV] = json.dumps(dataclasses.asdict(cfg))
        if cfg.device == "cpu":
            env.setdefault("OMP_NUM_THREADS", str(threads))
        log = None if rank == 0 else open(logdir / f"rank{rank}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "fsdp_retain.report"], cwd=root, env=env,
            stdout=log, stderr=subprocess.STDOUT if log else None,
        ))
    deadline = time.monotonic() + cfg.timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    codes = [p.returncode for p in procs]
    tails = []
    for rank, log in enumerate(logs):
        if log is not None:
            log.seek(0)
            tails.append(f"----- rank {rank} (exit {codes[rank]}) -----\n{log.read()[-4000:]}")
            log.close()
    path = Path(cfg.out) / "report.json"
    if any(codes) or not path.exists():
        raise RuntimeError(f"report ranks failed (exit codes {codes})\n" + "\n".join(tails))
    return json.loads(path.read_text())


def run_report(cfg: ReportConfig) -> dict:
    """Runs the report as ``cfg`` says and returns what ``report.json`` holds.

    Launches ``cfg.nproc`` ranks itself unless it already runs as one rank
    (under ``torchrun``: then it returns the report on rank 0 and ``{}``
    elsewhere); ``cfg.simulate_world_size`` runs in this process. Raises
    ``MissingDependency``, naming the extra to install, before anything runs
    when a package the run needs is missing.

    Example::

        from fsdp_retain.report import ReportConfig, run_report

        report = run_report(ReportConfig(backends=("fsdp2",), size="tiny", out="out"))
        print([(r["label"], r["peak_bytes"]) for r in report["rows"]])
    """
    notes = check_dependencies(cfg.backends)  # raises MissingDependency
    if os.environ.get("RANK", "0") == "0":
        for note in notes:
            say(note)
    if cfg.model_config is not None:
        check_model_config(cfg)
    if cfg.simulate_world_size:
        return simulate(cfg)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        cfg.check_node_size(int(os.environ["WORLD_SIZE"]))
        return worker(cfg) or {}
    world = cfg.world_size()
    cfg.check_node_size(world)
    if world == 1:
        env = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(_free_port()))
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            return worker(cfg) or {}
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    return _launch(cfg, world)


def leave(code: int) -> None:
    """Ends a process the report owns: stdout and stderr flushed, then ``os._exit(code)``.

    [Note: the report leaves without the interpreter's teardown]
    A gloo process group that ran and was destroyed sometimes aborts its process at
    interpreter exit (``terminate called without an active exception``, SIGABRT) after
    ``destroy_process_group()`` returned and everything was written: torch's gloo threads
    torn down during finalization (docs/limits.md; seen at world size 1, and without
    fsdp_retain imported). A launched rank that wrote its part would then fail the whole
    report (``_launch`` refuses any nonzero exit), and a one-process CPU report would exit
    -6 after printing its rows. So the report's entry points (``python -m
    fsdp_retain.report``, ``scripts/memory_report.py``), whose processes are the report's
    alone, leave through here once ``main`` or the rank has returned: nothing of the report
    is skipped, only C++ teardown after it. An exception propagates as usual.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def rank_main() -> int:
    cfg = ReportConfig(**json.loads(os.environ[CONFIG_ENV]))
    worker(cfg)
    return 0
