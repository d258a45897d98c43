"""How fast this machine runs a fixed CPU workload: one line to quote beside CPU times.

A CPU time (``fit``'s run, a CI part) says little on another machine. The calibration
times the same single-threaded work everywhere, a pure-Python loop and a small torch
matmul loop, best of three each, so that a time quoted with its calibration can be
scaled: a machine whose calibration takes twice as long runs CPU-bound work about half
as fast. ``python -m fsdp_retain.report calibrate`` prints it; so do ``.ci/run`` and
``fit --verbose``. Run as a file (``python fsdp_retain/report/_calibrate.py --python-only``)
it needs no torch: ``.ci/run`` takes a reading so before its venv exists.
"""

from __future__ import annotations

import sys
import time

_PYTHON_LOOP = 2_000_000
_MATMULS, _SIZE = 200, 192


def _python_work() -> int:
    total = 0
    for i in range(_PYTHON_LOOP):
        total += i * i % 7
    return total


def _torch_work() -> float:
    import torch

    a = torch.ones(_SIZE, _SIZE) / _SIZE
    b = a.clone()
    for _ in range(_MATMULS):
        b = a @ b
    return float(b[0, 0])


def _best(work, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best


def calibration() -> dict[str, float]:
    """Seconds for the Python loop and the torch loop, single-threaded."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {"python_s": _best(_python_work), "torch_s": _best(_torch_work)}
    finally:
        torch.set_num_threads(threads)


def calibration_line(values: dict[str, float] | None = None) -> str:
    values = values or calibration()
    return (f"calibration: python {values['python_s']:.3f} s, torch {values['torch_s']:.3f} s "
            f"(one thread; python -m fsdp_retain.report calibrate)")


def main() -> int:
    if "--python-only" in sys.argv[1:]:
        print(f"calibration: python {_best(_python_work):.3f} s (no torch)", flush=True)
        return 0
    print(calibration_line(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
