"""Starting a launch's ranks (``harness.launch_cases``) as forks of one process that has
imported them already.

A rank started as a fresh interpreter imports torch, transformers and its cases modules
before its first case: about 4 s of CPU here, 34 launches and some 80 ranks a CI run.
Instead, the first launch of a process (a pytest session) starts a fork server
(``multiprocessing``'s ``forkserver``) that imports the harness and that launch's cases
modules once, without running a tensor op or a process group; each rank of every later
launch is a fork of it, with the environment, working directory, output file and
arguments that ``subprocess.Popen`` would have given it (the environment is replaced
whole, not merged). A rank ends with ``os._exit`` after its cases, as every
``multiprocessing`` child does: without the interpreter's teardown, where gloo sometimes
aborts after the cases passed (``EXIT_ABORT``, docs/limits.md).

What the server imported is what the harness imports before the first case anyway
(``_worker``), so a case sees the same modules either way. Environment variables that a
module reads when it is imported are read from the server's environment: the session's
at its first launch, with the harness's own (``OMP_NUM_THREADS=1``, ``PYTHONPATH``).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import subprocess
import sys

PRELOAD_ENV = "FSDP_RETAIN_RANK_PRELOAD"  # the modules tests.support.rank_preload imports

_context = multiprocessing.get_context("forkserver")


@contextlib.contextmanager
def _environment(env: dict[str, str]):
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _ensure_server(env: dict[str, str], modules: list[str]) -> None:
    """Starts the fork server, once a process, importing ``modules`` (the first launch's
    cases modules) through tests/support/rank_preload.py, which outlives a module that
    fails to import (its cases report it, as the harness does)."""
    _context.set_forkserver_preload(["tests.support.rank_preload"])
    with _environment({**env, PRELOAD_ENV: ",".join(modules)}):
        multiprocessing.forkserver.ensure_running()


def _rank(env: dict[str, str], cwd: str, log: str, argv: list[str]) -> None:
    """A rank in its fork: as ``subprocess.Popen(argv, cwd=cwd, env=env, stdout=log,
    stderr=log)`` would start ``python -m tests.support.harness``."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(write_through=True)  # as PYTHONUNBUFFERED=1
    import torch

    # The server read OMP_NUM_THREADS when it imported torch; a launch's own value wins.
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", torch.get_num_threads())))
    from tests.support.harness import main

    sys.argv = ["tests.support.harness", *argv]
    sys.exit(main())


class ForkedRank:
    """The part of ``subprocess.Popen`` that ``launch_cases`` uses, for a forked rank."""

    def __init__(self, env: dict[str, str], cwd: str, log: str, argv: list[str]) -> None:
        self._process = _context.Process(target=_rank, args=(env, cwd, log, argv))
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired("tests.support.harness", timeout or 0)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self._process.kill()


def start_ranks(envs: list[dict[str, str]], cwd: str, logs: list[str], argv: list[str],
                modules: list[str]) -> list[ForkedRank]:
    """One forked rank per environment (``envs[rank]``, output to ``logs[rank]``)."""
    _ensure_server(envs[0], modules)
    return [ForkedRank(env, cwd, log, argv) for env, log in zip(envs, logs)]
