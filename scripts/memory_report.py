#!/usr/bin/env python
"""Memory, time and communication of fsdp_retain against a second forward.

An alias of ``python -m fsdp_retain.report``:

    python scripts/memory_report.py --backend fsdp2 fsdp1 --out report_out
    python scripts/memory_report.py --device cuda --nproc 1 --dtype bf16 --size 1.5b --batch 8
    python scripts/memory_report.py --simulate-world-size 8 --size 7b --dtype bf16 --backend fsdp2

Launches its own ranks (CPU: gloo, 2 ranks by default) or runs as one rank
under torchrun. See docs/report/README.md and ``--help``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fsdp_retain.report import main  # noqa: E402
from fsdp_retain.report._launch import leave  # noqa: E402

if __name__ == "__main__":  # leave: see [Note: the report leaves without the interpreter's teardown]
    leave(main(prog="scripts/memory_report.py"))
