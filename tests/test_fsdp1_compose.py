"""FSDP1 composability, misuse and leaks (CPU/gloo, world size 2, one launch):
backward after the block exited, bf16 MixedPrecision and torch.autocast against
the two-forward way, two forwards in one block under mixed precision,
apply_activation_checkpointing, exceptions compared by state snapshot, and 50
steps without growth. See tests/cases_fsdp1_compose.py for tolerances and
what each case asserts."""

from tests.harness import case_tests

case_tests(globals(), "tests.cases_fsdp1_compose", {"test_fsdp1_compose": (2, 600)})
