#!/usr/bin/env python
"""Validate fsdp_retain on the GPUs of this machine, and write what it measured.

    bash scripts/gpu_validate.sh                  # every stage, into docs/results/<gpu>-<torch>-<date>/
    bash scripts/gpu_validate.sh --stage env parity report     # one call of at most 10 minutes
    bash scripts/gpu_validate.sh --stage bench summary         # the next call: same folder
    bash scripts/gpu_validate.sh --dry-run        # the same stages, tiny, on CPU/gloo, into a temp folder

Stages (``--stage``, in this order; ``all`` is every one):

- ``env``: the versions present (python, torch, CUDA, NCCL, driver, GPUs,
  transformers, accelerate, deepspeed) against what the project supports, and
  the torch features the kit needs, found by feature; installs nothing.
- ``parity``: ``tests/repo/cases_device.py`` on G ranks, one GPU each, NCCL (world
  size G = the GPUs present): FSDP2 and FSDP1 (``NO_SHARD`` at G = 1) against
  the unsharded reference in fp32, against two forwards in bf16 mixed
  precision, probe passes, ``check_saved_tensors``; collectives by formula.
- ``report``: ``python -m fsdp_retain.report`` on Qwen2.5-1.5B shapes, bf16,
  8 x 2048 tokens per rank, one backend per run (fsdp2, then fsdp1), modes
  ``two_forward``, ``keep:every``, ``regather:every``, ``probe:every``, and
  ``one_backward`` beside ``one_pass:every`` (one backward in the block against the same
  step without it). A run that runs out of memory is run again with the next smaller
  batch (6, 4, 2, 1).
- ``stacks``: DDP and DeepSpeed ZeRO-2/3: ``tests/repo/cases_device_stacks.py``'s parity
  cases on G ranks, and the report's ``ddp`` and ``deepspeed`` (ZeRO-3) runs, modes
  ``STACK_MODES``. Where deepspeed is missing it is installed from ``wheelhouse/``
  (``scripts/gpu_wheelhouse.sh``) into a throwaway venv over the machine's torch
  (``scripts/gpu_validate_deps.py``); without a wheelhouse the DeepSpeed parts are skipped
  and ``stacks.json`` says why.
- ``compile``: FSDP2 with each decoder layer compiled before ``fully_shard``, as torchtitan
  does (Inductor; ``aot_eager`` in the dry run): ``tests/repo/cases_device_compile.py``'s
  parity cases and the report with ``--compile-layers`` (``report/fsdp2-compile/``), modes
  ``COMPILE_MODES``.
- ``bench``: ``scripts/bench_probe.py`` and ``scripts/bench_saved_tensor_check.py``
  (FSDP2 and FSDP1) on the same model, dtype and batch.
- ``summary``: ``summary.md`` (the headline table the README quotes, the
  parity results, the benchmarks, the device and versions, every command) and
  ``summary.json``.

Every stage writes into one folder and skips the parts a previous call
finished (``--force`` redoes them), so the stages can be spread over several
calls. A part starts only if its estimated time fits in what is left of
``--budget-min`` (default 9 minutes per call); otherwise the call stops (exit
code 3) and says to run the same command again. A command still running when
the budget is spent is killed with its ranks. Progress and timings are printed
as it goes. Exit code 1: a stage failed (the summary says which); 2: no GPU.

``--dry-run`` runs the same stages on CPU/gloo (2 ranks, a 3-layer model,
few steps) into a temporary folder (or ``--out``); CI runs it
(``tests/repo/test_gpu_validate.py``) so the command keeps working without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests/ and fsdp_retain/ of this checkout; scripts/ is sys.path[0]

STAGES = ("env", "parity", "report", "stacks", "compile", "bench", "summary")
REPORT_MODES = ("two_forward", "keep:every", "regather:every", "probe:every", "one_backward",
                "one_pass:every")
STACK_MODES = ("two_forward", "keep:every", "probe:every", "one_backward", "one_pass:every")
COMPILE_MODES = ("two_forward", "keep:every", "one_backward", "one_pass:every")
EXIT_BUDGET = 3  # stopped before a part that would not fit in --budget-min: run again
_START = time.monotonic()


def say(message: str) -> None:
    print(f"[gpu_validate {time.monotonic() - _START:6.0f}s] {message}", flush=True)


@dataclasses.dataclass
class Plan:
    """What every stage runs: the GPU run, or its tiny CPU rehearsal (``--dry-run``)."""

    dry_run: bool
    device: str  # cuda (NCCL) or cpu (gloo)
    world: int
    size: str
    dtype: str
    batches: tuple[int, ...]  # the report's batch per rank, then its fallbacks on OOM
    seq_len: int
    warmup: int
    steps: int
    bench_warmup: int
    bench_steps: int
    wheelhouse: Path  # where the stacks stage finds deepspeed's wheels, if it must install
    # Estimated seconds per part on one H100 (a part starts only if it fits the budget).
    estimates: dict[str, float]

    @classmethod
    def make(cls, args) -> Plan:
        if args.dry_run:
            return cls(True, "cpu", args.nproc or 2, "tiny", "bf16", (2,), 64, 1, 2, 1, 10,
                       args.wheelhouse, estimates={})
        import torch

        world = args.nproc or torch.cuda.device_count()
        batches = (args.batch,) + tuple(b for b in (6, 4, 2, 1) if b < args.batch)
        return cls(False, "cuda", world, "1.5b", "bf16", batches, 2048, 3, 10, 3, 10,
                   args.wheelhouse,
                   estimates=dict(parity=120, report=240, bench_probe=150, bench_check=120,
                                  stacks_parity=90, stack_report=200, compile_parity=90,
                                  compile_report=300))


# ----------------------------------------------------------------------------- running


class Folder:
    """The output folder: result files, logs and every command, kept across calls."""

    def __init__(self, path: Path, budget_s: float, force: bool) -> None:
        self.path = path
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "logs").mkdir(exist_ok=True)
        self.deadline = time.monotonic() + budget_s
        self.force = force

    def done(self, name: str) -> bool:
        if self.force or not (self.path / name).exists():
            return False
        say(f"{name}: already in {self.path} (--force redoes it)")
        return True

    def left(self) -> float:
        """Seconds left of the budget (at least 30); a command is killed after them, so
        the call ends cleanly and the part is redone by the next call."""
        return max(self.deadline - time.monotonic(), 30.0)

    def fits(self, seconds: float, what: str) -> bool:
        left = self.deadline - time.monotonic()
        if seconds <= left:
            return True
        say(f"stopping before {what}: it takes about {seconds:.0f} s and {left:.0f} s of the "
            "budget are left. Run the same command again: finished parts are skipped.")
        return False

    def record(self, stage: str, argv: list[str], env: dict[str, str] | None = None) -> str:
        """Appends a command to commands.jsonl (summary.md lists them); returns it as text."""
        prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in (env or {}).items())
        text = prefix + shlex.join(_relative(argv))
        with open(self.path / "commands.jsonl", "a") as f:
            f.write(json.dumps(dict(stage=stage, command=text)) + "\n")
        return text

    def write_json(self, name: str, payload) -> None:
        (self.path / name).parent.mkdir(parents=True, exist_ok=True)
        (self.path / name).write_text(json.dumps(payload, indent=2) + "\n")

    def read_json(self, name: str):
        path = self.path / name
        return json.loads(path.read_text()) if path.exists() else None

    def run(self, stage: str, argv: list[str], log: str, *,
            env: dict[str, str] | None = None) -> tuple[int, str]:
        """Runs a command, printing its output as it comes and keeping it in logs/; returns
        the exit code and the output."""
        text = self.record(stage, argv, env)
        say(f"$ {text}")
        full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1",
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                os.environ.get("PYTHONPATH")]))}
        start = time.monotonic()
        proc = subprocess.Popen(argv, cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1,
                                start_new_session=True)
        timeout = self.left()
        # Its own process group: the ranks a report or benchmark launched go with it.
        timer = threading.Timer(timeout, os.killpg, (proc.pid, signal.SIGKILL))
        timer.start()
        lines = []
        with open(self.path / "logs" / log, "w") as f:
            for line in proc.stdout:
                lines.append(line)
                f.write(line)
                print(f"    {line}", end="", flush=True)
        code = proc.wait()
        timer.cancel()
        killed = " (killed: the budget ran out)" if code == -signal.SIGKILL else ""
        say(f"exit {code} after {time.monotonic() - start:.0f} s{killed}")
        return code, "".join(lines)


def _relative(argv: list[str]) -> list[str]:
    """A command as it would be typed in the repository root."""
    out = ["python" if a == sys.executable else a for a in argv]
    return [str(Path(a).relative_to(ROOT)) if a.startswith(str(ROOT) + "/") else a for a in out]


def out_of_memory(text: str) -> bool:
    return "out of memory" in text.lower()


# ----------------------------------------------------------------------------- stages


def stage_env(folder: Folder, plan: Plan) -> bool:
    from gpu_validate_env import collect_env, env_lines

    env = collect_env(plan.device)
    folder.write_json("env.json", env)
    for line in env_lines(env):
        say(line)
    return not env["problems"]


def stage_parity(folder: Folder, plan: Plan) -> bool:
    if folder.done("parity.json"):
        return folder.read_json("parity.json")["failed"] == 0
    if not folder.fits(plan.estimates.get("parity", 0), "the parity cases"):
        raise BudgetSpent
    from tests.repo import cases_device
    from tests.support.harness import BACKEND_ENV, launch

    names = cases_device.registry.names(plan.world)
    backend = "nccl" if plan.device == "cuda" else "gloo"
    # The harness launches the ranks itself: the command to redo this stage is the kit's.
    again = ["bash", "scripts/gpu_validate.sh", "--stage", "parity", "--nproc", str(plan.world),
             "--out", str(folder.path), "--force"] + (["--dry-run"] if plan.dry_run else [])
    folder.record("parity", again)
    say(f"parity: {len(names)} cases of tests/repo/cases_device.py on {plan.world} {plan.device} "
        f"rank(s), {backend}, one launch")
    start = time.monotonic()
    result = launch("tests.repo.cases_device", plan.world, timeout=folder.left(),
                    env={BACKEND_ENV: backend})
    cases = {}
    for name in names:
        entries = [r.get(name) for r in result.per_rank]
        ok = all(e is not None and e["ok"] for e in entries)
        error = next((e["error"] for e in entries if e and not e["ok"]), None)
        seconds = max((e["seconds"] for e in entries if e), default=None)
        cases[name] = dict(ok=ok, seconds=seconds, error=None if ok else (error or "did not run"))
        say(f"  {'ok  ' if ok else 'FAIL'} {name} ({seconds} s)")
    (folder.path / "logs" / "parity.log").write_text(result.output_tail(100_000))
    failed = sum(not c["ok"] for c in cases.values())
    folder.write_json("parity.json", dict(
        world_size=plan.world, process_group=backend, device=plan.device, cases=cases,
        passed=len(cases) - failed, failed=failed, timed_out=result.timed_out,
        seconds=round(time.monotonic() - start, 1)))
    say(f"parity: {len(cases) - failed} passed, {failed} failed "
        f"({time.monotonic() - start:.0f} s)")
    return failed == 0


def _report_argv(plan: Plan, backend: str, batch: int, out: Path, *,
                 modes: tuple[str, ...] = REPORT_MODES, python: str = sys.executable,
                 extra: tuple[str, ...] = ()) -> list[str]:
    return [python, "-m", "fsdp_retain.report", "--device", plan.device,
            "--nproc", str(plan.world), "--dtype", plan.dtype, "--size", plan.size,
            "--batch", str(batch), "--seq-len", str(plan.seq_len), "--backend", backend,
            "--modes", *modes, "--warmup", str(plan.warmup), "--steps", str(plan.steps),
            *extra, "--out", str(out)]


ALLOC_ENV = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def report_oom(report: dict | None, output: str) -> bool:
    """Whether a report run ran out of memory: a row's error says so, or the run died of it."""
    if report is None:
        return out_of_memory(output)
    return any(out_of_memory(row.get("error") or "") for row in report["rows"])


def stage_report(folder: Folder, plan: Plan) -> bool:
    ok = True
    batches = list(plan.batches)
    for backend in ("fsdp2", "fsdp1"):
        name = f"report/{backend}/report.json"
        if folder.done(name):
            done = folder.read_json(name)
            # A later backend starts from the batch the earlier one fitted.
            batches = [b for b in batches if b <= done["config"]["batch_per_rank"]]
            ok &= all(r["ok"] for r in done["rows"])
            continue
        # Batches that ran out of memory in an earlier call are not tried again.
        attempts = folder.read_json(f"report/{backend}/attempts.json") or []
        too_big = min((a["batch"] for a in attempts if a["oom"]), default=None)
        if too_big is not None and any(b < too_big for b in batches):
            batches = [b for b in batches if b < too_big]
        report = None
        for batch in batches:
            if not folder.fits(plan.estimates.get("report", 0), f"the {backend} report"):
                raise BudgetSpent
            out = folder.path / "report" / backend
            (out / "report.json").unlink(missing_ok=True)
            say(f"report: {backend}, {plan.size} shapes, {plan.dtype}, batch {batch} x "
                f"{plan.seq_len} per rank, {plan.world} rank(s)")
            code, output = folder.run("report", _report_argv(plan, backend, batch, out),
                                      f"report_{backend}_batch{batch}.log",
                                      env=ALLOC_ENV if plan.device == "cuda" else None)
            report = folder.read_json(f"report/{backend}/report.json") if code == 0 else None
            attempts.append(dict(batch=batch, exit_code=code, oom=report_oom(report, output)))
            folder.write_json(f"report/{backend}/attempts.json", attempts)
            if attempts[-1]["oom"] and batch != batches[-1]:
                # Not a result: a later call must not take it for a finished part.
                (out / "report.json").unlink(missing_ok=True)
                say(f"report: {backend} ran out of memory at batch {batch}: trying a smaller one")
                continue
            break
        batches = [b for b in batches if b <= attempts[-1]["batch"]]
        if report is None:
            say(f"report: {backend} FAILED (exit {attempts[-1]['exit_code']}; see logs/)")
            ok = False
        else:
            ok &= all(r["ok"] for r in report["rows"])
    return ok


def _cases(folder: Folder, plan: Plan, stage: str, module: str, name: str,
           python: str) -> bool:
    """One launch of ``module``'s cases in ``python`` (``scripts/gpu_validate_cases.py``),
    into ``name`` (a JSON file of the folder)."""
    if folder.done(name):
        return folder.read_json(name)["failed"] == 0
    if not folder.fits(plan.estimates.get(f"{stage}_parity", 0), f"the {stage} cases"):
        raise BudgetSpent
    backend = "nccl" if plan.device == "cuda" else "gloo"
    out = folder.path / name
    code, _ = folder.run(stage, [python, "scripts/gpu_validate_cases.py", module,
                                 str(plan.world), backend, str(out), str(folder.left())],
                         f"{Path(name).stem}.log")
    result = folder.read_json(name)
    if result is None:
        say(f"{stage}: {module} FAILED (exit {code}; see logs/)")
        return False
    for case, entry in result["cases"].items():
        state = "skip" if entry["skipped"] else "ok  " if entry["ok"] else "FAIL"
        say(f"  {state} {case} ({entry['seconds']} s)")
    say(f"{stage}: {result['passed']} passed, {result['skipped']} skipped, "
        f"{result['failed']} failed")
    return result["failed"] == 0


def _one_report(folder: Folder, plan: Plan, stage: str, backend: str, folder_name: str,
                modes: tuple[str, ...], python: str, extra: tuple[str, ...] = ()) -> bool:
    """A report run beyond the ``report`` stage's, at the batch the ``report`` stage fitted
    (halved on out of memory)."""
    name = f"report/{folder_name}/report.json"
    if folder.done(name):
        return all(r["ok"] for r in folder.read_json(name)["rows"])
    batch = _bench_batch(folder, plan)
    while True:
        if not folder.fits(plan.estimates.get(f"{stage}_report", 0), f"the {folder_name} report"):
            raise BudgetSpent
        out = folder.path / "report" / folder_name
        say(f"{stage}: {folder_name} report, batch {batch} x {plan.seq_len} per rank")
        code, output = folder.run(stage, _report_argv(plan, backend, batch, out, modes=modes,
                                                      python=python, extra=extra),
                                  f"report_{folder_name}_batch{batch}.log",
                                  env=ALLOC_ENV if plan.device == "cuda" else None)
        report = folder.read_json(name) if code == 0 else None
        if report_oom(report, output) and batch > 1:
            (out / "report.json").unlink(missing_ok=True)
            batch //= 2
            say(f"{stage}: {folder_name} ran out of memory; trying batch {batch}")
            continue
        if report is None:
            say(f"{stage}: {folder_name} report FAILED (exit {code}; see logs/)")
            return False
        return all(r["ok"] for r in report["rows"])


def stage_stacks(folder: Folder, plan: Plan) -> bool:
    from gpu_validate_deps import deepspeed_python

    note = folder.read_json("stacks.json") or {}
    if "deepspeed_python" not in note:
        python, why = deepspeed_python(say, plan.wheelhouse)
        note = dict(deepspeed_python=python, deepspeed=why)
        folder.write_json("stacks.json", note)
    say(f"stacks: {note['deepspeed']}")
    ds_python = note["deepspeed_python"]
    ok = _cases(folder, plan, "stacks", "tests.repo.cases_device_stacks",
                "stacks_parity.json", ds_python or sys.executable)
    ok &= _one_report(folder, plan, "stack", "ddp", "ddp", STACK_MODES, sys.executable)
    if ds_python is not None:
        ok &= _one_report(folder, plan, "stack", "deepspeed", "deepspeed", STACK_MODES,
                          ds_python)
    return ok


def stage_compile(folder: Folder, plan: Plan) -> bool:
    ok = _cases(folder, plan, "compile", "tests.repo.cases_device_compile",
                "compile_parity.json", sys.executable)
    backend = "inductor" if plan.device == "cuda" else "aot_eager"
    ok &= _one_report(folder, plan, "compile", "fsdp2", "fsdp2-compile", COMPILE_MODES,
                      sys.executable, extra=("--compile-layers", backend))
    return ok


def _bench_batch(folder: Folder, plan: Plan) -> int:
    """The batch the report fitted (the benchmarks run the same model and dtype)."""
    fitted = [r["config"]["batch_per_rank"] for b in ("fsdp2", "fsdp1")
              if (r := folder.read_json(f"report/{b}/report.json"))]
    return min(fitted, default=plan.batches[0])


def stage_bench(folder: Folder, plan: Plan) -> bool:
    batch = _bench_batch(folder, plan)
    common = ["--device", plan.device, "--nproc", str(plan.world), "--dtype", plan.dtype,
              "--size", plan.size, "--seq-len", str(plan.seq_len),
              "--warmup", str(plan.bench_warmup), "--steps", str(plan.bench_steps)]
    benches = [
        ("bench/bench_probe.json", "bench_probe",
         lambda b: [sys.executable, "scripts/bench_probe.py", *common, "--batch", str(b),
                    "--out", str(folder.path / "bench")]),
    ] + [
        (f"bench/saved_tensor_check_fsdp{v}.json", "bench_check",
         lambda b, v=v: [sys.executable, "scripts/bench_saved_tensor_check.py", "--fsdp", str(v),
                         *common, "--batch", str(b), "--out",
                         str(folder.path / f"bench/saved_tensor_check_fsdp{v}.json")])
        for v in (2, 1)
    ]
    (folder.path / "bench").mkdir(exist_ok=True)
    ok = True
    for name, kind, argv in benches:
        if folder.done(name):
            continue
        b = batch
        while True:
            if not folder.fits(plan.estimates.get(kind, 0), name):
                raise BudgetSpent
            log = Path(name).stem + f"_batch{b}.log"
            code, output = folder.run("bench", argv(b), log,
                                      env=ALLOC_ENV if plan.device == "cuda" else None)
            if code != 0 and out_of_memory(output) and b > 1:
                b //= 2
                say(f"{name}: out of memory; trying batch {b}")
                continue
            break
        if code != 0 or not (folder.path / name).exists():
            say(f"{name}: FAILED (exit {code}; see logs/{log})")
            ok = False
    return ok


def stage_summary(folder: Folder, plan: Plan) -> bool:
    from gpu_validate_summary import write_summary

    path = write_summary(folder.path, dry_run=plan.dry_run)
    say(f"wrote {path}")
    print((folder.path / "summary.md").read_text(), flush=True)
    return True


class BudgetSpent(Exception):
    """A part would not fit in what is left of --budget-min."""


STAGE_FUNCTIONS = dict(env=stage_env, parity=stage_parity, report=stage_report,
                       stacks=stage_stacks, compile=stage_compile, bench=stage_bench,
                       summary=stage_summary)


# ----------------------------------------------------------------------------- command line


def default_out(plan: Plan) -> Path:
    """docs/results/<gpu>-torch<version>-<date>/, or the unfinished folder of an earlier call
    for the same GPU and torch (so a later call continues it, also after midnight)."""
    if plan.dry_run:
        return Path(tempfile.mkdtemp(prefix="gpu_validate_dry_run_"))
    import torch

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no-gpu"
    gpu = re.sub(r"[^a-z0-9]+", "-", name.lower().replace("nvidia", "")).strip("-")
    stem = f"{gpu}{f'-x{plan.world}' if plan.world > 1 else ''}-torch{torch.__version__}"
    stem = re.sub(r"[^A-Za-z0-9.+-]+", "-", stem)
    results = ROOT / "docs" / "results"
    unfinished = sorted(p for p in results.glob(f"{stem}-*") if not (p / "summary.md").exists())
    if unfinished:
        return unfinished[-1]
    return results / f"{stem}-{datetime.date.today().isoformat()}"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Validate fsdp_retain on this machine's GPUs (or, with --dry-run, "
                    "rehearse it on CPU) and write docs/results/<gpu>-<torch>-<date>/.")
    parser.add_argument("--stage", nargs="+", default=["all"], choices=("all",) + STAGES,
                        help="stages to run, in order (default: all)")
    parser.add_argument("--dry-run", action="store_true",
                        help="the same stages, tiny, on CPU/gloo, into a temporary folder")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default: docs/results/<gpu>-torch<version>-<date>/)")
    parser.add_argument("--nproc", type=int, default=None,
                        help="ranks (default: every GPU; --dry-run: 2)")
    parser.add_argument("--batch", type=int, default=8,
                        help="the report's first batch per rank (smaller ones follow on OOM)")
    parser.add_argument("--budget-min", type=float, default=9.0,
                        help="minutes this call may take; a part that would not fit waits for "
                             "the next call")
    parser.add_argument("--force", action="store_true", help="redo parts already in --out")
    parser.add_argument("--wheelhouse", type=Path, default=ROOT / "wheelhouse",
                        help="deepspeed's wheels (scripts/gpu_wheelhouse.sh), installed into a "
                             "throwaway venv where deepspeed is missing (default: wheelhouse/)")
    args = parser.parse_args(argv)
    if "all" in args.stage:
        args.stage = list(STAGES)
    args.stage = [s for s in STAGES if s in args.stage]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("gpu_validate: no CUDA device here. On a GPU machine run "
                  "`bash scripts/gpu_validate.sh`; to rehearse on CPU add --dry-run.",
                  file=sys.stderr)
            return 2
    plan = Plan.make(args)
    out = args.out or default_out(plan)
    folder = Folder(out, args.budget_min * 60, args.force)
    folder.record("kit", ["bash", "scripts/gpu_validate.sh", *(sys.argv[1:] if argv is None
                                                               else argv)])
    say(f"{'dry run (CPU, gloo)' if plan.dry_run else 'GPU run'}: stages "
        f"{' '.join(args.stage)} into {out}")
    failed = []
    for stage in args.stage:
        start = time.monotonic()
        say(f"== stage {stage}")
        try:
            ok = STAGE_FUNCTIONS[stage](folder, plan)
        except BudgetSpent:
            say(f"stopped in stage {stage} (budget); folder: {out}")
            return EXIT_BUDGET
        say(f"== stage {stage}: {'ok' if ok else 'FAILED'} in {time.monotonic() - start:.0f} s")
        if not ok:
            failed.append(stage)
    say(f"done in {time.monotonic() - _START:.0f} s: {out}"
        + (f"; failed: {' '.join(failed)}" if failed else ""))
    if not plan.dry_run and "summary" in args.stage:
        say(f"commit it: git add {_relative([str(out)])[0]} && git commit -m 'GPU results'")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
