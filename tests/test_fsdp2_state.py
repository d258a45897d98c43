"""FSDP2 state, memory, misuse and exception cases (CPU/gloo; world sizes 2 and 4).

See tests/cases_fsdp2_state.py for what each case asserts.
"""

import pytest

from tests import cases_fsdp2_state
from tests.harness import check_case, launch


@pytest.fixture(scope="module")
def results2():
    return launch("tests.cases_fsdp2_state", world_size=2, timeout=600)


@pytest.fixture(scope="module")
def results4():
    return launch("tests.cases_fsdp2_state", world_size=4, timeout=600)


@pytest.mark.parametrize("name", cases_fsdp2_state.registry.names(world_size=2))
def test_fsdp2_state(results2, name):
    check_case(results2, name)


@pytest.mark.parametrize("name", cases_fsdp2_state.registry.names(world_size=4))
def test_fsdp2_world_size_4(results4, name):
    check_case(results4, name)
