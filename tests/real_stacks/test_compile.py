"""The block under per-block torch.compile(fullgraph=True), CPU/gloo, world size 2: FSDP1
compiled-then-wrapped, FSDP2 compiled in place and the torchtitan order; every option,
probe passes; parity, one graph as without the block, collectives as in eager. See
tests/real_stacks/cases_compile.py."""

from tests.support.harness import case_tests

case_tests(globals(), "tests.real_stacks.cases_compile", {"test_compile": (2, 1500)})
