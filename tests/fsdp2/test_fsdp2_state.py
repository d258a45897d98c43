"""FSDP2 state, memory, misuse and exception cases (CPU/gloo; world sizes 2 and 4).

See tests/fsdp2/cases_fsdp2_state.py for what each case asserts.
"""

from tests.support.harness import case_tests

case_tests(globals(), "tests.fsdp2.cases_fsdp2_state", {
    "test_fsdp2_state": (2, 600),
    "test_fsdp2_world_size_4": (4, 600),
})
