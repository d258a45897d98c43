"""One launch of a cases module for ``scripts/gpu_validate.py``, in the interpreter that runs
this file (the kit runs it with the python that has deepspeed, see
``scripts/gpu_validate_deps.py``), and its results as JSON:

    python scripts/gpu_validate_cases.py tests.repo.cases_device_stacks 1 nccl out.json [TIMEOUT]

``out.json``: per case ``ok``, ``seconds``, ``error`` and ``skipped`` (every rank skipped it,
saying why), and the counts; the launch's output goes to stdout. Exit code 0 unless a case
failed.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str]) -> int:
    module, world, backend, out = argv[:4]
    timeout = float(argv[4]) if len(argv) > 4 else 600.0
    from tests.support.harness import BACKEND_ENV, launch

    names = importlib.import_module(module).registry.names(int(world))
    start = time.monotonic()
    result = launch(module, int(world), timeout=timeout, env={BACKEND_ENV: backend})
    print(result.output_tail(100_000), flush=True)
    cases = {}
    for name in names:
        entries = [r.get(name) for r in result.per_rank]
        skipped = [e.get("skipped") if e else None for e in entries]
        ok = all(e is not None and e["ok"] for e in entries)
        error = next((e["error"] for e in entries if e and not e["ok"]), None)
        cases[name] = dict(ok=ok, seconds=max((e["seconds"] for e in entries if e), default=None),
                           skipped=skipped[0] if all(skipped) else None,
                           error=None if ok else (error or "did not run"))
    failed = sum(not c["ok"] for c in cases.values())
    skipped = sum(c["skipped"] is not None for c in cases.values())
    Path(out).write_text(json.dumps(dict(
        module=module, world_size=int(world), process_group=backend, cases=cases,
        passed=len(cases) - failed - skipped, skipped=skipped, failed=failed,
        timed_out=result.timed_out, seconds=round(time.monotonic() - start, 1)), indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
