"""Subprocesses a test module starts as soon as the session's tests are collected, for a
long run that keeps to one process (the GPU kit's dry run: its stages one after another,
one rank, about a minute of CPU). Started early, it runs beside the rank launches of the
tests before it, on the core their ranks leave idle while they wait on each other; left to
its turn near the session's end, it ran alone there with a core idle (CI's last minutes).

A module registers a starter for one of its fixtures (``starts_early``); the session starts
it when a selected test uses that fixture (``plan_session``, from tests/conftest.py), and
the fixture takes the started run (``take``) or, where the session did not start one (a
fixture asked for outside such a session), starts it then. Whatever a session started and
no test took is killed when the session ends (``stop_all``).

The session keeps ``AT_ONCE`` of them going at a time, in the order their modules were
collected (the order their tests run in), the next started as one ends: the report's runs
(2-4 ranks each, each rank about 1 GB with transformers) all at once beside the tests' own
launches would have held the memory and cores of a dozen processes. One a fixture takes
before its turn starts then.
"""

from __future__ import annotations

import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

STARTERS: dict[str, Callable[[], BackgroundRun]] = {}
AT_ONCE = 2
_started: dict[str, _Planned] = {}
_lock = threading.Lock()


class BackgroundRun:
    """``subprocess.run(argv, capture_output=True, text=True, ...)`` started now and read
    later (``result``); its output goes to files, so a run nobody reads yet never blocks on
    a full pipe. ``payload`` is the starter's (where the run writes)."""

    def __init__(self, argv: list[str], *, payload: Any = None, **popen: Any) -> None:
        self.argv, self.payload = argv, payload
        self._out = tempfile.TemporaryFile("w+")
        self._err = tempfile.TemporaryFile("w+")
        self.started = time.monotonic()
        self.seconds: float | None = None
        self._proc = subprocess.Popen(argv, stdout=self._out, stderr=self._err, text=True,
                                      **popen)

    def result(self, timeout: float) -> subprocess.CompletedProcess:
        """Waits for the run (``timeout`` seconds from its start); kills it and raises
        ``subprocess.TimeoutExpired`` past that, as ``subprocess.run`` does."""
        left = max(self.started + timeout - time.monotonic(), 0.1)
        try:
            code = self._proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        self.seconds = time.monotonic() - self.started
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


def starts_early(fixture: str) -> Callable[[Callable[[], BackgroundRun]], Callable[[], BackgroundRun]]:
    """Registers the decorated function as ``fixture``'s starter."""

    def register(starter: Callable[[], BackgroundRun]) -> Callable[[], BackgroundRun]:
        STARTERS[fixture] = starter
        return starter

    return register


def plan_session(items: list) -> None:
    """Starts each registered run that a selected test's fixtures use."""
    used = {name for item in items for name in getattr(item, "fixturenames", ())}
    planned = []
    for fixture, starter in STARTERS.items():
        if fixture in used and fixture not in _started:
            _started[fixture] = _Planned(starter)
            planned.append(_started[fixture])
    if planned:
        threading.Thread(target=_start_in_turn, args=(planned,), daemon=True).start()


def take(fixture: str) -> BackgroundRun:
    """The run the session started for ``fixture``, or one started now (none planned, or
    its turn not come)."""
    plan = _started.pop(fixture, None)
    with _lock:
        if plan is not None and plan.run is not None:
            return plan.run
        if plan is not None:
            plan.dropped = True
        return STARTERS[fixture]()


def stop_all() -> None:
    with _lock:
        while _started:
            plan = _started.popitem()[1]
            plan.dropped = True
            if plan.run is not None:
                plan.run.kill()
