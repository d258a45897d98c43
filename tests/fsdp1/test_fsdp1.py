"""FSDP1 (FullyShardedDataParallel) cases, CPU/gloo, one launch per world size.

World size 2: FULL_SHARD and SHARD_GRAD_OP parity grid (use_orig_params,
keep_unsharded, sync_grads, backwards known or not, with 2 and 3 passes,
zero_grad between passes and a tied weight paired so every two factors meet),
NO_SHARD, the crash without the block, zero_grad variants, exceptions, memory,
misuse, activation checkpointing, bf16 mixed precision, no_sync accumulation.
World size 4: HYBRID_SHARD on a (2, 2) mesh. World size 1: FSDP1's NO_SHARD
fallback. Parity is against an unsharded reference over 3 SGD-momentum steps;
collective counts follow the formulas in tests/support/fsdp1_utils.py.
"""

from tests.support.harness import case_tests

case_tests(globals(), "tests.fsdp1.cases_fsdp1", {
    "test_fsdp1_ws2": (2, 900),
    "test_fsdp1_hybrid_ws4": (4, 600),
    "test_fsdp1_ws1": (1, 300),
})
