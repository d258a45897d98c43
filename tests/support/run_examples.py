"""Test-only launcher: one rank that runs several examples in turn, each as ``__main__``.

    python tests/support/run_examples.py PLAN.json

What tests/docs/test_examples.py starts on 2 ranks for the examples that need nothing
but torch and this library, instead of two new processes per run: starting a rank
(Python, torch, the process group) costs seconds, an example on the CPU a few. The plan
holds the output folder and the runs; each run is a script, its arguments, whether
``tests/support/count_blocks.py`` counts its blocks, and its own ``MASTER_PORT`` (every
example starts and destroys its process group; a fresh port avoids a store still
closing on the last one). For run ``i`` this rank writes ``i.RANK.out`` and
``i.RANK.err`` (its file descriptors 1 and 2, so what C++ prints is there too), then
``i.RANK.code``, the exit status the run would have ended its process with.

A run that fails ends this rank at once with its status: the other rank, waiting in
a collective or in the next run's rendezvous, is stopped by the launcher, and the runs
after it have no ``.code`` file (the tests say so). The process leaves through
``run_example.exit_now``, without the interpreter's teardown (see run_example.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import sys
import time
import traceback
from collections.abc import Iterator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from count_blocks import counting  # noqa: E402
from run_example import exit_now  # noqa: E402


@contextlib.contextmanager
def _output_to(out_path: str, err_path: str) -> Iterator[None]:
    """File descriptors 1 and 2 (and ``sys.stdout``/``sys.stderr`` with them) go to the
    two files; restored in ``finally``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    try:
        with open(out_path, "w") as out, open(err_path, "w") as err:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            try:
                yield
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def _run_one(script: str, argv: list[str]) -> int:
    """``script`` as ``__main__``; the status ``sys.exit`` would have exited with."""
    sys.argv = [script, *argv]
    folder = os.path.dirname(os.path.abspath(script))
    if folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None:
            return 0
        if isinstance(exc.code, int):
            return exc.code
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:  # the traceback as Python prints it
        traceback.print_exc()
        return 1
    return 0


def main(plan_path: str) -> None:
    import torch.distributed  # noqa: F401 (before the first run: the launch's setup time)

    with open(plan_path) as f:
        plan = json.load(f)
    rank, folder = os.environ["RANK"], plan["out"]
    for i, run in enumerate(plan["runs"]):
        os.environ["MASTER_PORT"] = str(run["port"])
        with open(os.path.join(folder, f"{i}.{rank}.start"), "w") as f:
            f.write(f"{time.time()}\n")
        with _output_to(os.path.join(folder, f"{i}.{rank}.out"),
                        os.path.join(folder, f"{i}.{rank}.err")):
            with counting() if run["count_blocks"] else contextlib.nullcontext():
                code = _run_one(run["script"], run["args"])
        with open(os.path.join(folder, f"{i}.{rank}.code"), "w") as f:
            f.write(f"{code}\n")
        if code != 0:
            exit_now(code)
    exit_now(0)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(sys.argv[1])
