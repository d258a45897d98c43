"""The runs a session starts early (tests/support/background.py): started once the tests
are collected where a selected test uses the fixture, output kept whole (in files: a pipe
nobody reads would stop the run), taken by the fixture, killed at the session's end when
no test took them."""

from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from tests.support import background


def _python(code: str, **kwargs) -> background.BackgroundRun:
    return background.BackgroundRun([sys.executable, "-c", code], **kwargs)


def test_output_kept_whole_and_exit_code():
    run = _python("import sys; print('x' * 300_000); print('err', file=sys.stderr); sys.exit(3)")
    proc = run.result(timeout=60)
    assert proc.returncode == 3
    assert proc.stdout == "x" * 300_000 + "\n" and proc.stderr == "err\n"
    assert run.seconds is not None and run.seconds < 60


def test_seconds_until_it_ended_not_until_read():
    run = _python("pass")
    time.sleep(3)
    run.result(timeout=60)
    assert run.seconds is not None and run.seconds < 2.5, run.seconds


def test_timeout_kills_like_subprocess_run():
    run = _python("import time; time.sleep(60)")
    with pytest.raises(subprocess.TimeoutExpired):
        run.result(timeout=0.5)
    assert run._proc.returncode is not None  # killed, not left running


def test_started_at_collection_taken_or_killed(tmp_path, monkeypatch):
    monkeypatch.setattr(background, "STARTERS", {})
    monkeypatch.setattr(background, "_started", {})
    monkeypatch.setattr(background, "_WHEN", {})
    marker = tmp_path / "started"
    background.starts_early("used")(
        lambda: _python(f"open({str(marker)!r}, 'w').close(); print('done')"))
    background.starts_early("unused")(lambda: pytest.fail("started for no selected test"))
    background.starts_early("left")(lambda: _python("import time; time.sleep(60)"))
    items = [SimpleNamespace(fixturenames=["tmp_path", "used"]), SimpleNamespace(fixturenames=["left"])]
    background.plan_session(items)
    deadline = time.monotonic() + 30
    while not marker.exists() and time.monotonic() < deadline:  # runs before any take
        time.sleep(0.05)
    assert marker.exists()
    assert background.take("used").result(timeout=30).stdout == "done\n"
    left = background._started["left"]
    background.stop_all()
    assert left.run._proc.returncode is not None and left.run._proc.returncode < 0
    assert background._started == {}


def test_at_most_two_at_once_in_order(tmp_path, monkeypatch):
    """Three planned runs: the first two start at once, the third when one of them ends;
    one taken before its turn starts then, and its turn starts nothing."""
    monkeypatch.setattr(background, "STARTERS", {})
    monkeypatch.setattr(background, "_started", {})
    monkeypatch.setattr(background, "_WHEN", {})
    starts: list[str] = []

    def starter(name: str, code: str):
        def start():
            starts.append(name)
            return _python(code)
        return start

    release = tmp_path / "release"
    wait = f"import os, time\nwhile not os.path.exists({str(release)!r}): time.sleep(0.05)"
    for name in ("first", "second"):
        background.starts_early(name)(starter(name, wait))
    background.starts_early("third")(starter("third", "print('third')"))
    background.starts_early("fourth")(starter("fourth", "print('fourth')"))
    background.plan_session([SimpleNamespace(fixturenames=["first", "second", "third", "fourth"])])
    time.sleep(1.0)
    assert starts == ["first", "second"]  # the third waits for a free turn
    assert background.take("fourth").result(timeout=30).stdout == "fourth\n"  # before its turn
    release.touch()
    assert background.take("third").result(timeout=30).stdout == "third\n"
    for name in ("first", "second"):
        assert background.take(name).result(timeout=30).returncode == 0
    assert starts == ["first", "second", "fourth", "third"]  # the fourth's turn started none
    background.stop_all()


def test_taken_gives_the_result_and_deletes_its_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(background, "STARTERS", {})
    monkeypatch.setattr(background, "_started", {})
    monkeypatch.setattr(background, "_WHEN", {})
    folder = tmp_path / "run"
    folder.mkdir()
    background.starts_early("writes")(lambda: _python(
        f"open({str(folder / 'out.txt')!r}, 'w').write('x'); print('ok')", payload=folder))
    with background.taken("writes", timeout=30) as (proc, payload):
        assert proc.stdout == "ok\n" and (payload / "out.txt").read_text() == "x"
    assert not folder.exists()
