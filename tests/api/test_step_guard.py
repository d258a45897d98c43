"""``optimizer.step()`` inside the block raises before it writes; the block goes on
and matches the reference with the step after it (FSDP1 flat and orig params, FSDP2,
every option; CPU/gloo, world size 2; see tests/api/cases_step_guard.py)."""

from tests.support.harness import case_tests

case_tests(globals(), "tests.api.cases_step_guard", {"test_step_guard": (2, 600)})
