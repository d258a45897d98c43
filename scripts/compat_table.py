#!/usr/bin/env python
"""Records one torch version's suite result and rewrites docs/compat.md.

Called by scripts/torch_matrix.sh after each version; the results live in
docs/compat.json (one entry per torch version, the latest run wins), and the
markdown table is rendered from them. An entry's ``note`` (written by hand, e.g. a
failure and its fix) is listed under the table; a new run of that version drops it.
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
        "| torch | suite | passed | failed | skipped | errors | test time | date | commit | command |",
        "|---|---|--:|--:|--:|--:|--:|---|---|---|",
    ]
    for version in sorted(entries, key=_version_key):
        e = entries[version]
        c = e["counts"]
        lines.append(
            f"| {version} | {'subset' if e['subset'] else 'full'} | {c['passed']} | "
            f"{c['failed']} | {c['skipped']} | {c['error']} | {e['seconds'] / 60:.1f} min | "
            f"{e['date']} | {e.get('commit', '?')} | `{e['command']}` |"
        )
    notes = [f"- {v}: {entries[v]['note']}" for v in sorted(entries, key=_version_key)
             if entries[v].get("note")]
    if notes:
        lines += ["", *notes]
    lines += ["", "Python " + platform.python_version() + ", " + platform.machine() + ".", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--version", required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--seconds", type=int, required=True)
    parser.add_argument("--subset", type=int, default=0)
    parser.add_argument("--command", required=True)
    parser.add_argument("--commit", default="?")
    args = parser.parse_args()
    path = DOCS / "compat.json"
    entries = json.loads(path.read_text()) if path.exists() else {}
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
    path.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")
    (DOCS / "compat.md").write_text(render(entries))


if __name__ == "__main__":
    main()
