"""FSDP2 composability: mixed precision, autocast, activation checkpointing,
CPU offload, two forwards in one block (CPU/gloo, world size 2).
See tests/fsdp2/cases_compose.py for the tolerances and what each case asserts."""

from tests.support.harness import case_tests

case_tests(globals(), "tests.fsdp2.cases_compose", {"test_compose": (2, 600)})
