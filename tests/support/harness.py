"""Run many distributed test cases inside one multi-process launch (CPU, gloo).

A cases module registers functions with ``@registry.case``; pytest launches
all ranks once per world size for every cases module of the session (``launch``:
starting ranks costs seconds, importing torch and transformers; the ranks are forks of
a process that imported them once, tests/support/rank_start.py), every
rank runs every case in order with a barrier after each, and each case becomes
one pytest test that fails with every rank's traceback and output tail. When
pytest selects some of the cases (``-k``, node ids, ``--deselect``), the launch
runs only those. A module that must not share its ranks passes ``isolated=True``.

A test file is a docstring saying what its cases cover, then::

    from tests.support.harness import case_tests

    case_tests(globals(), "tests.fsdp2.cases_fsdp2", {"test_fsdp2": (2, 600)})
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import faulthandler
import gc
import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

from tests.support.rank_start import start_ranks

ROOT = Path(__file__).resolve().parents[2]
BACKEND_ENV = "FSDP_RETAIN_TEST_BACKEND"  # the ranks' process group: gloo (default) or nccl


class CaseSkipped(Exception):
    """Raised (``skip_case``) by a case that needs what this machine lacks, a CPU feature
    the library under test asks for: its test is skipped, with the reason."""


def skip_case(reason: str) -> None:
    """Skips the running case on this rank; every rank must skip it (the same check)."""
    raise CaseSkipped(reason)


@dataclasses.dataclass
class Case:
    name: str
    fn: Callable[[], None]
    world_sizes: tuple[int, ...]


class Registry:
    def __init__(self) -> None:
        self.cases: dict[str, Case] = {}

    def case(self, name: str | None = None, *, world_sizes: tuple[int, ...] = (2,)):
        def register(fn: Callable[[], None]) -> Callable[[], None]:
            case_name = name or fn.__name__
            if case_name in self.cases:
                raise ValueError(f"duplicate case name {case_name!r}")
            self.cases[case_name] = Case(case_name, fn, world_sizes)
            return fn

        return register

    def add(self, name: str, fn: Callable[[], None], *, world_sizes=(2,)) -> None:
        self.case(name, world_sizes=world_sizes)(fn)

    def names(self, world_size: int) -> list[str]:
        return [c.name for c in self.cases.values() if world_size in c.world_sizes]


@dataclasses.dataclass
class LaunchResult:
    world_size: int
    returncodes: list[int | None]
    per_rank: list[dict[str, dict]]  # rank -> case name -> {"ok", "error", "seconds"}
    outputs: list[str]
    timed_out: bool

    def output_tail(self, chars: int = 4000) -> str:
        parts = []
        for rank, out in enumerate(self.outputs):
            parts.append(f"----- rank {rank} (exit {self.returncodes[rank]}) -----")
            parts.append(out[-chars:])
        return "\n".join(parts)


EXIT_ABORT = "terminate called without an active exception"


def run_retrying_exit_abort(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run`` (output captured as text), again (up to 3 runs) only when it
    ended in gloo's exit-time abort: a rank killed at interpreter exit after the script's
    own checks passed. That abort is torch's (docs/limits.md), and on a loaded machine two
    in a row were seen; any other failure is final.
    """
    for _ in range(3):
        proc = subprocess.run(args, capture_output=True, text=True, **kwargs)
        if proc.returncode == 0 or EXIT_ABORT not in proc.stdout + proc.stderr:
            break
    return proc


def timeout_scale() -> float:
    return float(os.environ.get("FSDP_RETAIN_TIMEOUT_SCALE", "1"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(
    module: str,
    world_size: int = 2,
    *,
    timeout: float = 600,
    cases: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> LaunchResult:
    """Spawns ``world_size`` ranks that run the cases of ``module``; returns their results.

    ``FSDP_RETAIN_TIMEOUT_SCALE`` (default 1) multiplies ``timeout``, for busy machines.
    """
    if cases is None:
        cases = importlib.import_module(module).registry.names(world_size)
    result = launch_cases([(module, name) for name in cases], world_size, timeout=timeout,
                          env=env)
    prefix = f"{module}:"
    result.per_rank = [{key.removeprefix(prefix): entry for key, entry in entries.items()}
                       for entries in result.per_rank]
    return result


LAUNCH_LOG_ENV = "FSDP_RETAIN_LAUNCH_LOG"  # CI counts rank launches here (.ci/run)


def record_launch(what: str, world_size: int, seconds: float, setup: float | None = None) -> None:
    """One line per rank launch in ``$FSDP_RETAIN_LAUNCH_LOG``, where it is set: its
    world size, wall time, the part of it before the first case ran (``setup``: starting
    the ranks, imports, the process group; ``-`` where unknown), and what it ran."""
    path = os.environ.get(LAUNCH_LOG_ENV)
    if path:
        before = "-" if setup is None else f"{setup:.1f}"
        with open(path, "a") as log:
            log.write(f"{world_size} {seconds:.1f} {before} {what}\n")


@contextlib.contextmanager
def recorded_launch(what: str, world_size: int) -> Iterator[None]:
    """``record_launch`` for a launch that is not a cases launch (an example's ranks)."""
    start = time.monotonic()
    try:
        yield
    finally:
        record_launch(what, world_size, time.monotonic() - start)


def launch_cases(
    cases: list[tuple[str, str]],
    world_size: int = 2,
    *,
    timeout: float = 600,
    env: dict[str, str] | None = None,
) -> LaunchResult:
    """Spawns ``world_size`` ranks that run ``cases`` ((module, case) pairs, in order,
    from any number of cases modules); the results are keyed ``"module:case"``."""
    started = time.monotonic()
    timeout *= timeout_scale()
    workdir = Path(tempfile.mkdtemp(prefix="fsdp_retain_launch_"))
    port = _free_port()
    cases_file = workdir / "cases.txt"  # a file: a whole suite's names pass 128 KiB
    cases_file.write_text("".join(f"{module}:{name}\n" for module, name in cases))
    envs, logs = [], []
    for rank in range(world_size):
        rank_env = dict(os.environ)
        rank_env.update(env or {})
        rank_env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            PYTHONPATH=os.pathsep.join(
                [str(ROOT)] + [p for p in [rank_env.get("PYTHONPATH")] if p]
            ),
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
        )
        envs.append(rank_env)
        logs.append(open(workdir / f"rank{rank}.log", "w+"))
    # Forks of a process that imported the cases modules once (tests/support/rank_start.py),
    # each as `python -m tests.support.harness --out ... --cases ...` would start.
    procs = start_ranks(envs, str(ROOT), [log.name for log in logs],
                        ["--out", str(workdir), "--cases", str(cases_file)],
                        list(dict.fromkeys(module for module, _ in cases)))
    deadline = time.monotonic() + timeout
    timed_out = False
    for proc in procs:
        remaining = deadline - time.monotonic()
        try:
            proc.wait(timeout=max(remaining, 0.1))
        except subprocess.TimeoutExpired:
            timed_out = True
            break
    if timed_out:
        for proc in procs:  # each rank's Python stack into its log, then kill
            if proc.poll() is None:
                proc.send_signal(signal.SIGUSR1)
        time.sleep(2)
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    per_rank = []
    for rank in range(world_size):
        path = workdir / f"results_rank{rank}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        per_rank.append(dict(json.loads(line) for line in lines))
    shutil.rmtree(workdir, ignore_errors=True)
    wall = time.monotonic() - started
    in_cases = sum(entry.get("seconds", 0.0) for entry in per_rank[0].values()) if per_rank else 0
    modules = ",".join(sorted({module for module, _ in cases}))
    record_launch(f"cases {modules} ({len(cases)} cases)", world_size, wall, wall - in_cases)
    return LaunchResult(
        world_size, [p.returncode for p in procs], per_rank, outputs, timed_out
    )


def check_case(result: LaunchResult, name: str) -> None:
    """Fails (with every rank's error and output) unless ``name`` passed on all ranks;
    skips it (pytest) where every rank skipped it (``skip_case``)."""
    problems = []
    skipped = [cases.get(name, {}).get("skipped") for cases in result.per_rank]
    if all(skipped):
        import pytest

        pytest.skip(skipped[0])
    if any(skipped):
        problems.append(f"skipped on some ranks only: {skipped}")
    for rank, cases in enumerate(result.per_rank):
        entry = cases.get(name)
        if entry is None:
            problems.append(f"rank {rank}: case did not run")
        elif not entry["ok"]:
            problems.append(f"rank {rank}:\n{entry['error']}")
    if problems:
        why = " (launch timed out)" if result.timed_out else ""
        raise AssertionError(
            f"case {name!r} failed{why}\n"
            + "\n".join(problems)
            + "\n\n"
            + result.output_tail()
        )


def case_tests(
    namespace: dict, module: str, launches: dict[str, tuple[int, float]],
    *, isolated: bool = False,
) -> None:
    """Defines the tests of a cases module in a test file's ``namespace`` (its ``globals()``).

    For each ``test_name: (world_size, timeout)`` in ``launches``: ``test_name``,
    parametrized over the cases of ``module`` for that world size (ids
    ``test_name[case]``), each checking one case. The selected cases run in the
    session's one launch for ``world_size`` (every cases module's, one after another;
    ``timeout`` seconds added to its limit), or in a launch of their own with
    ``isolated=True``. A launch runs the cases that pytest selected: all of them in a
    full run, one for ``pytest tests/fsdp2/test_fsdp2.py -k some_case``.

    Example::

        case_tests(globals(), "tests.fsdp1.cases_fsdp1", {
            "test_fsdp1_ws2": (2, 900),
            "test_fsdp1_ws1": (1, 300),
        })
    """
    for test_name, (world_size, timeout) in launches.items():
        spec = _LaunchSpec(module, world_size, timeout, isolated)
        _define_case_test(namespace, test_name, spec)


@dataclasses.dataclass(frozen=True)
class _LaunchSpec:
    module: str
    world_size: int
    timeout: float
    isolated: bool

    def group(self) -> tuple:
        """Tests with the same group share one launch."""
        return (self.module if self.isolated else "shared", self.world_size)


# One launch per group and pytest session, made when the group's first test runs.
_LAUNCHED: dict[tuple, LaunchResult] = {}
_SHARED_TIMEOUT_CAP = 2400.0  # seconds (before FSDP_RETAIN_TIMEOUT_SCALE), a hang's cost


def _launch_group(session, spec: _LaunchSpec) -> LaunchResult:
    key = (id(session), *spec.group())
    if key not in _LAUNCHED:
        # The items left once collection is done (-k, node ids, --deselect, --lf), each
        # module's cases in its registry's order, modules in the order pytest met them.
        selected: dict[str, set[str]] = {}
        timeouts: dict[str, float] = {}
        for item in session.items:
            other = getattr(getattr(item, "function", None), "harness_spec", None)
            if other is None or other.group() != spec.group():
                continue
            selected.setdefault(other.module, set()).add(item.callspec.params["name"])
            timeouts[other.module] = other.timeout
        cases = [(module, name) for module, names in selected.items()
                 for name in importlib.import_module(module).registry.names(spec.world_size)
                 if name in names]
        timeout = min(sum(timeouts.values()), max(_SHARED_TIMEOUT_CAP, *timeouts.values()))
        _LAUNCHED[key] = _launch_resuming(cases, spec.world_size, timeout)
    return _LAUNCHED[key]


def _launch_resuming(cases: list[tuple[str, str]], world_size: int,
                     timeout: float) -> LaunchResult:
    """``launch_cases``; when a rank died (a crash, not the time limit), the cases that
    no rank started run again in a fresh launch, once: a shared launch must not turn one
    crashing case into hundreds of failures. The case that crashed keeps its failure."""
    result = launch_cases(cases, world_size, timeout=timeout)
    started = set().union(*result.per_rank)
    rest = [c for c in cases if f"{c[0]}:{c[1]}" not in started]
    if not rest or result.timed_out or not started:
        return result
    again = launch_cases(rest, world_size, timeout=timeout)
    for mine, theirs in zip(result.per_rank, again.per_rank):
        mine.update(theirs)
    # The crash last, where output_tail shows it; the exit codes are the crash's too.
    result.outputs = [f"{b}\n----- the launch before the relaunch of the {len(rest)} cases "
                      f"no rank had started -----\n{a}"
                      for a, b in zip(result.outputs, again.outputs)]
    return result


def _define_case_test(namespace: dict, test_name: str, spec: _LaunchSpec) -> None:
    import pytest  # here, not at the top: the ranks import this module too

    names = importlib.import_module(spec.module).registry.names(spec.world_size)

    @pytest.mark.parametrize("name", names)
    def test(request, name: str) -> None:
        check_case(_launch_group(request.session, spec), f"{spec.module}:{name}")

    test.__name__ = test.__qualname__ = test_name
    test.harness_spec = spec
    test.harness_launch = (spec.module, spec.world_size)  # for scripts/select_subset.py
    test.__module__ = namespace["__name__"]
    namespace[test_name] = test


def _worker(out: Path, cases: list[tuple[str, str]]) -> int:
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    # Known noise: CommDebugMode's module tracker, and FSDP2 on Linear outputs.
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    warnings.filterwarnings("ignore", message=".*returned a view tensor")
    # scripts/gpu_validate.py runs device-aware cases on NCCL, one GPU per rank.
    backend = os.environ.get(BACKEND_ENV, "gloo")
    if backend == "nccl":
        import torch

        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    measure = _Measure(rank, dist.get_world_size())
    results: dict[str, dict] = {}
    path = out / f"results_rank{rank}.jsonl"  # a line per case: [key, result]
    # The cases modules imported before the first case (torch, transformers, DeepSpeed:
    # up to 15 s), so the launch log counts them as set-up, not as the first case's time.
    # One that fails to import is left to its cases, which report the error.
    for module in dict.fromkeys(module for module, _ in cases):
        try:
            importlib.import_module(module)
        except BaseException:  # noqa: BLE001 - reported by each of its cases below
            pass
    for module, name in cases:
        key = f"{module}:{name}"
        measure.case(module, name)
        # Whatever outlived the cases before (imported modules, above all) is frozen out
        # of later collections: a case's gc.collect() or gc.get_objects() (leak checks,
        # DeepSpeed's engine set-up) walks the case's own objects, not the whole launch's.
        gc.collect()
        gc.freeze()
        start = time.perf_counter()
        print(f"[rank {rank}] case {key} ...", flush=True)
        try:
            case = importlib.import_module(module).registry.cases[name]
            case.fn()
            results[key] = {"ok": True, "error": None}
        except CaseSkipped as exc:
            results[key] = {"ok": True, "error": None, "skipped": str(exc)}
            print(f"[rank {rank}] case {key} skipped: {exc}", flush=True)
        except BaseException:  # noqa: BLE001 - report everything, keep going
            results[key] = {"ok": False, "error": traceback.format_exc()}
            print(results[key]["error"], flush=True)
        results[key]["seconds"] = round(time.perf_counter() - start, 3)
        measure.record(module, name, results[key]["seconds"])
        with path.open("a") as f:
            f.write(json.dumps([key, results[key]]) + "\n")
        try:
            dist.barrier()
        except Exception:  # noqa: BLE001 - a peer failed; stop here
            print(f"[rank {rank}] barrier after {key} failed:\n{traceback.format_exc()}",
                  flush=True)
            return 1
    measure.stop()
    dist.destroy_process_group()
    return 0


class _Measure:
    """Rank 0's record of each case, for choosing what CI runs (scripts/select_subset.py):
    its seconds under ``FSDP_RETAIN_CASE_TIMES`` (a JSON-lines file), and the library
    lines it ran under ``FSDP_RETAIN_COVERAGE`` (a directory of coverage data, one
    context per case). Both unset: nothing.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.world_size = world_size
        self.times = os.environ.get("FSDP_RETAIN_CASE_TIMES") if rank == 0 else None
        self.cov = None
        cov_dir = os.environ.get("FSDP_RETAIN_COVERAGE")
        if cov_dir and rank == 0:
            import coverage

            self.cov = coverage.Coverage(
                data_file=str(Path(cov_dir) / ".coverage"), data_suffix=True,
                source=[str(ROOT / "fsdp_retain")],
            )
            self.cov.start()

    def _label(self, module: str, name: str) -> str:
        return f"{module}:ws{self.world_size}:{name}"

    def case(self, module: str, name: str) -> None:
        if self.cov is not None:
            self.cov.switch_context(self._label(module, name))

    def record(self, module: str, name: str, seconds: float) -> None:
        if self.times:
            with open(self.times, "a") as f:
                f.write(json.dumps({"case": self._label(module, name), "seconds": seconds})
                        + "\n")

    def stop(self) -> None:
        if self.cov is not None:
            self.cov.stop()
            self.cov.save()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--cases", required=True, type=Path, help="a file: module:case lines")
    args = parser.parse_args()
    # A crashing rank, or one the launch times out (SIGUSR1), leaves its Python
    # stack in its log.
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    cases = [tuple(c.rsplit(":", 1)) for c in args.cases.read_text().split()]
    return _worker(args.out, cases)  # type: ignore[arg-type]


if __name__ == "__main__":
    # The ranks run this file as __main__: run it from tests.support.harness, the module the
    # cases import, so that their CaseSkipped is the class _worker catches.
    from tests.support.harness import main as harness_main

    sys.exit(harness_main())
