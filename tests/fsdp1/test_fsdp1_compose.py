"""FSDP1 composability, misuse and leaks (CPU/gloo, world size 2, one launch):
backward after the block exited, bf16 MixedPrecision and torch.autocast against
the two-forward way, two forwards in one block under mixed precision,
apply_activation_checkpointing, exceptions compared by state snapshot, and 24
steps without growth. See tests/fsdp1/cases_fsdp1_compose.py for tolerances and
what each case asserts."""

from tests.support.harness import case_tests

# 1200 s: on torch 2.9-2.11 many_steps_no_growth_fp32_flat_memtracker (then 50 steps) alone took
# 400-500 s (MemTracker; about 25 s on 2.12 and later), the launch up to 540 s.
case_tests(globals(), "tests.fsdp1.cases_fsdp1_compose", {"test_fsdp1_compose": (2, 1200)})
