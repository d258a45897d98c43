"""``bash scripts/gpu_validate.sh --dry-run`` end to end on CPU/gloo, so the GPU
validation kit keeps working while no GPU is at hand.

One rank (``--nproc 1``): the common GPU case (one GPU: FSDP2 over a mesh of
one rank, FSDP1 ``NO_SHARD``, the report in-process), and the fastest here.
Every stage runs (env, parity, report, bench, summary) into a temporary
folder; the test checks the files, the parity results and the headline table
of ``summary.md``, then that a second call skips the finished parts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.repo import cases_device
from tests.support.harness import timeout_scale

ROOT = Path(__file__).resolve().parents[2]
KIT = ROOT / "scripts" / "gpu_validate.sh"
MODES = ("two_forward", "keep:every", "regather:every", "probe:every")


def _kit(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run(["bash", str(KIT), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout * timeout_scale())


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_validate") / "results"
    start = time.monotonic()
    proc = _kit("--dry-run", "--nproc", "1", "--out", str(out))
    return proc, out, time.monotonic() - start


def test_dry_run_exits_zero(dry_run):
    proc, _, seconds = dry_run
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    for stage in ("env", "parity", "report", "bench", "summary"):
        assert f"== stage {stage}: ok" in proc.stdout, stage
    print(f"dry run: {seconds:.0f} s")


def test_dry_run_writes_every_file(dry_run):
    _, out, _ = dry_run
    for name in ("env.json", "parity.json", "commands.jsonl", "summary.md", "summary.json",
                 "report/fsdp2/report.json", "report/fsdp2/report.md",
                 "report/fsdp1/report.json", "report/fsdp1/report.md",
                 "report/fsdp2/attempts.json", "bench/bench_probe.json",
                 "bench/saved_tensor_check_fsdp2.json", "bench/saved_tensor_check_fsdp1.json",
                 "logs/parity.log"):
        assert (out / name).is_file(), name
    env = json.loads((out / "env.json").read_text())
    assert env["problems"] == [], env["problems"]
    assert env["torch_in_supported_range"] is not False


def test_parity_cases_all_pass(dry_run):
    _, out, _ = dry_run
    parity = json.loads((out / "parity.json").read_text())
    failed = {n: c["error"] for n, c in parity["cases"].items() if not c["ok"]}
    assert not failed, failed
    assert parity["passed"] == len(cases_device.registry.names(1))


def test_summary_headline_table_has_numbers(dry_run):
    _, out, _ = dry_run
    text = (out / "summary.md").read_text()
    assert "DRY RUN" in text
    number = r"-?\d+(\.\d+)?"
    for backend in ("fsdp2", "fsdp1"):
        for mode in MODES:
            line = next((row for row in text.splitlines() if row.startswith(f"| {backend} | `{mode}` |")),
                        None)
            assert line is not None, (backend, mode, text)
            cells = [c.strip() for c in line.strip("|").split("|")][2:]
            assert len(cells) == 7, line
            assert re.fullmatch(number, cells[0]), line  # step ms
            assert re.fullmatch(number + "x", cells[1]), line  # vs two_forward
            assert re.fullmatch(number, cells[2]), line  # peak
            assert all(re.fullmatch(r"\d+", c) for c in cells[4:]), line  # collectives
    assert "python -m fsdp_retain.report" in text and "scripts/bench_probe.py" in text
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["headline"]) == 2 * len(MODES)


def test_second_call_skips_finished_parts(dry_run):
    _, out, _ = dry_run
    proc = _kit("--dry-run", "--nproc", "1", "--out", str(out), "--stage", "parity", "report",
                "bench", "summary", timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "$ python" not in proc.stdout, "a finished part ran again"
    assert proc.stdout.count("already in") == 6, proc.stdout[-4000:]


def test_a_part_that_does_not_fit_waits_for_the_next_call(tmp_path):
    proc = _kit("--dry-run", "--nproc", "1", "--out", str(tmp_path), "--budget-min", "0",
                "--stage", "parity", timeout=120)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "Run the same command again" in proc.stdout
    assert not (tmp_path / "parity.json").exists()


def _kit_module():
    spec = importlib.util.spec_from_file_location("gpu_validate", ROOT / "scripts" / "gpu_validate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_out_of_memory_is_told_apart():
    kit = _kit_module()
    oom = "timing: OutOfMemoryError: CUDA out of memory. Tried to allocate 4.64 GiB"
    assert kit.report_oom({"rows": [{"error": None}, {"error": oom}]}, "")
    assert not kit.report_oom({"rows": [{"error": "setup: ValueError: no"}]}, "")
    assert kit.report_oom(None, "torch.OutOfMemoryError: CUDA out of memory.")
    assert not kit.report_oom(None, "RuntimeError: NCCL error")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is present")
def test_without_a_gpu_it_says_how_to_rehearse():
    proc = _kit("--stage", "env", timeout=120)
    assert proc.returncode == 2
    assert "--dry-run" in proc.stderr
