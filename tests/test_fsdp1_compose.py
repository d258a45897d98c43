"""FSDP1 composability, misuse and leaks (CPU/gloo, world size 2, one launch):
backward after the block exited, bf16 MixedPrecision and torch.autocast against
the two-forward way, two forwards in one block under mixed precision,
apply_activation_checkpointing, exceptions compared by state snapshot, and 50
steps without growth. See tests/cases_fsdp1_compose.py for tolerances and
what each case asserts."""

import pytest

from tests import cases_fsdp1_compose
from tests.harness import check_case, launch


@pytest.fixture(scope="module")
def results():
    return launch("tests.cases_fsdp1_compose", world_size=2, timeout=600)


@pytest.mark.parametrize("name", cases_fsdp1_compose.registry.names(world_size=2))
def test_fsdp1_compose(results, name):
    check_case(results, name)
