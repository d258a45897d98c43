"""Skipping a test module when a package is missing, without importing the package.

``pytest.importorskip("bergson")`` imports bergson in the pytest process only to learn
that it is installed: 25 s of one core here (datasets, pandas, peft, bitsandbytes,
torch's compiler), and the pytest process of an example's test runs none of its code:
the example's ranks import it themselves. ``skip_unless_installed`` asks the import
system where the package would be found (``importlib.util.find_spec``) and skips only
when it would not be. A package that is found but fails to import is not skipped: the
ranks that import it fail, loudly.

A test module whose cases module imports the package at collection (the harness's
``case_tests``) pays the import there anyway; the check costs nothing either way.
"""

from __future__ import annotations

import importlib.util

import pytest


def skip_unless_installed(module: str, reason: str) -> None:
    """Skips the calling test module unless ``module`` (a top-level package) is installed.

    Example::

        skip_unless_installed("bergson", reason="bergson not installed (scripts/venv_ci.sh bergson)")
    """
    if "." in module:
        raise ValueError(f"{module!r}: name the top-level package ({module.split('.')[0]!r}), "
                         "whose spec is found without importing anything")
    if importlib.util.find_spec(module) is None:
        pytest.skip(reason, allow_module_level=True)
