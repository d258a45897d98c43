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
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any

STARTERS: dict[str, Callable[[], BackgroundRun]] = {}
_started: dict[str, BackgroundRun] = {}


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

    def kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()


def starts_early(fixture: str) -> Callable[[Callable[[], BackgroundRun]], Callable[[], BackgroundRun]]:
    """Registers the decorated function as ``fixture``'s starter."""

    def register(starter: Callable[[], BackgroundRun]) -> Callable[[], BackgroundRun]:
        STARTERS[fixture] = starter
        return starter

    return register


def plan_session(items: list) -> None:
    """Starts each registered run that a selected test's fixtures use."""
    used = {name for item in items for name in getattr(item, "fixturenames", ())}
    for fixture, starter in STARTERS.items():
        if fixture in used and fixture not in _started:
            _started[fixture] = starter()


def take(fixture: str) -> BackgroundRun:
    """The run the session started for ``fixture``, or one started now."""
    run = _started.pop(fixture, None)
    return run if run is not None else STARTERS[fixture]()


def stop_all() -> None:
    while _started:
        _started.popitem()[1].kill()
