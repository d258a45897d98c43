"""What the report needs beyond torch, checked before anything runs.

The library needs only torch; the report builds its model with ``transformers``
and draws its figures with ``matplotlib`` (the ``report`` extra), and its
``deepspeed`` backend needs ``deepspeed`` (the ``deepspeed`` extra).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

# module -> (what the report uses it for, the extra that installs it)
REQUIRED = {"transformers": ("it builds the model", "report")}
BY_BACKEND = {"deepspeed": ("deepspeed", "--backend deepspeed runs a ZeRO-3 engine", "deepspeed")}
OPTIONAL = {"matplotlib": ("report.png and tradeoff.png", "report")}


class MissingDependency(RuntimeError):
    """A package the requested report needs is not installed; the message names the extra."""


def _importable(name: str) -> bool:
    # Imported, not only found: a package that is present but broken fails here too.
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def install_hint(extra: str) -> str:
    # fsdp-retain is not on a package index: its extras install from a clone.
    prefix = "DS_BUILD_OPS=0 " if extra == "deepspeed" else ""
    return f"{prefix}pip install '.[{extra}]' in a clone of fsdp-retain (the {extra} extra)"


def check_dependencies(backends: Iterable[str] = ()) -> list[str]:
    """Raises ``MissingDependency`` naming the extra for a package the run needs.

    Returns notes on optional packages that are missing (the run goes on without
    what they give).
    """
    missing = [(name, why, extra) for name, (why, extra) in REQUIRED.items()
               if not _importable(name)]
    for backend in backends:
        if backend in BY_BACKEND:
            name, why, extra = BY_BACKEND[backend]
            if not _importable(name):
                missing.append((name, why, extra))
    if missing:
        lines = [f"python -m fsdp_retain.report needs {name} ({why}), which is not installed: "
                 f"{install_hint(extra)}" for name, why, extra in missing]
        raise MissingDependency("\n".join(lines))
    return [f"no {what}: {name} is not installed ({install_hint(extra)})"
            for name, (what, extra) in OPTIONAL.items() if not _importable(name)]
