"""FSDP1 (FullyShardedDataParallel) cases, CPU/gloo, one launch per world size.

World size 2: FULL_SHARD and SHARD_GRAD_OP parity grid (use_orig_params,
keep_unsharded, sync_grads, backwards known or not, with 2 and 3 passes,
zero_grad between passes and a tied weight paired so every two factors meet),
NO_SHARD, the crash without the block, zero_grad variants, exceptions, memory,
misuse, activation checkpointing, bf16 mixed precision, no_sync accumulation.
World size 4: HYBRID_SHARD on a (2, 2) mesh. World size 1: FSDP1's NO_SHARD
fallback. Parity is against an unsharded reference over 3 SGD-momentum steps;
collective counts follow the formulas in tests/fsdp1_utils.py.
"""

import pytest

from tests import cases_fsdp1
from tests.harness import check_case, launch


@pytest.fixture(scope="module")
def results_ws2():
    return launch("tests.cases_fsdp1", world_size=2, timeout=900)


@pytest.fixture(scope="module")
def results_ws4():
    return launch("tests.cases_fsdp1", world_size=4, timeout=600)


@pytest.fixture(scope="module")
def results_ws1():
    return launch("tests.cases_fsdp1", world_size=1, timeout=300)


@pytest.mark.parametrize("name", cases_fsdp1.registry.names(world_size=2))
def test_fsdp1_ws2(results_ws2, name):
    check_case(results_ws2, name)


@pytest.mark.parametrize("name", cases_fsdp1.registry.names(world_size=4))
def test_fsdp1_hybrid_ws4(results_ws4, name):
    check_case(results_ws4, name)


@pytest.mark.parametrize("name", cases_fsdp1.registry.names(world_size=1))
def test_fsdp1_ws1(results_ws1, name):
    check_case(results_ws1, name)
