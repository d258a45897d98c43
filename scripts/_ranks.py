"""Starts a benchmark script once per rank on this machine, as torchrun would (its
environment variables, gloo on 127.0.0.1), for the ``scripts/bench_*.py`` that time ranks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys


def launch(script: str, nproc: int) -> int:
    """Runs ``script`` with this process's arguments on ``nproc`` ranks; the worst exit code."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in range(nproc):
        env = dict(os.environ)
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
        procs.append(subprocess.Popen([sys.executable, script, *sys.argv[1:]], env=env))
    return max(p.wait() for p in procs)
