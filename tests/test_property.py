"""Property-based parity (hypothesis, derandomized so all ranks agree); see
tests/cases_property.py. FSDP_RETAIN_PROPERTY_EXAMPLES sets the example count."""

import pytest

from tests import cases_property
from tests.harness import check_case, launch


@pytest.fixture(scope="module")
def results():
    return launch("tests.cases_property", world_size=2, timeout=900)


@pytest.mark.parametrize("name", cases_property.registry.names(world_size=2))
def test_property(results, name):
    check_case(results, name)
