"""The block under per-block torch.compile(fullgraph=True), CPU/gloo, world size 2: FSDP1
compiled-then-wrapped, FSDP2 compiled in place and the torchtitan order; every option,
probe passes; parity, one graph as without the block, collectives as in eager. See
tests/cases_compile.py."""

import pytest

from tests import cases_compile
from tests.harness import check_case, launch


@pytest.fixture(scope="module")
def results():
    return launch("tests.cases_compile", world_size=2, timeout=1500)


@pytest.mark.parametrize("name", cases_compile.registry.names(world_size=2))
def test_compile(results, name):
    check_case(results, name)
