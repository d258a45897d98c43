"""Simulated steps side by side: each in a child forked from the process that built the
model under fake tensors (``fit``'s budgets, a simulated report's modes).

A child starts from the parent's state as it was at the fork, so every step starts from
the same model: the peaks are those of steps run one after the other from a fresh build
(``tests/report/test_report_fit.py`` checks ``fit``'s against the report's byte for byte).
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection, wait
from typing import Any


def can_fork() -> bool:
    return "fork" in multiprocessing.get_all_start_methods()


def default_jobs() -> int:
    """The CPUs this process may use, at most 4."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return min(cpus or 1, 4)


@contextmanager
def frozen() -> Iterator[None]:
    """The parent's objects out of the collector's walks while children run: the forks
    share the model's pages, which a collection would copy."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # fake tensors compute nothing; no thread pool to fork
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        torch.set_num_threads(threads)


def _child(fn: Callable[..., Any], args: tuple, conn: Connection) -> None:
    try:
        conn.send((fn(*args), None))
    except BaseException as exc:  # noqa: BLE001 - the parent raises it
        conn.send((None, str(exc)))
    finally:
        conn.close()


class Forks:
    """Up to ``jobs`` calls at once, each in a child forked from this process; a call's
    result comes back pickled."""

    def __init__(self, jobs: int) -> None:
        self.jobs = max(1, jobs)
        self.context = multiprocessing.get_context("fork")
        self.running: dict[Connection, tuple[Any, float]] = {}  # its pipe -> (process, start)

    def free(self) -> bool:
        return len(self.running) < self.jobs

    def start(self, fn: Callable[..., Any], *args: Any) -> Connection:
        receive, send = self.context.Pipe(duplex=False)
        process = self.context.Process(target=_child, args=(fn, args, send), daemon=True)
        process.start()
        send.close()
        self.running[receive] = (process, time.monotonic())
        return receive

    def wait(self) -> list[tuple[Connection, Any, float]]:
        """The calls that ended: ``(handle, result, seconds)``; raises ``RuntimeError`` for
        one that raised or whose process died."""
        done = []
        for conn in wait(list(self.running)):
            assert isinstance(conn, Connection)
            process, began = self.running.pop(conn)
            try:
                result, error = conn.recv()
            except EOFError:
                result, error = None, f"the simulating process died (exit code {process.exitcode})"
            process.join()
            conn.close()
            if error is not None:
                raise RuntimeError(error)
            done.append((conn, result, time.monotonic() - began))
        return done

    def stop(self) -> None:
        for conn, (process, _) in self.running.items():
            process.kill()
            process.join()
            conn.close()
        self.running.clear()
