"""Configurations from real training stacks (CPU/gloo): HF Qwen2 with reentrant and
non-reentrant gradient checkpointing on FSDP1 (FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD
at world size 4; both use_orig_params) and FSDP2, every option, probe passes;
torch.utils.checkpoint(use_reentrant=True) inside and around units; a forward before
the block; the FSDP1 guards. See tests/cases_real_stacks.py."""

import pytest

from tests import cases_real_stacks
from tests.harness import check_case, launch


@pytest.fixture(scope="module")
def results_ws2():
    return launch("tests.cases_real_stacks", world_size=2, timeout=1200)


@pytest.fixture(scope="module")
def results_ws4():
    return launch("tests.cases_real_stacks", world_size=4, timeout=900)


@pytest.mark.parametrize("name", cases_real_stacks.registry.names(world_size=2))
def test_real_stacks(results_ws2, name):
    check_case(results_ws2, name)


@pytest.mark.parametrize("name", cases_real_stacks.registry.names(world_size=4))
def test_real_stacks_hybrid_ws4(results_ws4, name):
    check_case(results_ws4, name)
