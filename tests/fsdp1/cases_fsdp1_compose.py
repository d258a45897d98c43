"""FSDP1 composability, misuse and leak cases (CPU, gloo, world size 2).

Run inside ranks by ``tests/fsdp1/test_fsdp1_compose.py``. Configurations whose
numerics differ from fp32 (bf16 ``MixedPrecision``, ``torch.autocast``) are
compared against the same configuration trained the two-forward way: one
forward per backward, what users do without the library. For
``sync_grads="every"`` that is a plain step per pass; for ``"last"`` the
passes before the last run inside FSDP's ``no_sync()``, which is how FSDP1
accumulates gradients locally and reduces them once. Both are the same
arithmetic as the block's, so the tolerance is ``TOL_SAME`` (fp32 rounding).
Note: with bf16 parameters, ``"last"`` (like ``no_sync()``) adds the passes'
gradients in bf16 before the reduction, so against per-pass fp32 reduction it
differs by bf16 rounding (seen here: up to 0.0085 absolute on the gradients,
8e-4 on the parameters after 3 SGD steps). Activation checkpointing is compared with
the unsharded fp32 reference. Every model is ``tests.support.fsdp1_utils.wrap``:
FULL_SHARD, each ``Block`` its own unit inside the root unit (4 units).

The cases live in parts, registered here in this order:
``tests/fsdp1/cases_fsdp1_compose_after_exit.py`` (a backward after the block exited),
``tests/fsdp1/cases_fsdp1_compose_mixed_precision.py`` (bf16 MixedPrecision, autocast, two
forwards under mixed precision, the missing engine query),
``tests/fsdp1/cases_fsdp1_compose_checkpointing.py`` (apply_activation_checkpointing),
``tests/fsdp1/cases_fsdp1_compose_exceptions.py`` (exceptions compared by state snapshot),
``tests/fsdp1/cases_fsdp1_compose_leaks.py`` (50 steps without growth). What they share
(the grid, the two-forward comparison, the state checks) is
``tests/support/fsdp1_compose_utils.py``'s.
"""

from tests.fsdp1 import (
    cases_fsdp1_compose_after_exit,
    cases_fsdp1_compose_checkpointing,
    cases_fsdp1_compose_exceptions,
    cases_fsdp1_compose_leaks,
    cases_fsdp1_compose_mixed_precision,
)
from tests.support.case_parts import combined

registry = combined(
    cases_fsdp1_compose_after_exit,
    cases_fsdp1_compose_mixed_precision,
    cases_fsdp1_compose_checkpointing,
    cases_fsdp1_compose_exceptions,
    cases_fsdp1_compose_leaks,
)
