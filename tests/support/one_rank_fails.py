"""Test-only script (tests/support/test_examples_batch.py): rank 0 fails at once, the
other ranks hang (a sleep here: gloo's own collectives error out once rank 0's process is
gone, but a rank can wait on something that never errors), so the batch has to stop them."""

import time

import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()  # every rank is in before rank 0 leaves
if dist.get_rank() == 0:
    raise SystemExit("one_rank_fails.py: rank 0 fails on purpose")
while True:
    time.sleep(1)
