"""FSDP2 composability: mixed precision, autocast, activation checkpointing,
CPU offload, two forwards in one block (CPU/gloo, world size 2).
See tests/cases_compose.py for the tolerances and what each case asserts."""

import pytest

from tests import cases_compose
from tests.harness import check_case, launch


@pytest.fixture(scope="module")
def results():
    return launch("tests.cases_compose", world_size=2, timeout=600)


@pytest.mark.parametrize("name", cases_compose.registry.names(world_size=2))
def test_compose(results, name):
    check_case(results, name)
