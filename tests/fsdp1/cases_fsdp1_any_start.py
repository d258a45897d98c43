"""FSDP1 passes that start anywhere in the forward (part of ``tests/fsdp1/cases_fsdp1.py``;
see ``tests/support/any_start.py``).

Every strategy and use_orig_params (HYBRID_SHARD at world size 4): passes from an
activation inside a unit, a non-root unit's output and a tensor that reaches only
the root unit; a penalty built with ``create_graph=True`` in pass 1 and backpropagated
in a later pass; ``backward(create_graph=True)`` refused.
"""

from __future__ import annotations

import contextlib
import functools
import itertools

from fsdp_retain import no_reshard_between_backwards
from tests.support import any_start
from tests.support import fsdp1_utils as f1
from tests.support.fsdp1_checks import assert_restored
from tests.support.harness import Registry
from tests.support.parity import (
    OPTION_GRID,
    Scenario,
    assert_close_dicts,
    batch,
    block_options,
    make_net,
    reference_copy,
    run_parity,
    world,
)

registry = Registry()


# Passes that start anywhere in the forward (see tests/support/any_start.py) #
def _expect_any_start(starts, keep, sync, strategy):
    def expect(model, counts) -> None:
        n = any_start.reductions(starts, sync)
        single = world() == 1
        want = dict(
            reduce_scatter=0 if strategy == f1.NO_SHARD or single else n,
            all_reduce=n if strategy in (f1.NO_SHARD, f1.HYBRID) or single else 0,
        )
        got = dict(reduce_scatter=counts.reduce_scatter, all_reduce=counts.all_reduce)
        assert got == want, f"reductions {counts.by_op}, expected {want}"
        if keep:
            ag = f1.expected_all_gathers(model, len(starts), True, strategy)
            assert counts.all_gather == ag, f"all-gathers {counts.by_op}, expected {ag}"

    return expect


def _any_start_case(strategy, uop):
    """Passes from an activation inside a unit (blocks[1].fc1), a non-root unit's
    output (blocks[0]) and a tensor that reaches only the root unit (inp), mixed
    with the output loss. Plain FSDP1 fails; in the block each start set, with
    two of the four (keep_unsharded, sync_grads) pairs (all four over the sets;
    ``backwards`` known for the 3-pass set), matches the reference over 3 steps
    after every pass, reduces each unit once per pass that reaches it ("every")
    or once per step ("last"), and with keep_unsharded=True all-gathers only in
    the forward."""

    def run() -> None:
        wrap = functools.partial(f1.wrap, strategy=strategy, use_orig_params=uop)
        outcome = any_start.plain_fails_or_is_wrong(wrap, f1.ADAPTER, ["inner", "out"])
        assert outcome.startswith("raised"), outcome
        for i, starts in enumerate(any_start.START_SETS):
            for keep, sync in (OPTION_GRID[i % 4], OPTION_GRID[(i + 2) % 4]):
                options = block_options(keep, sync, len(starts) if i == 1 else None)
                model = any_start.parity(
                    wrap,
                    f1.ADAPTER,
                    starts,
                    options,
                    check_between=sync == "every",
                    expect=_expect_any_start(starts, keep, sync, strategy),
                )
                assert_restored(model)

    return run


def _penalty_across_passes_case(strategy, uop, variants):
    """create_graph=True in pass 1 (an input-gradient penalty), plain losses,
    then the penalty's backward: plain FSDP1 crashes; keep_unsharded=True
    matches the reference over 3 steps; False refuses clearly and leaves
    FSDP1 as it was."""

    def run() -> None:
        wrap = functools.partial(f1.wrap, strategy=strategy, use_orig_params=uop)
        if strategy != f1.NO_SHARD:
            try:
                any_start.penalty_across_passes(wrap(make_net()), batch(0), contextlib.nullcontext())
            except RuntimeError as exc:
                assert "storage of size 0" in str(exc), exc
            else:
                raise AssertionError("plain FSDP1 ran the penalty across passes")
        for passes, sync in variants:
            model = any_start.penalty_parity(wrap, f1.ADAPTER, dict(sync_grads=sync), passes=passes)
            assert_restored(model)
        model = wrap(make_net())
        block = no_reshard_between_backwards(model, keep_unsharded=False)
        try:
            any_start.penalty_across_passes(model, batch(0), block)
        except RuntimeError as exc:
            assert "needs keep_unsharded=True" in str(exc), exc
        else:
            raise AssertionError("keep_unsharded=False accepted create_graph=True")
        assert_restored(model)

    return run


for strategy, uop in itertools.product((f1.FULL, f1.GRAD_OP, f1.NO_SHARD, f1.HYBRID), (False, True)):
    sizes = (4,) if strategy == f1.HYBRID else (2,)
    label = f"{f1.STRATEGY_NAMES[strategy]}_{'orig' if uop else 'flat'}"
    registry.add(f"any_start_{label}", _any_start_case(strategy, uop), world_sizes=sizes)
    variants = (
        [(3, "every"), (3, "last"), (4, "every"), (4, "last")]
        if strategy == f1.FULL
        else [(3, "every"), (4, "last")]
    )
    registry.add(
        f"penalty_across_passes_{label}",
        _penalty_across_passes_case(strategy, uop, variants),
        world_sizes=sizes,
    )


@registry.case()
def backward_create_graph_accumulating_refused() -> None:
    """loss.backward(create_graph=True) would accumulate gradients of gradients
    into FSDP1's flat parameters: the block refuses before any gradient moves,
    and the next step is right."""
    model = make_net()
    ref = reference_copy(model)
    model = f1.wrap(model, use_orig_params=True)
    run_parity(model, ref, Scenario(passes=2, steps=1), f1.ADAPTER)
    model(batch(1)).pow(2).mean().backward()  # reduced gradients the pass must keep
    before = f1.full_grads(model)
    assert before, "no gradients to keep"
    try:
        with no_reshard_between_backwards(model):
            out = model(batch(1))
            out.pow(2).mean().backward(create_graph=True)
    except RuntimeError as exc:
        assert "gradients of gradients" in str(exc), exc
    else:
        raise AssertionError("backward(create_graph=True) into FSDP1 .grad accepted")
    assert_restored(model)
    assert_close_dicts(f1.full_grads(model), before, "grads after the refused pass")
    model.zero_grad()
    run_parity(model, ref, Scenario(passes=2, steps=2), f1.ADAPTER)
