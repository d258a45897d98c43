"""The report's entry points leave through ``os._exit`` once the report returned, with its
exit code and its output flushed: [Note: the report leaves without the interpreter's
teardown] (fsdp_retain/report/_launch.py). Run in this process, with ``main`` replaced
(its exit code 3) and ``os._exit`` caught: without ``leave`` the entry would raise
``SystemExit`` instead (interpreter teardown, where gloo sometimes aborts)."""

from __future__ import annotations

import runpy

import pytest

import fsdp_retain.report as report_pkg
from fsdp_retain.report import _cli, _launch

from tests.support.harness import ROOT


class Left(Exception):
    pass


def exits(monkeypatch, entry) -> list[tuple[int, bool]]:
    """Runs ``entry`` with the report's ``main`` (and the rank's) and ``os._exit`` replaced;
    the codes it left with, each with whether stdout was flushed first."""
    left: list[tuple[int, bool]] = []
    flushed: list[bool] = []

    class Out:
        def write(self, text: str) -> int:
            return len(text)

        def flush(self) -> None:
            flushed.append(True)

    def fake_exit(code: int) -> None:
        left.append((code, bool(flushed)))
        raise Left

    monkeypatch.setattr(_launch.os, "_exit", fake_exit)
    for module in (_cli, report_pkg):
        monkeypatch.setattr(module, "main", lambda *a, **k: 3)
    monkeypatch.setattr(_launch, "rank_main", lambda: 4)
    with monkeypatch.context() as patch, pytest.raises(Left):
        patch.setattr(_launch.sys, "stdout", Out())  # here: pytest's capture resets it per phase
        entry()
    return left


@pytest.mark.parametrize("rank", [False, True], ids=["command", "launched_rank"])
def test_python_m_report_leaves_with_os_exit(monkeypatch, rank):
    if rank:
        monkeypatch.setenv(_launch.CONFIG_ENV, "{}")
    else:
        monkeypatch.delenv(_launch.CONFIG_ENV, raising=False)
    left = exits(monkeypatch, lambda: runpy.run_module("fsdp_retain.report", run_name="__main__"))
    assert left == [(4 if rank else 3, True)]


def test_memory_report_script_leaves_with_os_exit(monkeypatch):
    monkeypatch.delenv(_launch.CONFIG_ENV, raising=False)
    script = str(ROOT / "scripts" / "memory_report.py")
    assert exits(monkeypatch, lambda: runpy.run_path(script, run_name="__main__")) == [(3, True)]
