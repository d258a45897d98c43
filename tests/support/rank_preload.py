"""Imported by the ranks' fork server (tests/support/rank_start.py) when it starts: the
harness, then the cases modules named in ``FSDP_RETAIN_RANK_PRELOAD``. A module that fails
to import is left to its cases, which report the error (as ``harness._worker`` does)."""

from __future__ import annotations

import importlib
import os

import tests.support.harness  # noqa: F401 - what every rank runs

for _module in filter(None, os.environ.get("FSDP_RETAIN_RANK_PRELOAD", "").split(",")):
    try:
        importlib.import_module(_module)
    except BaseException:  # noqa: BLE001, S110 - reported by each of its cases
        pass
