"""Test-only launcher: run an example as ``__main__``, then leave the process without the
interpreter's teardown.

    python tests/support/run_example.py examples/chunked_ce.py [args]

Why: a 2-rank gloo run that passed and printed its result sometimes dies at interpreter
exit with ``terminate called without an active exception`` (SIGABRT), after the script's
``dist.destroy_process_group()`` returned: torch's gloo threads torn down during
finalization (docs/limits.md; seen without fsdp_retain imported too). What a test checks
happens before that, so ``exit`` ends the process with ``os._exit`` once the script is done
and its output flushed: nothing of the script is skipped, only C++ teardown after it.
``tests/support/count_blocks.py`` ends the same way.
"""

from __future__ import annotations

import os
import runpy
import sys


def exit_now(code: object) -> None:
    """``os._exit`` with what ``sys.exit(code)`` would have exited with, through the
    report's ``leave`` (output flushed first; the script has imported torch by then)."""
    from fsdp_retain.report._launch import leave

    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        print(code, file=sys.stderr)
        status = 1
    leave(status)


def run(script: str, argv: list[str]) -> None:
    """Runs ``script`` as ``__main__`` with ``argv``, then ``exit_now``."""
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    code: object = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # the traceback as Python prints it, then the same exit status
        import traceback

        traceback.print_exc()
        code = 1
    exit_now(code)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    run(sys.argv[1], sys.argv[2:])
