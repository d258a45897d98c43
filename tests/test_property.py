"""Property-based parity (hypothesis, derandomized so all ranks agree); see
tests/cases_property.py. FSDP_RETAIN_PROPERTY_EXAMPLES sets the example count."""

from tests.harness import case_tests

case_tests(globals(), "tests.cases_property", {"test_property": (2, 900)})
