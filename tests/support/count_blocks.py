"""Test-only wrapper: run an example and print the collectives of each retain block.

Usage (what tests/docs/test_examples.py runs)::

    torchrun --nproc_per_node 2 tests/support/count_blocks.py examples/quickstart.py [args]
    accelerate launch --config_file examples/accelerate/fsdp2.yaml \\
        examples/accelerate_cpu_fsdp.py tests/support/count_blocks.py examples/accelerate/train.py

Before the example imports it, ``fsdp_retain.no_reshard_between_backwards`` is
replaced by a wrapper that counts the collectives issued from entering to
leaving each block (``fsdp_retain._measure.count_collectives``) and prints, on
rank 0, one line per block::

    [count_blocks] passes=2 all_gather=5 reduce_scatter=10 all_reduce=1

The examples put the forward and all backward passes inside the block, so the
tests can check the per-step formulas (one all-gather per FSDP unit with
``keep_unsharded=True``, and so on). Nothing else about the example changes.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def counting() -> Iterator[None]:
    """The counting wrapper in place of ``no_reshard_between_backwards`` (the package's and
    the accelerate integration's reference), the originals back in ``finally``
    (tests/support/run_examples.py enters it in the runs that ask for it)."""
    import torch.distributed as dist

    import fsdp_retain
    from fsdp_retain._measure import count_collectives
    # The integrations (accelerate's loop, the Trainer's, through accelerate's) open their
    # blocks through their own reference.
    from fsdp_retain.integrations import accelerate as accelerate_integration

    original = fsdp_retain.no_reshard_between_backwards
    original_integration = accelerate_integration.no_reshard_between_backwards

    @contextlib.contextmanager
    def counted(model, **kwargs):
        with count_collectives() as counts:
            with original(model, **kwargs) as block:
                yield block
        if dist.get_rank() == 0:
            print(
                f"[count_blocks] passes={block.backward_passes} all_gather={counts.all_gather} "
                f"reduce_scatter={counts.reduce_scatter} all_reduce={counts.all_reduce}",
                flush=True,
            )

    fsdp_retain.no_reshard_between_backwards = counted
    accelerate_integration.no_reshard_between_backwards = counted  # type: ignore[assignment]
    try:
        yield
    finally:
        fsdp_retain.no_reshard_between_backwards = original
        accelerate_integration.no_reshard_between_backwards = original_integration


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    # Without the interpreter's teardown, where gloo sometimes aborts: see run_example.py.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from run_example import run

    with counting():
        run(sys.argv[1], sys.argv[2:])


if __name__ == "__main__":
    main()
