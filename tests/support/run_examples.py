"""Test-only launcher: one rank that runs several examples in turn, each in a process of
its own forked from this one after the imports they share.

    python tests/support/run_examples.py PLAN.json

What tests/support/examples.py starts on 2 ranks instead of two new processes per run:
starting a rank costs seconds of imports (torch, transformers, the Trainer, DeepSpeed,
sentence-transformers: 2-6 s of CPU per rank), an example on the CPU a few. This rank
imports what the plan names once (``preimport``: the modules the runs' scripts import,
tests/support/examples.py reads them off the scripts) and forks a child per run: the
child starts with those modules imported and nothing else done (no process group, no
accelerate or DeepSpeed state, no patch), runs the script as ``__main__`` with its
arguments, its own ``MASTER_PORT`` and, where the run asks, ``count_blocks.py``'s
wrapper, and leaves through ``run_example.exit_now`` (without the interpreter's
teardown, see run_example.py). Whatever a run leaves behind (singletons, patches,
environment variables, the process group) ends with its child.

For run ``i`` this rank writes ``i.RANK.start``, then the child's file descriptors 1 and 2
into ``i.RANK.out`` and ``i.RANK.err`` (what C++ prints is there too), then ``i.RANK.code``,
the child's exit status. A run that fails does not stop the batch. As torchrun stops a
launch's other ranks when one fails, a child still running ``PEER_FAILED_GRACE`` seconds
after another rank's child of the same run ended non-zero (in a collective that will never
complete) is killed (status -9, said in its ``.err``), and the next run starts.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from count_blocks import counting  # noqa: E402
from run_example import exit_now  # noqa: E402
from run_example import run as run_script  # noqa: E402

PEER_FAILED_GRACE = 5.0  # seconds a run's child may outlive a peer's failed child


def _preimport(modules: list[list]) -> None:
    """``[module, [names]]``: imports each module and looks up the names (a lazy module's
    attributes, as ``from module import name`` would). One that fails is left to the runs,
    which report it as they would alone."""
    for module, names in modules:
        try:
            imported = importlib.import_module(module)
        except BaseException:  # noqa: BLE001 - the run that needs it reports it
            continue
        for name in names:
            try:
                getattr(imported, name)
            except BaseException:  # noqa: BLE001 - idem
                pass


def _child(run: dict, out_path: str, err_path: str) -> None:
    """In the forked child: the run, its output into the two files; leaves through
    ``run_example.exit_now`` (inside ``run_example.run``), never returns."""
    try:
        os.environ["MASTER_PORT"] = str(run["port"])
        with open(out_path, "w") as out, open(err_path, "w") as err:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
        with counting() if run["count_blocks"] else contextlib.nullcontext():
            run_script(run["script"], run["args"])
    except BaseException:  # noqa: BLE001 - the child must leave through exit_now
        traceback.print_exc()
    exit_now(1)


def _peer_failed(folder: str, i: int, rank: str, world_size: int) -> bool:
    for peer in range(world_size):
        path = os.path.join(folder, f"{i}.{peer}.code")
        if str(peer) != rank and os.path.exists(path):
            with open(path) as f:
                text = f.read().strip()
            if text and int(text) != 0:
                return True
    return False


def _wait_child(pid: int, folder: str, i: int, rank: str, world_size: int) -> int:
    """The child's exit status (``-signal`` when a signal ended it), killing it once a
    peer's child of the same run failed ``PEER_FAILED_GRACE`` seconds ago."""
    failed_since = None
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if failed_since is None and _peer_failed(folder, i, rank, world_size):
            failed_since = time.monotonic()
        if failed_since is not None and time.monotonic() - failed_since > PEER_FAILED_GRACE:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            with open(os.path.join(folder, f"{i}.{rank}.err"), "a") as err:
                err.write(f"\n[examples batch] run {i} killed on rank {rank}: another "
                          f"rank's run failed {PEER_FAILED_GRACE:.0f} s before (as torchrun "
                          "stops the other ranks)\n")
            return -signal.SIGKILL
        time.sleep(0.02)


def main(plan_path: str) -> None:
    with open(plan_path) as f:
        plan = json.load(f)
    _preimport(plan["preimport"])  # before the first run: the launch's setup time
    rank, folder = os.environ["RANK"], plan["out"]
    world_size = int(os.environ["WORLD_SIZE"])
    for i, run in enumerate(plan["runs"]):
        with open(os.path.join(folder, f"{i}.{rank}.start"), "w") as f:
            f.write(f"{time.time()}\n")
        out_path = os.path.join(folder, f"{i}.{rank}.out")
        err_path = os.path.join(folder, f"{i}.{rank}.err")
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(run, out_path, err_path)
        code = _wait_child(pid, folder, i, rank, world_size)
        path = os.path.join(folder, f"{i}.{rank}.code")
        with open(path + ".tmp", "w") as f:  # whole when a peer or the launcher reads it
            f.write(f"{code}\n")
        os.replace(path + ".tmp", path)
    exit_now(0)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(sys.argv[1])
