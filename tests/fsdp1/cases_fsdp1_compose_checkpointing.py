"""FSDP1's ``apply_activation_checkpointing`` (part of ``tests/fsdp1/cases_fsdp1_compose.py``).

Non-reentrant ``checkpoint_wrapper`` inside each unit, 3 passes, parity with the
unsharded reference and all-gathers by formula; with bf16 ``MixedPrecision`` against
the two-forward way.
"""

from __future__ import annotations

import contextlib
import itertools

from tests.support import fsdp1_utils as f1
from tests.support.fsdp1_compose_utils import (
    BF16_MP,
    TOL_SAME,
    _compare_with_two_forward,
    _tag,
    checkpointed,
)
from tests.support.harness import Registry
from tests.support.parity import Scenario, block_options, make_net, reference_copy, run_parity

registry = Registry()


# --- FSDP1's apply_activation_checkpointing -----------------------------------


def _activation_checkpointing_case(keep, sync, uop, backwards):
    """Non-reentrant checkpoint_wrapper inside each unit, 3 passes: every pass's
    recompute finds its parameters; parity with the unsharded reference. The
    all-gathers follow f1.expected_all_gathers: with keep_unsharded=True one per
    unit per step (the forward's), so no backward or recompute all-gathers."""

    def run() -> None:
        model = make_net()
        ref = reference_copy(model)
        model = checkpointed(f1.wrap(model, use_orig_params=uop))
        passes = 3
        scenario = Scenario(
            passes=passes,
            options=block_options(keep, sync, passes if backwards else None),
            check_between=sync == "every",
        )

        def expect(counts) -> None:
            expected = dict(
                all_gather=f1.expected_all_gathers(model, passes, keep, f1.FULL),
                reduce_scatter=f1.expected_reduce_scatters(model, passes, sync, f1.FULL),
                all_reduce=0,
            )
            if keep:
                assert expected["all_gather"] == f1.units(model) == 4
            assert counts.as_dict() == expected, (counts.by_op, expected)

        run_parity(model, ref, scenario, f1.ADAPTER, expect)

    return run


# Every pair of keep_unsharded, sync_grads, use_orig_params values meets once;
# tests/fsdp1/cases_fsdp1_patterns.py has keep x use_orig_params with "every" and 2 passes.
for keep, sync, uop, backwards in (
    (True, "every", False, False),
    (True, "last", True, True),
    (False, "every", True, True),
    (False, "last", False, False),
):
    registry.add(
        f"activation_checkpointing_{_tag(keep, sync, uop)}{'_backwards' if backwards else ''}",
        _activation_checkpointing_case(keep, sync, uop, backwards),
    )


def _checkpointing_mixed_precision_case(keep, sync):
    """checkpoint_wrapper and bf16 MixedPrecision together, against two forwards."""

    def run() -> None:
        make = lambda: checkpointed(  # noqa: E731
            f1.wrap(make_net(), use_orig_params=True, mixed_precision=BF16_MP)
        )
        _compare_with_two_forward(make, block_options(keep, sync), TOL_SAME, contextlib.nullcontext)

    return run


for keep, sync in itertools.product((True, False), ("every", "last")):
    registry.add(
        f"activation_checkpointing_mixed_precision_{_tag(keep, sync, True)}",
        _checkpointing_mixed_precision_case(keep, sync),
    )
