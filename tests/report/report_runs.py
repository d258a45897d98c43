"""The report's runs that the report tests read, started when the session's tests are
collected (tests/support/background.py): each a process of its own (a run spawns its
ranks), beside the tests before these modules, where left to their turn they ran one
after another near the session's end.

``start_report`` runs ``run_report(ReportConfig(**config))`` as the tests did in their
own process and prints what it returned (``returned_report`` reads it back);
``start_command`` runs ``python -m fsdp_retain.report`` with its arguments
(``written_report`` reads its files). ``taken`` waits for a fixture's run and deletes its
folder afterwards.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tests.support import background
from tests.support.harness import ROOT, timeout_scale

_MARK = "RETURNED_REPORT "
_RUN = f"""
import json, sys
from fsdp_retain.report import ReportConfig, run_report
config = {{k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(sys.argv[1]).items()}}
print({_MARK!r} + json.dumps(run_report(ReportConfig(**config))), flush=True)
"""


def start_report(prefix: str, **config) -> background.BackgroundRun:
    """``run_report(ReportConfig(**config, out=<a new folder>))``; the folder is the payload."""
    out = Path(tempfile.mkdtemp(prefix=prefix))
    return background.BackgroundRun(
        [sys.executable, "-c", _RUN, json.dumps(dict(config, out=str(out)))],
        payload=out, cwd=ROOT)


def start_command(prefix: str, *args: str) -> background.BackgroundRun:
    """``python -m fsdp_retain.report ARGS --out <a new folder>``; the folder is the payload."""
    out = Path(tempfile.mkdtemp(prefix=prefix))
    return background.BackgroundRun(
        [sys.executable, "-m", "fsdp_retain.report", *args, "--out", str(out)],
        payload=out, cwd=ROOT)


@contextlib.contextmanager
def taken(fixture: str, timeout: float = 600
          ) -> Iterator[tuple[subprocess.CompletedProcess, Path]]:
    """The fixture's run, waited for (``timeout`` seconds, scaled); its folder deleted after."""
    with background.taken(fixture, timeout * timeout_scale()) as run:
        yield run


def returned_report(proc: subprocess.CompletedProcess) -> dict:
    """What ``run_report`` returned in a ``start_report`` run (which must have passed)."""
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith(_MARK)]
    return json.loads(line[len(_MARK):])


def written_report(proc: subprocess.CompletedProcess, out: Path) -> tuple[dict, dict, str]:
    """A ``start_command`` run's files (it must have passed): the report, its rows by label,
    and report.md."""
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads((out / "report.json").read_text())
    return data, {r["label"]: r for r in data["rows"]}, (out / "report.md").read_text()
