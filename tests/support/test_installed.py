"""skip_unless_installed (tests/support/installed.py): skips where the package is missing
and imports nothing where it is found (``pytest.importorskip``, which it replaces in the
client test modules, imports it)."""

from __future__ import annotations

import sys

import pytest

from tests.support.installed import skip_unless_installed


@pytest.fixture
def broken_package(tmp_path, monkeypatch):
    """A package on sys.path whose import raises ImportError (a half-installed stack)."""
    name = "fsdp_retain_test_broken_pkg"
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("raise ImportError('half installed')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_skips_a_missing_package():
    with pytest.raises(pytest.skip.Exception, match="not installed here"):
        skip_unless_installed("fsdp_retain_no_such_package", reason="not installed here")


def test_finds_a_package_without_importing_it(broken_package):
    # Its import raises: the check neither raises nor skips, so it never ran.
    skip_unless_installed(broken_package, reason="unused")
    assert broken_package not in sys.modules


def test_a_dotted_name_is_refused():
    with pytest.raises(ValueError, match=r"name the top-level package \('olmo_core'\)"):
        skip_unless_installed("olmo_core.nn", reason="unused")
