"""The version subset CI runs (tests/matrix_subset.txt, written by
scripts/select_subset.py) names tests and cases that exist: a renamed case would
otherwise drop out of the oldest and newest torch silently."""

from __future__ import annotations

import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _entries() -> list[str]:
    text = (ROOT / "tests" / "matrix_subset.txt").read_text()
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def test_subset_names_existing_cases():
    entries = _entries()
    assert len(entries) > 20, entries
    for entry in entries:
        path, _, rest = entry.partition("::")
        assert (ROOT / path).is_file(), entry
        if not rest:
            continue
        test_name, _, case = rest.partition("[")
        mod = importlib.import_module(".".join(Path(path).with_suffix("").parts))
        test = getattr(mod, test_name, None)
        assert test is not None, entry
        module, world_size = test.harness_launch
        cases = importlib.import_module(module).registry.names(world_size)
        assert case.rstrip("]") in cases, entry


def test_subset_keeps_one_parity_case_per_backend():
    entries = "\n".join(_entries())
    for needle in ("test_fsdp2.py::test_fsdp2[parity_", "test_fsdp1.py::test_fsdp1_ws2[parity_",
                   "test_probe.py::test_probe[parity_fsdp2", "test_probe.py::test_probe[parity_fsdp1",
                   "test_compile.py::test_compile[compile_"):
        assert needle in entries, needle
