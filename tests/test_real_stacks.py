"""Configurations from real training stacks (CPU/gloo): HF Qwen2 with reentrant and
non-reentrant gradient checkpointing on FSDP1 (FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD
at world size 4; both use_orig_params) and FSDP2, every option, probe passes;
torch.utils.checkpoint(use_reentrant=True) inside and around units; a forward before
the block; the FSDP1 guards; peft LoRA; a byte budget (tests/cases_real_stacks.py).
FSDP2 HSDP, activation offload, two models in two blocks
(tests/cases_real_stacks_compose.py)."""

import pytest

from tests import cases_real_stacks, cases_real_stacks_compose
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


@pytest.fixture(scope="module")
def compose_ws2():
    return launch("tests.cases_real_stacks_compose", world_size=2, timeout=900)


@pytest.fixture(scope="module")
def compose_ws4():
    return launch("tests.cases_real_stacks_compose", world_size=4, timeout=900)


@pytest.mark.parametrize("name", cases_real_stacks_compose.registry.names(world_size=2))
def test_real_stacks_compose(compose_ws2, name):
    """Activation offload; two models in two nested blocks."""
    check_case(compose_ws2, name)


@pytest.mark.parametrize("name", cases_real_stacks_compose.registry.names(world_size=4))
def test_real_stacks_compose_ws4(compose_ws4, name):
    """FSDP2 HSDP on a 2 x 2 mesh."""
    check_case(compose_ws4, name)
