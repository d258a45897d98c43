"""Cases that check what a forked rank starts with (tests/support/rank_start.py): run by
tests/support/test_rank_start.py in launches of their own."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.support.harness import ROOT, Registry

registry = Registry()


@registry.case()
def environment_as_popen_gives_it():
    """The launch's environment, whole (a variable the session dropped after the fork
    server started is gone), the repository as the working directory, one thread, and
    this rank's own place in the process group."""
    assert os.environ["FSDP_RETAIN_RANK_START_PROBE"] == "launch", os.environ.get(
        "FSDP_RETAIN_RANK_START_PROBE")
    assert "FSDP_RETAIN_RANK_START_DROPPED" not in os.environ
    assert Path.cwd() == ROOT
    assert torch.get_num_threads() == 1
    assert dist.get_rank() == int(os.environ["RANK"])
    assert dist.get_world_size() == int(os.environ["WORLD_SIZE"])
    print(f"rank {dist.get_rank()} says hello", flush=True)
    print(f"rank {dist.get_rank()} on stderr", file=sys.stderr, flush=True)


@registry.case()
def rank_one_exits_three():
    """A rank that ends its process: its exit code is the launch's, as a child's was."""
    if dist.get_rank() == 1:
        os._exit(3)
