"""``python -m fsdp_retain.report.figures``: the report's figures, from ``report.json`` files.

Example::

    python -m fsdp_retain.report.figures --report docs/report/report.json \\
        --fit docs/report/fit/*/report.json --out docs/report

writes, into ``--out``, ``report.png`` and ``tradeoff.png`` of the ``--report`` run
(what the report itself writes beside its ``report.json``) and ``will_it_fit.png``
and ``will_it_fit.md`` (the figure's table) of the ``--fit`` runs
(``--simulate-world-size`` runs, one per model and world size). Drawing:
``_figures.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ._deps import install_hint
from ._fit import parse_bytes
from ._rows import Report


def _read(path: str) -> Report:
    return Report.from_json(json.loads(Path(path).read_text()))


def main(argv: list[str] | None = None) -> int:
    """Writes the figures a command line asks for; 2 when matplotlib is missing."""
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_retain.report.figures",
        description="The report's figures (matplotlib) from report.json files.",
    )
    parser.add_argument("--report", metavar="JSON",
                        help="a timed run: report.png and tradeoff.png")
    parser.add_argument("--fit", nargs="+", default=[], metavar="JSON",
                        help="--simulate-world-size runs: will_it_fit.png and will_it_fit.md")
    parser.add_argument("--gpu-memory", nargs="+", default=["80GiB", "141GiB"], metavar="SIZE",
                        help="the GPU memory lines of will_it_fit.png (default: 80GiB 141GiB)")
    parser.add_argument("--out", required=True, help="output directory")
    args = parser.parse_args(argv)
    if args.report is None and not args.fit:
        parser.error("pass --report and/or --fit: the report.json files to draw")
    for path in [args.report, *args.fit]:
        if path is not None and not Path(path).is_file():
            parser.error(f"{path}: no such report.json; run python -m fsdp_retain.report first")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        written = _draw(args, out)
    except ImportError as exc:  # matplotlib missing or too old
        print(f"error: {exc}; {install_hint('report')}", file=sys.stderr)
        return 2
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _draw(args: argparse.Namespace, out: Path) -> list[Path]:
    from ._figures import save
    from ._fit_figure import fit_figure, fit_table
    from ._output import write_figures

    written: list[Path] = []
    if args.report is not None:
        written += list(write_figures(_read(args.report), out).values())
    if args.fit:
        reports = [_read(path) for path in args.fit]
        sizes = [parse_bytes(size) for size in args.gpu_memory]
        save(fit_figure(reports, sizes), out / "will_it_fit.png")
        (out / "will_it_fit.md").write_text(fit_table(reports, sizes))
        written += [out / "will_it_fit.png", out / "will_it_fit.md"]
    return written


if __name__ == "__main__":
    sys.exit(main())
