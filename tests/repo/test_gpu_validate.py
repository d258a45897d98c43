"""``bash scripts/gpu_validate.sh --dry-run`` end to end on CPU/gloo, so the GPU
validation kit keeps working while no GPU is at hand.

One rank (``--nproc 1``): the common GPU case (one GPU: FSDP2 over a mesh of
one rank, FSDP1 ``NO_SHARD``, the report in-process), and the fastest here.
Every stage runs (env, parity, report, stacks, compile, bench, summary) into a temporary
folder; the test checks the files, the parity results and the headline table
of ``summary.md``, then that a second call skips the finished parts. Without deepspeed
(the default venv) and without ``wheelhouse/``, the stacks stage runs DDP and says why the
DeepSpeed parts did not run; ``tests/deepspeed/test_deepspeed.py`` runs that stage where
deepspeed is installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.repo import cases_device, cases_device_compile, cases_device_stacks
from tests.support import background
from tests.support.harness import timeout_scale

ROOT = Path(__file__).resolve().parents[2]
KIT = ROOT / "scripts" / "gpu_validate.sh"
MODES = ("two_forward", "keep:every", "regather:every", "probe:every", "one_backward",
         "one_pass:every")
# The stacks and compile stages' report runs: report/<folder>/, their modes.
EXTRA_REPORTS = {"ddp": ("two_forward", "keep:every", "probe:every", "one_backward",
                         "one_pass:every"),
                 "fsdp2-compile": ("two_forward", "keep:every", "one_backward",
                                   "one_pass:every")}
STAGES = ("env", "parity", "report", "stacks", "compile", "bench", "summary")


def _kit(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run(["bash", str(KIT), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout * timeout_scale())


@background.starts_early("dry_run")
def _start_dry_run() -> background.BackgroundRun:
    """The dry run, started when the session's tests are collected: one process, its
    stages one after another, beside the tests before this module (tests/support/background.py)."""
    out = Path(tempfile.mkdtemp(prefix="gpu_validate_")) / "results"
    # No wheelhouse: where deepspeed is missing, the stacks stage says how to get it.
    return background.BackgroundRun(
        ["bash", str(KIT), "--dry-run", "--nproc", "1", "--out", str(out),
         "--wheelhouse", str(out / "none")],
        payload=out, cwd=ROOT, env=dict(os.environ, PYTHON=sys.executable))


@pytest.fixture(scope="module")
def dry_run():
    run = background.take("dry_run")
    try:
        proc = run.result(timeout=600 * timeout_scale())
        yield proc, run.payload, run.seconds
    finally:
        run.kill()
        shutil.rmtree(run.payload.parent, ignore_errors=True)


def test_dry_run_exits_zero(dry_run):
    proc, _, seconds = dry_run
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    for stage in STAGES:
        assert f"== stage {stage}: ok" in proc.stdout, stage
    print(f"dry run: {seconds:.0f} s")


def test_dry_run_writes_every_file(dry_run):
    _, out, _ = dry_run
    for name in ("env.json", "parity.json", "commands.jsonl", "summary.md", "summary.json",
                 "report/fsdp2/report.json", "report/fsdp2/report.md",
                 "report/fsdp1/report.json", "report/fsdp1/report.md",
                 "report/fsdp2/attempts.json", "bench/bench_probe.json",
                 "bench/saved_tensor_check_fsdp2.json", "bench/saved_tensor_check_fsdp1.json",
                 "logs/parity.log", "stacks.json", "stacks_parity.json", "compile_parity.json",
                 "report/ddp/report.json", "report/fsdp2-compile/report.json"):
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


def test_stacks_and_compile_cases(dry_run):
    """DDP and the compiled FSDP2 blocks pass; without deepspeed the ZeRO cases are skipped,
    saying how the kit gets it, and so does summary.md."""
    _, out, _ = dry_run
    stacks = json.loads((out / "stacks_parity.json").read_text())
    ran = {n: c for n, c in stacks["cases"].items() if c["skipped"] is None}
    assert set(ran) == {n for n in cases_device_stacks.registry.names(1) if n.startswith("ddp")}
    assert all(c["ok"] for c in ran.values()), ran
    assert all("wheelhouse" in c["skipped"] for n, c in stacks["cases"].items() if n not in ran)
    assert "wheelhouse" in json.loads((out / "stacks.json").read_text())["deepspeed"]
    compiled = json.loads((out / "compile_parity.json").read_text())
    assert compiled["passed"] == len(cases_device_compile.registry.names(1)), compiled
    text = (out / "summary.md").read_text()
    assert "## DDP and DeepSpeed (stage stacks)" in text and "scripts/gpu_wheelhouse.sh" in text


def test_one_pass_against_one_backward(dry_run):
    """Every report run has the one_pass row's ratio against its one_backward row (its step
    time over theirs, from the run's own report.json), and the summary lists them. No bound
    on the value: two steps of a tiny model on a busy CPU are noise (a dry run read 14x)."""
    _, out, _ = dry_run
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["one_pass"]) == {"fsdp2", "fsdp1", *EXTRA_REPORTS}, summary["one_pass"]
    for backend, ratio in summary["one_pass"].items():
        rows = {r["label"]: r for r in
                json.loads((out / "report" / backend / "report.json").read_text())["rows"]}
        expected = rows["one_pass:every"]["step_time_s"] / rows["one_backward"]["step_time_s"]
        assert ratio == pytest.approx(expected, rel=1e-9), (backend, ratio, expected)
    assert "## One pass in the block" in (out / "summary.md").read_text()


def test_summary_headline_table_has_numbers(dry_run):
    _, out, _ = dry_run
    text = (out / "summary.md").read_text()
    assert "DRY RUN" in text
    number = r"-?\d+(\.\d+)?"
    runs = {"fsdp2": MODES, "fsdp1": MODES, **EXTRA_REPORTS}
    for backend, modes in runs.items():
        for mode in modes:
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
    assert len(summary["headline"]) == sum(len(modes) for modes in runs.values())


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
