"""Starting the examples on 2 CPU ranks for the tests (tests/docs/test_examples.py and
the client tests): one run per launch, or the session's batch of runs.

Every launch is recorded (``harness.record_launch``) for CI's launch table. The batch
(``ExampleBatch``) holds the runs of the selected tests that name theirs (``batched``):
its ranks import once what the runs' scripts import, then fork a process per run
(tests/support/run_examples.py), so each run has the output, exit status, arguments and
fresh process state it would have had alone (the Trainer's and accelerate's singletons,
DeepSpeed's communication backend, a shim's patches end with it) for the price of a fork.
A run that fails, on one rank or both, is reported as its own and the batch goes on. The
runs that test a launcher (``accelerate launch``, one of Lightning's own, torchrun for the
README's command) or the command line itself (a package missing) keep a launch of their
own; accelerate's start when the session's tests are collected (``start_accelerate``,
tests/support/background.py), beside the case launches. Lightning's other runs are in the
batch: its ranks are started for Lightning (``LOCAL_RANK`` set), so Lightning starts none.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import inspect
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tests.support import background
from tests.support.harness import (
    EXIT_ABORT, ROOT, record_launch, recorded_launch, run_retrying_exit_abort, timeout_scale,
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
        # A session of its own: the launcher kills a rank with whatever it forked
        # (a batch's runs, tests/support/run_examples.py).
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=example_env(rank_env), stdout=out[0],
                                      stderr=out[1], text=True, start_new_session=True))
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
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
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


def start_accelerate(config: str, *script: str, env: dict[str, str] | None = None
                     ) -> background.BackgroundRun:
    """``accelerate launch --config_file examples/accelerate/CONFIG SCRIPT...``, started now
    (its launch is accelerate's own: what the tests that start it test); read it with
    ``accelerate_result``."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch"]
    cmd += ["--config_file", str(EXAMPLES / "accelerate" / config)]
    cmd += ["--main_process_port", str(free_port()), *script]
    return background.BackgroundRun(cmd, payload=f"accelerate launch {config} "
                                    f"{os.path.basename(script[-1])}", cwd=ROOT,
                                    env=example_env(env))


def early_accelerate(test: str, name: str, config: str, *script: str,
                     env: dict[str, str] | None = None) -> None:
    """``test``'s accelerate launch (``start_accelerate``), registered as ``name``: started
    when the tests are collected where ``test`` is selected (tests/support/background.py),
    read with ``accelerate_result(name)``."""
    background.starts_early(name, when=test)(
        lambda: start_accelerate(config, *script, env=env))


def accelerate_result(name: str) -> subprocess.CompletedProcess:
    """The ``start_accelerate`` run registered as ``name`` (tests/support/background.py:
    started when the tests are collected, or now), recorded in the launch log; started
    again (up to 3 runs) only where it ended in gloo's exit-time abort, as
    ``run_retrying_exit_abort`` does."""
    for _ in range(3):
        run = background.take(name)
        proc = run.result(timeout=TIMEOUT)
        record_launch(run.payload, 2, run.seconds or 0.0)
        if proc.returncode == 0 or EXIT_ABORT not in proc.stdout + proc.stderr:
            break
    return proc


@dataclasses.dataclass(frozen=True)
class ExampleRun:
    """One run of an example: what ``torchrun(script, *args, count_blocks=...)`` starts."""

    script: str
    args: tuple[str, ...]
    count_blocks: bool = True

    def __str__(self) -> str:
        return " ".join([self.script, *self.args])


def script_imports(path: Path) -> list[tuple[str, list[str]]]:
    """Every absolute import in the script (module level or inside a function), as
    ``(module, names)``: what a batch's ranks import once before forking the runs. The
    examples' own helper modules (``_deps``, ``accelerate_cpu_fsdp``) are left to the runs:
    they act when imported."""
    local = {p.stem for p in path.parent.glob("*.py")}
    found: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.setdefault(alias.name, set())
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.setdefault(node.module, set()).update(
                a.name for a in node.names if a.name != "*")
    return [(m, sorted(n)) for m, n in sorted(found.items())
            if m != "__future__" and m.split(".")[0] not in local]


def script_env(path: Path) -> dict[str, str]:
    """The environment variables the script sets at module level with literal values
    (``os.environ.setdefault("HF_HUB_OFFLINE", "1")``), before its imports read them:
    a batch's ranks set them before their own imports, and runs that set different ones
    get a launch of their own (tests/support/run_examples.py)."""
    env = {}
    for node in ast.parse(path.read_text()).body:
        call = node.value if isinstance(node, ast.Expr) else None
        if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                and call.func.attr == "setdefault" and ast.unparse(call.func.value) == "os.environ"
                and len(call.args) == 2 and all(isinstance(a, ast.Constant) for a in call.args)):
            env[call.args[0].value] = call.args[1].value
        elif (isinstance(node, ast.Assign) and len(node.targets) == 1
              and isinstance(node.targets[0], ast.Subscript)
              and ast.unparse(node.targets[0].value) == "os.environ"):
            raise ValueError(f"{path.name} assigns os.environ at module level: give it "
                             "os.environ.setdefault with literal values, or a launch of its own")
    return env


class ExampleBatch:
    """The runs the selected tests need, in as few 2-rank launches as their environments
    allow (one per set of ``script_env`` values), each started at the first ``result`` of
    one of its runs. Each run is a process of its own, forked from its rank once the
    modules its script imports are imported (tests/support/run_examples.py); each result
    is the ``CompletedProcess`` the run would have given alone (stdout and stderr rank
    0's then rank 1's, the first non-zero status)."""

    def __init__(self, runs: list[ExampleRun]) -> None:
        self.runs = list(dict.fromkeys(runs))
        self._results: dict[ExampleRun, subprocess.CompletedProcess] = {}
        groups: dict[tuple, list[ExampleRun]] = {}
        for run in self.runs:
            env = script_env(EXAMPLES / run.script)
            groups.setdefault(tuple(sorted(env.items())), []).append(run)
        self._groups = list(groups.items())

    def result(self, example: ExampleRun) -> subprocess.CompletedProcess:
        if example not in self.runs:  # not planned: a launch of its own
            return torchrun(example.script, *example.args, count_blocks=example.count_blocks)
        if example not in self._results:
            env, runs = next((e, r) for e, r in self._groups if example in r)
            # setdefault, as the scripts do: the caller's own value stands
            self._results.update(self._launch(runs, {k: v for k, v in env if k not in os.environ}))
        return self._results[example]

    @staticmethod
    def _launch(runs: list[ExampleRun], env: dict[str, str]
                ) -> dict[ExampleRun, subprocess.CompletedProcess]:
        world_size = 2
        preimport: dict[str, set[str]] = {}
        for script in [Path(COUNT_BLOCKS)] + [EXAMPLES / r.script for r in runs]:
            for module, names in script_imports(script):
                preimport.setdefault(module, set()).update(names)
        with tempfile.TemporaryDirectory() as folder:
            plan = {"out": folder,
                    "preimport": [[m, sorted(n)] for m, n in preimport.items()],
                    "runs": [{"script": str(EXAMPLES / r.script), "args": list(r.args),
                              "count_blocks": r.count_blocks, "port": free_port()}
                             for r in runs]}
            plan_path = os.path.join(folder, "plan.json")
            with open(plan_path, "w") as f:
                json.dump(plan, f)
            outs: list = []
            started, started_wall = time.monotonic(), time.time()
            procs = _start_ranks([sys.executable, RUN_EXAMPLES, plan_path], env, world_size, outs)
            _wait(procs, progress=lambda: len(list(Path(folder).glob("*.code"))))
            wall = time.monotonic() - started
            launcher = _read(outs)  # what a rank printed outside the runs
            results = {r: ExampleBatch._collect(Path(folder), i, r, world_size, procs, launcher)
                       for i, r in enumerate(runs)}
            first = Path(folder) / "0.0.start"
            setup = float(first.read_text()) - started_wall if first.exists() else None
        record_launch(f"examples batch ({len(runs)} runs: "
                      f"{'; '.join(str(r) for r in runs)})", world_size, wall, setup)
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
                            f"the rank exited with {status} (it failed itself, or the "
                            f"time limit); what the rank printed outside the runs:\n"
                            f"{launcher[rank][0][-2000:]}{launcher[rank][1][-4000:]}\n")
        code = next((c for c in codes if c != 0), 0)
        return subprocess.CompletedProcess([RUN_EXAMPLES, str(example)], code, "".join(outs),
                                           "".join(errs))


# The tests whose run can share the session's batch name it (``@batched(plan)``: ``plan``
# takes the test's parameters, by name, and returns its ``ExampleRun``). At collection's end
# (tests/conftest.py) the selected tests' runs become the session's batch; a test reads
# its run with ``session_batch().result(plan(...))``.
BATCHED: dict[Callable, Callable[..., ExampleRun | None]] = {}
_session: ExampleBatch | None = None


def batched(plan: Callable[..., ExampleRun | None]):
    """The test's run in the session's batch: ``plan`` takes the test's parameters by name
    and gives its run, or None where the test starts its own."""
    def register(test):
        BATCHED[test] = plan
        return test
    return register


def plan_session(items: list) -> None:
    global _session
    runs = []
    for item in items:
        plan = BATCHED.get(getattr(item, "function", None))
        if plan is None:
            continue
        callspec = getattr(item, "callspec", None)
        params = callspec.params if callspec is not None else {}
        run = plan(**{name: params[name] for name in inspect.signature(plan).parameters})
        if run is not None:  # None: the test starts its own
            runs.append(run)
    _session = ExampleBatch(runs) if runs else None


def session_batch() -> ExampleBatch:
    """The session's batch (an empty one where no selected test planned a run)."""
    return _session if _session is not None else ExampleBatch([])
