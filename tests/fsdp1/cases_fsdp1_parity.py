"""FSDP1 parity grid and what goes wrong without the block (part of ``tests/fsdp1/cases_fsdp1.py``).

The grid: FULL_SHARD and SHARD_GRAD_OP (world size 2; 2 and 3 passes), NO_SHARD
(world size 2), HYBRID_SHARD (world size 4) and FULL_SHARD at world size 1 (FSDP1's
NO_SHARD fallback), each over use_orig_params x keep_unsharded x sync_grads x
backwards known or not, with zero_grad between passes and a tied weight; parity with
an unsharded reference over 3 SGD-momentum steps, collective counts by formula,
nothing left afterwards. Without the block: FULL_SHARD and SHARD_GRAD_OP crash on
the second backward, NO_SHARD gives rank-local gradients.
"""

from __future__ import annotations

import contextlib
import itertools

from fsdp_retain import no_reshard_between_backwards
from tests.support import fsdp1_utils as f1
from tests.support.fsdp1_checks import assert_restored, expect_counts
from tests.support.case_parts import covering
from tests.support.harness import Registry
from tests.support.parity import (
    LOSSES,
    Scenario,
    averaged_grads,
    batch,
    make_net,
    reference_copy,
    run_parity,
)

registry = Registry()


def _parity_case(strategy, uop, passes, zero_between, keep, sync, backwards, tied):
    def run() -> None:
        model = make_net(tied=tied)
        ref = reference_copy(model)
        model = f1.wrap(model, strategy, use_orig_params=uop)
        options = dict(
            keep_unsharded=keep,
            sync_grads=sync,
            backwards=passes if backwards else None,
        )
        scenario = Scenario(
            passes=passes,
            zero_between=zero_between,
            options=options,
            check_between=sync == "every",
        )
        expect = expect_counts(model, passes, keep, sync, strategy)
        run_parity(model, ref, scenario, f1.ADAPTER, expect)
        assert_restored(model)

    return run


def _name(strategy, uop, passes, zero_between, keep, sync, backwards, tied) -> str:
    return (
        f"parity_{f1.STRATEGY_NAMES[strategy]}_{'orig' if uop else 'flat'}_p{passes}_"
        f"{'zero' if zero_between else 'accum'}_{'keep' if keep else 'regather'}_{sync}_"
        f"{'backwards' if backwards else 'nbackwards'}_{'tied' if tied else 'untied'}"
    )


def _add_grid(strategies, world_sizes, *, both_pass_counts: bool, prefix: str = "") -> None:
    """strategy x use_orig_params x keep_unsharded x sync_grads x backwards.

    With ``both_pass_counts``, also 2 or 3 passes, zero_grad between passes and the tied
    weight: every 3 of the 8 factors meet in each combination of their values
    (``covering``: 16 rows for two strategies, against 256 for the product).
    Otherwise (one strategy, 16 cases) passes, zero_grad and the tied weight are XORs
    of the other factors' bits, which makes every pair of factors meet.
    """
    if both_pass_counts:
        for row in covering(dict(
            strategy=strategies, uop=(False, True), passes=(2, 3), zero=(False, True),
            keep=(True, False), sync=("every", "last"), backwards=(False, True),
            tied=(False, True),
        ), strength=3):
            args = tuple(row.values())
            registry.add(prefix + _name(*args), _parity_case(*args), world_sizes=world_sizes)
        return
    combos = itertools.product(
        strategies, (False, True), (True, False), ("every", "last"), (False, True)
    )
    for i, (strategy, uop, keep, sync, backwards) in enumerate(combos):
        bit = [(i >> j) & 1 for j in range(4)]  # backwards, sync, keep, uop
        passes, zero, tied = 2 + (bit[0] ^ bit[1]), bool(bit[0] ^ bit[2]), bool(bit[0] ^ bit[3])
        args = (strategy, uop, passes, zero, keep, sync, backwards, tied)
        registry.add(prefix + _name(*args), _parity_case(*args), world_sizes=world_sizes)


_add_grid((f1.FULL, f1.GRAD_OP), (2,), both_pass_counts=True)
_add_grid((f1.NO_SHARD,), (2,), both_pass_counts=False)
_add_grid((f1.HYBRID,), (4,), both_pass_counts=False)
# World size 1: FSDP1 switches every strategy to NO_SHARD.
_add_grid((f1.FULL,), (1,), both_pass_counts=False, prefix="ws1_")


# Without the block #
def _crash_case(strategy, uop):
    def run() -> None:
        model = f1.wrap(make_net(), strategy, use_orig_params=uop)
        out = model(batch(0))
        LOSSES[0](out).backward(retain_graph=True)
        try:
            LOSSES[1](out).backward()
        except RuntimeError as exc:
            assert "setStorage" in str(exc), f"unexpected error: {exc}"
        else:
            raise AssertionError("plain FSDP1 did not crash on the second backward")
        # The same model inside the block, from a fresh one.
        model = make_net()
        ref = reference_copy(model)
        model = f1.wrap(model, strategy, use_orig_params=uop)
        run_parity(model, ref, Scenario(passes=2, steps=3), f1.ADAPTER)

    return run


for strategy, uop in itertools.product((f1.FULL, f1.GRAD_OP), (False, True)):
    registry.add(
        f"crash_without_block_{f1.STRATEGY_NAMES[strategy]}_{'orig' if uop else 'flat'}",
        _crash_case(strategy, uop),
    )


def _relative_error(model, ref) -> float:
    got = f1.full_grads(model)
    want = averaged_grads(ref)
    num = sum((got[n] - want[n]).norm() ** 2 for n in want) ** 0.5
    den = sum(want[n].norm() ** 2 for n in want) ** 0.5
    return float(num / den)


def _no_shard_case(uop):
    def run() -> None:
        for use_block in (False, True):
            model = make_net()
            ref = reference_copy(model)
            model = f1.wrap(model, f1.NO_SHARD, use_orig_params=uop)
            block = (
                no_reshard_between_backwards(model)
                if use_block
                else contextlib.nullcontext()
            )
            x = batch(0)
            with block:
                out, ref_out = model(x), ref(x)
                for i in range(2):
                    LOSSES[i](out).backward(retain_graph=i == 0)
                    LOSSES[i](ref_out).backward(retain_graph=i == 0)
            error = _relative_error(model, ref)
            if use_block:
                assert error < 1e-5, f"NO_SHARD with the block: relative error {error}"
            else:
                # The second pass is never all-reduced: only rank-local gradients.
                assert error > 0.1, f"plain NO_SHARD unexpectedly right ({error})"

    return run


for uop in (False, True):
    registry.add(f"no_shard_wrong_without_block_{'orig' if uop else 'flat'}", _no_shard_case(uop))
