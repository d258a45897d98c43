#!/usr/bin/env python
"""Records one torch version's suite result and rewrites docs/compat.md.

Called by scripts/torch_matrix.sh after each version; the results live in
docs/compat.json (one entry per torch version, the latest run wins), and the
markdown table is rendered from them. An entry's ``note`` (written by hand, e.g. a
failure and its fix) is listed under the table; a new run of that version drops it.
Each entry records the calibration the script measured in that venv before the tests
(``python -m fsdp_retain.report calibrate``), shown beside the test time; entries from
before it say "not recorded". ``--render`` only rewrites docs/compat.md from the JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _counts(result: str) -> dict[str, int]:
    counts = {k: 0 for k in ("passed", "failed", "skipped", "error")}
    for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", result):
        counts["error" if word.startswith("error") else word] = int(number)
    return counts


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version))


def render(entries: dict[str, dict]) -> str:
    lines = [
        "# Torch compatibility",
        "",
        "The project's own test suite, run by `scripts/torch_matrix.sh` on each torch",
        "version in a fresh venv (torch from the registry, CPU, gloo, 2-core machine).",
        "Registry builds carry CUDA; they run on the CPU here. \"subset\" rows ran only",
        "the modules in `tests/matrix_subset.txt` (what CI runs on the oldest and newest",
        "torch); the full-suite rows are the proof for each version.",
        "",
        "The test time is the pytest run's wall time; beside it, the machine's calibration",
        "measured in that venv just before the tests (`python -m fsdp_retain.report",
        "calibrate`: seconds for a fixed Python loop / a fixed torch matmul loop, one thread;",
        "a machine that takes twice as long on it runs the suite about half as fast; \"not",
        "recorded\": a run from before the script measured it).",
        "",
        "| torch | suite | passed | failed | skipped | errors | test time | calibration (python / torch) | date | commit | command |",
        "|---|---|--:|--:|--:|--:|--:|--:|---|---|---|",
    ]
    for version in sorted(entries, key=_version_key):
        e = entries[version]
        c = e["counts"]
        calib = e.get("calibration")
        speed = (f"{calib['python_s']:.3f} s / {calib['torch_s']:.3f} s" if calib
                 else "not recorded")
        lines.append(
            f"| {version} | {'subset' if e['subset'] else 'full'} | {c['passed']} | "
            f"{c['failed']} | {c['skipped']} | {c['error']} | {e['seconds'] / 60:.1f} min | "
            f"{speed} | {e['date']} | {e.get('commit', '?')} | `{e['command']}` |"
        )
    notes = [f"- {v}: {entries[v]['note']}" for v in sorted(entries, key=_version_key)
             if entries[v].get("note")]
    if notes:
        lines += ["", *notes]
    lines += ["", "Python " + platform.python_version() + ", " + platform.machine() + ".", ""]
    return "\n".join(lines)


def parse_calibration(line: str) -> dict[str, float] | None:
    """The two values of ``python -m fsdp_retain.report calibrate``'s line; None for ""."""
    if not line:
        return None
    found = re.search(r"calibration: python (\d+\.\d+) s, torch (\d+\.\d+) s", line)
    if found is None:
        raise ValueError(f"--calibration {line!r}: pass the line `python -m fsdp_retain.report "
                         "calibrate` prints (calibration: python 0.095 s, torch 0.015 s ...), "
                         "or leave it out")
    return {"python_s": float(found.group(1)), "torch_s": float(found.group(2))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--render", action="store_true",
                        help="only rewrite docs/compat.md from docs/compat.json")
    parser.add_argument("--version")
    parser.add_argument("--result")
    parser.add_argument("--seconds", type=int)
    parser.add_argument("--subset", type=int, default=0)
    parser.add_argument("--command")
    parser.add_argument("--commit", default="?")
    parser.add_argument("--calibration", default="",
                        help="the line `python -m fsdp_retain.report calibrate` printed in the venv")
    args = parser.parse_args()
    path = DOCS / "compat.json"
    entries = json.loads(path.read_text()) if path.exists() else {}
    if args.render:
        (DOCS / "compat.md").write_text(render(entries))
        return
    missing = [f"--{k}" for k in ("version", "result", "seconds", "command")
               if getattr(args, k) is None]
    if missing:
        parser.error(f"{', '.join(missing)} required (or --render alone)")
    calibration = parse_calibration(args.calibration)
    previous = entries.get(args.version)
    if args.subset and previous and not previous["subset"]:
        return  # a subset run never overwrites the full-suite proof
    entries[args.version] = {
        "result": args.result,
        "counts": _counts(args.result),
        "seconds": args.seconds,
        "subset": bool(args.subset),
        "date": datetime.date.today().isoformat(),
        "command": args.command,
        "commit": args.commit,
    }
    if calibration is not None:
        entries[args.version]["calibration"] = calibration
    path.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")
    (DOCS / "compat.md").write_text(render(entries))


if __name__ == "__main__":
    main()
