"""``optimizer.step()`` inside the block raises before it writes; the block goes on
and matches the reference with the step after it (FSDP1 flat and orig params, FSDP2,
every option; CPU/gloo, world size 2; see tests/cases_step_guard.py)."""

import pytest

from tests import cases_step_guard
from tests.harness import check_case, launch


@pytest.fixture(scope="module")
def results():
    return launch("tests.cases_step_guard", world_size=2, timeout=600)


@pytest.mark.parametrize("name", cases_step_guard.registry.names(world_size=2))
def test_step_guard(results, name):
    check_case(results, name)
