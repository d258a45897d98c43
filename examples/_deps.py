"""What an example needs beyond torch, checked before its ranks start any work.

Without the check a missing package shows up in the middle of a run, as an
``ImportError`` on every rank, a process group torn down mid-collective and a
launcher's failure report. ``require(...)`` exits first, with one message naming what
installs it (rank 0 says it; the other ranks exit quietly), as
``python -m fsdp_retain.report`` checks its extras.
"""

from __future__ import annotations

import importlib
import os
import sys
import time


def _importable(name: str) -> bool:
    # Imported, not only found: a package that is present but broken fails here too.
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def require(*modules: str, why: str, extra: str | None = None, pip: str | None = None) -> None:
    """Exits (status 1) unless every module imports. ``extra``: this repository's extra
    that installs them (``pip install '.[extra]'`` from a clone); ``pip``: the
    requirement to install otherwise."""
    missing = [name for name in modules if not _importable(name)]
    if not missing:
        return
    if int(os.environ.get("RANK", "0")) != 0:
        time.sleep(5)  # rank 0 says why, once; the launcher then stops this rank
        sys.exit(1)
    how = (f" from a clone of this repository: pip install '.[{extra}]'" if extra
           else f": pip install {pip}")
    names = ", ".join(missing)
    verb, pronoun = ("is", "it") if len(missing) == 1 else ("are", "them")
    sys.exit(f"error: {why} needs {names}, which {verb} not installed. Install {pronoun}{how}")
