"""FSDP1's prefetch settings under the block (CPU, gloo; tests/fsdp1/cases_api_fsdp1_prefetch.py).

FULL_SHARD at world size 2, a 4-unit model (the root and 3 blocks): the full cross of
backward_prefetch (None, BACKWARD_PRE, BACKWARD_POST) x sync_grads x backwards (None,
the number of passes) x use_orig_params x keep_unsharded (True, False, a budget keeping
2 of the 4 units), with forward_prefetch, limit_all_gathers and a probe pass first set
pairwise. Besides: SHARD_GRAD_OP and NO_SHARD; backwards=N whose last pass reaches only
blocks.0 and the root; backwards one more than the passes run; HYBRID_SHARD on a (2, 2)
mesh at world size 4. Each row: parity with an unsharded reference (losses, gradients
between passes with sync_grads="every", final gradients, parameters) over 2
SGD-momentum steps, collectives per step by formula, FSDP1 restored after the block.
Regression: BACKWARD_POST with sync_grads="last" crashed at the block exit
(use_orig_params=True), replaced parameters by tensors (NO_SHARD) or all-gathered for
nothing (flat parameters).
"""

from tests.fsdp1.cases_api_fsdp1_prefetch import GRID, pairwise_gaps
from tests.support.harness import case_tests

case_tests(globals(), "tests.fsdp1.cases_api_fsdp1_prefetch", {
    "test_api_fsdp1_prefetch": (2, 300),
    "test_api_fsdp1_prefetch_hybrid_ws4": (4, 300),
})


def test_grid_is_pairwise():
    """Every two values of any two factors meet in some row of the FULL_SHARD grid (a
    covering array of strength 3: 27 rows, against 576 for the product)."""
    assert len(GRID) == 27
    assert pairwise_gaps(GRID) == []
