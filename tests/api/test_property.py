"""Property-based parity (hypothesis, derandomized so all ranks agree); see
tests/api/cases_property.py. FSDP_RETAIN_PROPERTY_EXAMPLES sets the example count."""

from tests.support.harness import case_tests

case_tests(globals(), "tests.api.cases_property", {"test_property": (2, 900)})
