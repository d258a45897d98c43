#!/usr/bin/env python
"""Times one CPU command and records it with this machine's calibration, for the docs.

    python scripts/cpu_timing.py docs/cpu_timings.json NAME [--output FILE] -- COMMAND...

Measures the calibration (``python -m fsdp_retain.report calibrate``'s two values), then
runs COMMAND in this folder, and writes under NAME in the JSON file: the command, its wall
seconds, CPU seconds (user + system, with its children), the largest resident set of one
of its processes (MiB), the date, the code's commit, the CPUs and the calibration.
``--output FILE`` also keeps its stdout there under a ``$ COMMAND`` line and a
``# machine: calibration: ...`` line (a page shows it with ``<!-- begin: output FILE -->``).
Pages quote the JSON through scripts/docs_figures.py's markers, a time with its
calibration beside it (``derived calibration``). Run it on an otherwise idle machine (the
calibration is measured before the command, not during it); a command that fails records
nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

# Runs the command from a small process of its own: a child's peak resident set counts the
# parent's pages it was forked with (here torch's, from the calibration).
_RUN = """
import json, resource, subprocess, sys, time
start = time.perf_counter()
code = subprocess.run(sys.argv[2:]).returncode
wall = time.perf_counter() - start
used = resource.getrusage(resource.RUSAGE_CHILDREN)
with open(sys.argv[1], "w") as f:
    json.dump({"code": code, "wall_s": wall, "cpu_s": used.ru_utime + used.ru_stime,
               "max_rss_kib": used.ru_maxrss}, f)  # KiB on Linux
"""


def _commit() -> str:
    """This folder's commit; ``+changes`` when the code under test differs from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "?"
    return commit + ("+changes" if git("status", "--porcelain", "--", "fsdp_retain", "examples",
                                       "tests") else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", type=Path)
    parser.add_argument("name")
    parser.add_argument("--output", type=Path, help="also keep the command's stdout here")
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args, command = parser.parse_args(argv[:split]), argv[split + 1:]
    if not command:
        parser.error("name the command after --: scripts/cpu_timing.py FILE NAME -- COMMAND...")

    from fsdp_retain.report._calibrate import calibration, calibration_line

    calib = {k: round(v, 3) for k, v in calibration().items()}
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        proc = subprocess.run([sys.executable, "-c", _RUN, str(result), *command],
                              stdout=subprocess.PIPE, text=True)
        used = json.loads(result.read_text()) if result.exists() else {"code": proc.returncode}
    if used["code"] != 0:
        sys.stdout.write(proc.stdout)
        print(f"{shlex.join(command)} exited {used['code']}: nothing recorded", file=sys.stderr)
        return used["code"] or 1

    entry = {
        "command": shlex.join(command),
        "date": datetime.date.today().isoformat(),
        "commit": _commit(),
        "cpus": os.cpu_count(),
        "calibration": calib,
        "wall_s": round(used["wall_s"], 1),
        "cpu_s": round(used["cpu_s"], 1),
        "max_rss_mib": round(used["max_rss_kib"] / 1024),
    }
    entries = json.loads(args.json.read_text()) if args.json.exists() else {}
    entries[args.name] = entry
    args.json.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")
    if args.output is not None:
        args.output.write_text(f"$ {entry['command']}\n# machine: {calibration_line(calib)}\n\n"
                               + proc.stdout)
    print(f"{args.name}: {entry['wall_s']} s wall, {entry['cpu_s']} s CPU, "
          f"{entry['max_rss_mib']} MiB; {calibration_line(calib)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
