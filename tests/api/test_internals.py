"""A private FSDP internal the block uses is missing: the block refuses at its entry,
naming it and the torch version, and leaves FSDP unchanged (FSDP1 and FSDP2; CPU/gloo,
world size 2; see tests/api/cases_internals.py)."""

from tests.support.harness import case_tests

case_tests(globals(), "tests.api.cases_internals", {"test_internals": (2, 300)})
