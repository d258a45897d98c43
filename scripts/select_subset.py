"""Chooses what CI runs on the oldest and newest torch: tests/matrix_subset.txt.

The version subsets exist to prove the code that differs between torch versions:
every line of the library that reaches into torch (the backends' private access,
the compat probes, the engine-entry wrapper, the saved-tensor and graph walks). So
they are chosen from a measurement, not by hand:

1. Run the suite with each case's library lines and seconds recorded (rank 0; see
   ``_Measure`` in tests/support/harness.py), on one or more torch versions::

       FSDP_RETAIN_COVERAGE=/tmp/cov FSDP_RETAIN_CASE_TIMES=/tmp/cov/times.jsonl \\
           .venv/bin/python -m pytest -q

2. ``python scripts/select_subset.py /tmp/cov [more dirs] > tests/matrix_subset.txt``
   (needs ``coverage``; the suite's venv has it).

The choice: every library line any case ran (outside the report, and outside the
DeepSpeed backend, whose tests run on one pinned torch), run by at least one chosen
case; cases chosen greedily by new lines per second (a module's first case also pays
its launch); then one parity case per backend and option that the cover missed
(``REQUIRED`` patterns), and the rank-free tests in ``ALWAYS``.
"""

from __future__ import annotations

import argparse
import collections
import fnmatch
import importlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAUNCH_SECONDS = 5.0  # starting the ranks of one more launch
# Library files whose lines the subset must run: all but the report and DeepSpeed's.
EXCLUDE = ("fsdp_retain/report/*", "fsdp_retain/_deepspeed*")
# Tests without ranks, run whole: the policy and the engine-entry wrapper (seconds).
ALWAYS = ("tests/api/test_policy.py", "tests/api/test_public_api.py")
# One parity case (against the unsharded reference, several steps) per backend and
# option value: each pattern (fnmatch over "module:case") is met by a chosen case, the
# cheapest one matching where the cover chose none.
_FSDP2 = "tests.fsdp2.cases_fsdp2:parity"
_FSDP1 = "tests.fsdp1.cases_fsdp1:parity"
_OPTIONS = ("keep_every", "keep_last", "regather_every", "regather_last", "nbackwards",
            "backwards", "accum", "zero")
REQUIRED = (
    *(f"{_FSDP2}_*_{opt}_*" for opt in (*_OPTIONS, "raf", "noraf")),
    *(f"{_FSDP1}_*_{opt}_*" for opt in _OPTIONS),
    *(f"tests.fsdp1.cases_fsdp1:parity_{strategy}_*" for strategy in (
        "full_flat", "full_orig", "gradop_flat", "gradop_orig", "noshard_flat", "noshard_orig")),
    "tests.options.cases_budget:budget_fsdp2_kept1_*",
    "tests.options.cases_budget:budget_fsdp1_*_kept1_*",
    "tests.options.cases_probe:parity_fsdp2_*", "tests.options.cases_probe:parity_fsdp1_*",
    "tests.loss_grads.cases_loss_grads:loss_grads_upgrad_fsdp2",
    "tests.loss_grads.cases_loss_grads:loss_grads_upgrad_fsdp1_*",
    # torch.compile per block: dynamo changes most between versions, beyond library lines.
    "tests.real_stacks.cases_compile:compile_*fsdp2*",
    "tests.real_stacks.cases_compile:compile_*fsdp1*",
    # The composable replicate's private state, read by name (_ddp/_wrappers.py), and
    # replicate_with_fsdp's, whose mesh argument changed between versions.
    "tests.ddp.cases_ddp_replicate:replicate_parity_mesh_*",
    "tests.ddp.cases_ddp_replicate:replicate_compiled_blocks_*",
    "tests.fsdp2.cases_fsdp2:replicate_with_fsdp_*",
)


def case_tests() -> dict[tuple[str, int], str]:
    """(cases module, world size) -> the pytest test that runs it, e.g.
    tests/fsdp2/test_fsdp2.py::test_fsdp2."""
    sys.path.insert(0, str(ROOT))
    found = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        relative = path.relative_to(ROOT)
        try:
            mod = importlib.import_module(".".join(relative.with_suffix("").parts))
        except BaseException:  # noqa: BLE001 - an optional stack missing (pytest skips it)
            continue
        for name, obj in vars(mod).items():
            launch = getattr(obj, "harness_launch", None)
            if launch is not None:
                found[launch] = f"{relative.as_posix()}::{name}"
    return found


def measured(dirs: list[Path]) -> tuple[dict[str, set], dict[str, float]]:
    """Per case ("module:wsN:case"): the library lines it ran, and its seconds (the most seen)."""
    import coverage

    lines: dict[str, set] = collections.defaultdict(set)
    seconds: dict[str, float] = {}
    for d in dirs:
        for part in sorted(d.glob(".coverage.*")):
            one = coverage.CoverageData(basename=str(part))
            one.read()
            for path in one.measured_files():
                rel = _library_path(path)
                if rel is None or any(fnmatch.fnmatch(rel, pat) for pat in EXCLUDE):
                    continue
                for line, contexts in one.contexts_by_lineno(path).items():
                    for ctx in contexts:
                        if ctx:
                            lines[ctx].add((rel, line))
        times = d / "times.jsonl"
        if times.exists():
            for row in map(json.loads, times.read_text().splitlines()):
                seconds[row["case"]] = max(seconds.get(row["case"], 0.0), row["seconds"])
    return lines, seconds


def _library_path(path: str) -> str | None:
    parts = Path(path).parts
    if "fsdp_retain" not in parts:
        return None
    i = len(parts) - 1 - parts[::-1].index("fsdp_retain")
    return "/".join(parts[i:])


def choose(lines: dict[str, set], seconds: dict[str, float]) -> list[str]:
    universe = set().union(*lines.values())
    covered: set = set()
    chosen: list[str] = []
    launched: set[str] = set()
    left = set(lines)
    while covered != universe:
        def gain(case: str) -> float:
            module = case.rsplit(":", 1)[0]
            cost = seconds.get(case, 1.0) + (0 if module in launched else LAUNCH_SECONDS)
            return len(lines[case] - covered) / max(cost, 0.05)

        best = max(sorted(left), key=gain)
        if not lines[best] - covered:
            break
        chosen.append(best)
        covered |= lines[best]
        launched.add(best.rsplit(":", 1)[0])
        left.discard(best)
    def key(case: str) -> str:  # "module:wsN:case" -> "module:case"
        module, _, name = case.partition(":")
        return f"{module}:{name.partition(':')[2]}"

    for pattern in REQUIRED:
        if not any(fnmatch.fnmatch(key(c), pattern) for c in chosen):
            matching = [c for c in lines if fnmatch.fnmatch(key(c), pattern)]
            if not matching:
                raise SystemExit(f"no measured case matches {pattern!r} (REQUIRED)")
            chosen.append(min(matching, key=lambda c: (seconds.get(c, 1.0), c)))
    return chosen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="coverage directories (step 1)")
    args = parser.parse_args()
    lines, seconds = measured(args.dirs)
    tests = case_tests()

    def launched_by_a_test(case: str) -> bool:  # not, e.g., the GPU kit's own cases
        module, ws, _ = case.split(":")
        return (module, int(ws.removeprefix("ws"))) in tests

    lines = {c: v for c, v in lines.items() if launched_by_a_test(c)}
    chosen = choose(lines, seconds)
    universe = set().union(*lines.values())
    total = sum(seconds.get(c, 0.0) for c in chosen)
    out = [
        "# What CI runs on the oldest and the newest supported torch (scripts/torch_matrix.sh",
        "# --subset), on top of the full suite on torch 2.13.0. Written by",
        "# scripts/select_subset.py from a measurement of the full suite (read its docstring):",
        f"# {len(chosen)} of {len(lines)} cases run each of the {len(universe)} library lines",
        "# (outside the report and the DeepSpeed backend) that any case runs, plus one parity",
        f"# case per backend and option; {total:.0f} s of cases on the machine measured.",
        *ALWAYS,
    ]
    missing = []
    for case in chosen:
        module, ws, name = case.split(":")
        test = tests.get((module, int(ws.removeprefix("ws"))))
        if test is None:
            missing.append(case)
            continue
        out.append(f"{test}[{name}]")
    print("\n".join(out))
    if missing:
        print(f"no test file launches: {missing}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
