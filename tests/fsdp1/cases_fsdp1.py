"""FSDP1 cases, run inside ranks by ``tests/fsdp1/test_fsdp1.py`` (CPU, gloo).

World size 2: the parity grid for FULL_SHARD and SHARD_GRAD_OP, NO_SHARD, and
the behaviour cases (crash repro, zero_grad variants, exceptions, memory,
misuse). World size 4: HYBRID_SHARD. World size 1: FSDP1 falls back to
NO_SHARD there.

The cases live in parts, one concern each, registered here in this order:

- ``tests/fsdp1/cases_fsdp1_parity.py``: the parity grid; what breaks without the block.
- ``tests/fsdp1/cases_fsdp1_grads.py``: zero_grad between passes, gradients from before
  the block, ``no_sync()`` accumulation, the plain step after a block, memory.
- ``tests/fsdp1/cases_fsdp1_misuse.py``: exceptions and misuse.
- ``tests/fsdp1/cases_fsdp1_patterns.py``: activation checkpointing, two forwards, a
  gradient penalty, bf16 mixed precision.
- ``tests/fsdp1/cases_fsdp1_any_start.py``: passes that start anywhere in the forward.

``tests/support/fsdp1_checks.py`` holds the checks they share (collective counts, nothing
left after the block).
"""

from tests.fsdp1 import (
    cases_fsdp1_any_start,
    cases_fsdp1_grads,
    cases_fsdp1_misuse,
    cases_fsdp1_parity,
    cases_fsdp1_patterns,
)
from tests.support.case_parts import combined

registry = combined(
    cases_fsdp1_parity,
    cases_fsdp1_grads,
    cases_fsdp1_misuse,
    cases_fsdp1_patterns,
    cases_fsdp1_any_start,
)
