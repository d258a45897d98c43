"""Subprocesses a test module starts as soon as the session's tests are collected, for a
long run that keeps to one process (the GPU kit's dry run: its stages one after another,
one rank, about a minute of CPU). Started early, it runs beside the rank launches of the
tests before it, on the core their ranks leave idle while they wait on each other; left to
its turn near the session's end, it ran alone there with a core idle (CI's last minutes).

A module registers a starter for one of its fixtures or tests (``starts_early``); the
session starts it when a selected test uses that fixture or is that test (``plan_session``,
from tests/conftest.py), and the fixture or test takes the started run (``take``) or, where
the session did not start one (asked for outside such a session), starts it then. Whatever a session started and
no test took is killed when the session ends (``stop_all``).

The session keeps ``AT_ONCE`` of them going at a time, in the order their modules were
collected (the order their tests run in), the next started as one ends: the report's runs
(2-4 ranks each, each rank about 1 GB with transformers) all at once beside the tests' own
launches would have held the memory and cores of a dozen processes. One a fixture takes
before its turn starts then.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

STARTERS: dict[str, Callable[[], BackgroundRun]] = {}
_WHEN: dict[str, str] = {}  # a starter's name -> the fixture or test function it is for
AT_ONCE = 2
_started: dict[str, _Planned] = {}
_lock = threading.Lock()


class BackgroundRun:
    """``subprocess.run(argv, capture_output=True, text=True, ...)`` started now and read
    later (``result``); its output goes to files, so a run nobody reads yet never blocks on
    a full pipe. ``payload`` is the starter's (where the run writes); ``seconds``, once read,
    how long it ran."""

    def __init__(self, argv: list[str], *, payload: Any = None, **popen: Any) -> None:
        self.argv, self.payload = argv, payload
        self._out = tempfile.TemporaryFile("w+")
        self._err = tempfile.TemporaryFile("w+")
        self.started = time.monotonic()
        self.seconds: float | None = None
        self._proc = subprocess.Popen(argv, stdout=self._out, stderr=self._err, text=True,
                                      **popen)
        self._ended: float | None = None  # when it ended, not when it was read
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        self._proc.wait()
        self._ended = time.monotonic()

    def result(self, timeout: float) -> subprocess.CompletedProcess:
        """Waits for the run (``timeout`` seconds from its start); kills it and raises
        ``subprocess.TimeoutExpired`` past that, as ``subprocess.run`` does."""
        left = max(self.started + timeout - time.monotonic(), 0.1)
        try:
            code = self._proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        self.seconds = (self._ended or time.monotonic()) - self.started
        outputs = []
        for file in (self._out, self._err):
            file.seek(0)
            outputs.append(file.read())
            file.close()
        return subprocess.CompletedProcess(self.argv, code, *outputs)

    def running(self) -> bool:
        return self._proc.poll() is None

    def kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()


class _Planned:
    """A run the session planned: started in its turn (``run`` set), or by ``take`` before
    it, or never (``dropped``: taken or stopped before its turn)."""

    def __init__(self, starter: Callable[[], BackgroundRun]) -> None:
        self.starter = starter
        self.run: BackgroundRun | None = None
        self.dropped = False


def _start_in_turn(planned: list[_Planned]) -> None:
    going: list[BackgroundRun] = []
    for plan in planned:
        while len(going := [run for run in going if run.running()]) >= AT_ONCE:
            time.sleep(0.2)
        with _lock:
            if plan.dropped:
                continue
            plan.run = plan.starter()
            going.append(plan.run)


def starts_early(name: str, *, when: str | None = None
                 ) -> Callable[[Callable[[], BackgroundRun]], Callable[[], BackgroundRun]]:
    """Registers the decorated function as the starter of the run ``take(name)`` gives:
    started once the tests are collected where a selected test uses the fixture ``when``
    or is the test function ``when`` (a test that starts a launch of its own; default:
    the fixture ``name``)."""

    def register(starter: Callable[[], BackgroundRun]) -> Callable[[], BackgroundRun]:
        STARTERS[name] = starter
        _WHEN[name] = when or name
        return starter

    return register


def plan_session(items: list) -> None:
    """Starts each registered run that a selected test (its fixtures, or itself) uses."""
    used = {name for item in items for name in getattr(item, "fixturenames", ())}
    used |= {getattr(item, "originalname", None) for item in items}
    planned = []
    for name, starter in STARTERS.items():
        if _WHEN[name] in used and name not in _started:
            _started[name] = _Planned(starter)
            planned.append(_started[name])
    if planned:
        threading.Thread(target=_start_in_turn, args=(planned,), daemon=True).start()


def take(name: str) -> BackgroundRun:
    """The run the session started for ``name``, or one started now (none planned, or
    its turn not come)."""
    plan = _started.pop(name, None)
    with _lock:
        if plan is not None and plan.run is not None:
            return plan.run
        if plan is not None:
            plan.dropped = True
        return STARTERS[name]()


@contextlib.contextmanager
def taken(name: str, timeout: float
          ) -> Iterator[tuple[subprocess.CompletedProcess, Any]]:
    """``take(name)``'s result (``timeout`` seconds from its start) and payload; the run is
    killed afterwards, and a payload that is a folder deleted."""
    run = take(name)
    try:
        yield run.result(timeout=timeout), run.payload
    finally:
        run.kill()
        if isinstance(run.payload, Path):
            shutil.rmtree(run.payload, ignore_errors=True)


def stop_all() -> None:
    with _lock:
        while _started:
            plan = _started.popitem()[1]
            plan.dropped = True
            if plan.run is not None:
                plan.run.kill()
