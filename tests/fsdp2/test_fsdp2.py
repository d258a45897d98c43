"""FSDP2 (fully_shard) parity grid, CPU/gloo, world size 2, one launch.

Every combination of passes (2, 3), zero_grad between passes or not,
keep_unsharded, sync_grads, backwards known or not, reshard_after_forward for
the blocks, and a tied weight: parameters, losses and gradients (after every
pass with sync_grads="every") match an unsharded reference over 3 SGD-momentum
steps, and the collective counts match the formulas in tests/support/fsdp2_utils.py.

replicate_with_fsdp's replicate (DDP on FSDP2's machinery) on the same model: passes,
keep_unsharded, sync_grads and backwards= in the block and plain beside it (right, one
all-reduce per unit per pass), all-reduces counted; passes that start inside a unit or
reach only the root, and an input-gradient penalty, where plain raises or is wrong.
"""

from tests.support.harness import case_tests

case_tests(globals(), "tests.fsdp2.cases_fsdp2", {"test_fsdp2": (2, 900)})
