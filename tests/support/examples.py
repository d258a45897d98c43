"""Starting the examples on 2 CPU ranks for the tests (tests/docs/test_examples.py and
the client tests): one run per launch, or a batch of runs in one launch.

Every launch is recorded (``harness.record_launch``) for CI's launch table. A batch
(``ExampleBatch``) serves the examples that need nothing but torch and this library and
pass: its ranks run them in turn (tests/support/run_examples.py), each with the output,
exit status and arguments it would have had alone, for the price of one rank start.
The examples that fail on purpose (a rank left in a collective), start their ranks through
a framework (accelerate, the Trainer, Lightning), or test the command line itself keep
a launch of their own.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.support.harness import (
    ROOT, record_launch, recorded_launch, run_retrying_exit_abort, timeout_scale,
)
from tests.support.harness import _free_port as free_port

EXAMPLES = ROOT / "examples"
COUNT_BLOCKS = str(ROOT / "tests" / "support" / "count_blocks.py")
RUN_EXAMPLE = str(ROOT / "tests" / "support" / "run_example.py")
RUN_EXAMPLES = str(ROOT / "tests" / "support" / "run_examples.py")
TIMEOUT = 300 * timeout_scale()


def example_env(env: dict[str, str] | None) -> dict[str, str]:
    full_env = dict(os.environ)
    full_env.update(
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
    )
    full_env.update(env or {})
    return full_env


def run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return run_retrying_exit_abort(args, cwd=ROOT, env=example_env(env), timeout=TIMEOUT)


def torchrun(script: str, *script_args: str, count_blocks: bool = True,
             env: dict[str, str] | None = None, via_torchrun: bool = False):
    """The example on 2 ranks: started as torchrun starts them (its environment
    variables; a rank that fails stops the other), without torchrun's own process,
    which costs ~2 s a launch; ``via_torchrun`` for the README's command itself."""
    program = [str(EXAMPLES / script), *script_args]
    with recorded_launch(f"example {script} {' '.join(script_args)}".rstrip(), 2):
        if via_torchrun:  # the README's command as written: the retry covers gloo's abort
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
            cmd += ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
            return run(cmd + ([COUNT_BLOCKS] if count_blocks else []) + program, env)
        # Without the interpreter's teardown, where gloo sometimes aborts after the script
        # passed (tests/support/run_example.py); count_blocks.py ends the same way.
        return spawn_ranks([sys.executable, COUNT_BLOCKS if count_blocks else RUN_EXAMPLE,
                            *program], env)


def _start_ranks(cmd: list[str], env: dict[str, str] | None, world_size: int,
                 outs: list) -> list[subprocess.Popen]:
    port = str(free_port())
    procs = []
    for rank in range(world_size):
        rank_env = dict(env or {}, RANK=str(rank), LOCAL_RANK=str(rank),
                        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        out = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        outs.append(out)
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=example_env(rank_env), stdout=out[0],
                                      stderr=out[1], text=True))
    return procs


def _wait(procs: list[subprocess.Popen], progress=lambda: 0) -> None:
    """Until every rank ended, ``TIMEOUT`` passed without ``progress()`` growing, or one
    rank failed 10 s ago (as torchrun does: a failed rank stops the others)."""
    deadline, seen = time.monotonic() + TIMEOUT, progress()
    failed_at = None
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > 10:
            break
        now = progress()
        if now != seen:
            deadline, seen = time.monotonic() + TIMEOUT, now
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def _read(outs: list) -> list[tuple[str, str]]:
    texts = []
    for out, err in outs:
        out.seek(0)
        err.seek(0)
        texts.append((out.read(), err.read()))
        out.close()
        err.close()
    return texts


def spawn_ranks(cmd: list[str], env: dict[str, str] | None,
                world_size: int = 2) -> subprocess.CompletedProcess:
    """``cmd`` on ``world_size`` ranks; stdout and stderr are rank 0's then rank 1's."""
    outs: list = []
    procs = _start_ranks(cmd, env, world_size, outs)
    _wait(procs)
    texts = _read(outs)
    code = next((p.returncode for p in procs if p.returncode != 0), 0)
    return subprocess.CompletedProcess(cmd, code, "".join(t[0] for t in texts),
                                       "".join(t[1] for t in texts))


@dataclasses.dataclass(frozen=True)
class ExampleRun:
    """One run of an example: what ``torchrun(script, *args, count_blocks=...)`` starts."""

    script: str
    args: tuple[str, ...]
    count_blocks: bool = True

    def __str__(self) -> str:
        return " ".join([self.script, *self.args])


class ExampleBatch:
    """The runs the selected tests need, started in one 2-rank launch at the first
    ``result``; each result is the ``CompletedProcess`` the run would have given alone
    (stdout and stderr rank 0's then rank 1's, the first non-zero status)."""

    def __init__(self, runs: list[ExampleRun]) -> None:
        self.runs = list(dict.fromkeys(runs))
        self._results: dict[ExampleRun, subprocess.CompletedProcess] | None = None

    def result(self, example: ExampleRun) -> subprocess.CompletedProcess:
        if example not in self.runs:  # not planned: a launch of its own
            return torchrun(example.script, *example.args, count_blocks=example.count_blocks)
        if self._results is None:
            self._results = self._launch()
        return self._results[example]

    def _launch(self) -> dict[ExampleRun, subprocess.CompletedProcess]:
        world_size = 2
        with tempfile.TemporaryDirectory() as folder:
            plan = {"out": folder, "runs": [
                {"script": str(EXAMPLES / r.script), "args": list(r.args),
                 "count_blocks": r.count_blocks, "port": free_port()} for r in self.runs]}
            plan_path = os.path.join(folder, "plan.json")
            with open(plan_path, "w") as f:
                json.dump(plan, f)
            outs: list = []
            started, started_wall = time.monotonic(), time.time()
            procs = _start_ranks([sys.executable, RUN_EXAMPLES, plan_path], None, world_size, outs)
            _wait(procs, progress=lambda: len(list(Path(folder).glob("*.code"))))
            wall = time.monotonic() - started
            launcher = _read(outs)  # what a rank printed outside the runs
            results = {r: self._collect(Path(folder), i, r, world_size, procs, launcher)
                       for i, r in enumerate(self.runs)}
            first = Path(folder) / "0.0.start"
            setup = float(first.read_text()) - started_wall if first.exists() else None
        record_launch(f"examples batch ({len(self.runs)} runs: "
                      f"{'; '.join(str(r) for r in self.runs)})", world_size, wall, setup)
        return results

    @staticmethod
    def _collect(folder: Path, i: int, example: ExampleRun, world_size: int,
                 procs: list[subprocess.Popen], launcher: list[tuple[str, str]]
                 ) -> subprocess.CompletedProcess:
        outs, errs, codes = [], [], []
        for rank in range(world_size):
            out, err, code = (folder / f"{i}.{rank}.{kind}" for kind in ("out", "err", "code"))
            outs.append(out.read_text() if out.exists() else "")
            errs.append(err.read_text() if err.exists() else "")
            if code.exists():
                codes.append(int(code.read_text()))
            else:  # the batch stopped before this run ended on this rank
                status = procs[rank].returncode
                codes.append(status if status else 1)
                errs.append(f"[examples batch] run {i} ({example}) did not end on rank {rank}: "
                            f"the rank exited with {status} (an earlier run failed, or the "
                            f"time limit); what the rank printed outside the runs:\n"
                            f"{launcher[rank][0][-2000:]}{launcher[rank][1][-4000:]}\n")
        code = next((c for c in codes if c != 0), 0)
        return subprocess.CompletedProcess([RUN_EXAMPLES, str(example)], code, "".join(outs),
                                           "".join(errs))
