"""FSDP1 exceptions and misuse (part of ``tests/fsdp1/cases_fsdp1.py``).

An exception on one rank or on both (in a backward's hook, in the forward), then
plain and block steps match the reference; a non-root unit (before and after
FSDP1's lazy init), CPU offload, more passes than ``backwards``.
"""

from __future__ import annotations

import itertools
import warnings

import torch.distributed as dist
from torch.distributed.fsdp import CPUOffload

from fsdp_retain import no_reshard_between_backwards
from fsdp_retain._common import ACTIVE_ATTR
from fsdp_retain._measure import count_collectives
from tests.support import fsdp1_utils as f1
from tests.support.fsdp1_checks import assert_restored
from tests.support.harness import Registry
from tests.support.parity import LOSSES, Scenario, batch, make_net, reference_copy, run_parity

registry = Registry()


# Exceptions #
def _exception_one_rank_case(uop, sync):
    """Rank 0 raises after pass 1; rank 1 finishes. Rank 0's exit communicates
    nothing (it would hang otherwise); afterwards plain steps match the reference."""

    def run() -> None:
        model = make_net()
        ref = reference_copy(model)
        model = f1.wrap(model, f1.FULL, use_orig_params=uop)
        # Warm up the lazy init (a plain step) so the exit is the only thing counted.
        run_parity(model, ref, Scenario(passes=1, steps=1, use_block=False), f1.ADAPTER)
        block = no_reshard_between_backwards(model, keep_unsharded=True, sync_grads=sync)
        block.__enter__()
        out = model(batch(1))
        LOSSES[0](out).backward(retain_graph=True)
        with count_collectives() as counts:
            if dist.get_rank() == 0:
                exc = RuntimeError("user code failed between passes")
                try:
                    raise exc
                except RuntimeError:
                    assert not block.__exit__(RuntimeError, exc, exc.__traceback__)
            elif sync == "every":
                block.__exit__(None, None, None)
        if dist.get_rank() == 0 or sync == "every":
            nothing = dict(all_gather=0, reduce_scatter=0, all_reduce=0)
            assert counts.as_dict() == nothing, counts.by_op
        else:
            # "last" on rank 1 would flush (a collective rank 0 never joins): abort too.
            exc = RuntimeError("peer failed")
            assert not block.__exit__(RuntimeError, exc, None)
        assert_restored(model)
        model.zero_grad()
        run_parity(model, ref, Scenario(passes=1, steps=2, use_block=False), f1.ADAPTER)
        block_step = Scenario(
            passes=2, steps=2, options=dict(sync_grads=sync), check_between=sync == "every"
        )
        run_parity(model, ref, block_step, f1.ADAPTER)

    return run


def _exception_in_backward_case(uop, keep, sync, where):
    """Both ranks raise inside pass 2's backward (a gradient hook) or inside the forward."""

    def run() -> None:
        model = make_net()
        ref = reference_copy(model)
        model = f1.wrap(model, f1.FULL, use_orig_params=uop)
        block_body = model.blocks[1]

        def fail(*args):
            raise ValueError("hook failed")

        hook = None
        try:
            with no_reshard_between_backwards(model, keep_unsharded=keep, sync_grads=sync):
                if where == "forward":
                    hook = block_body.register_forward_hook(fail)
                out = model(batch(0))
                LOSSES[0](out).backward(retain_graph=True)
                hook = out.register_hook(fail)
                LOSSES[1](out).backward()
        except ValueError as exc:
            assert "hook failed" in str(exc)
        else:
            raise AssertionError("the hook did not raise")
        finally:
            if hook is not None:
                hook.remove()
        assert_restored(model)
        model.zero_grad()
        run_parity(model, ref, Scenario(passes=1, steps=2, use_block=False), f1.ADAPTER)
        options = dict(keep_unsharded=keep, sync_grads=sync)
        block_step = Scenario(passes=2, steps=2, options=options, check_between=sync == "every")
        run_parity(model, ref, block_step, f1.ADAPTER)

    return run


for uop, sync in itertools.product((False, True), ("every", "last")):
    registry.add(
        f"exception_one_rank_{'orig' if uop else 'flat'}_{sync}",
        _exception_one_rank_case(uop, sync),
    )
for uop, keep, sync, where in (
    (False, True, "every", "backward"),
    (True, False, "last", "backward"),
    (True, True, "last", "forward"),
    (False, False, "every", "forward"),
):
    registry.add(
        f"exception_in_{where}_{'orig' if uop else 'flat'}_{'keep' if keep else 'regather'}_{sync}",
        _exception_in_backward_case(uop, keep, sync, where),
    )


# Misuse and options #
@registry.case()
def non_root_unit_after_init() -> None:
    model = f1.wrap(make_net())
    model(batch(0)).sum().backward()
    try:
        no_reshard_between_backwards(model.blocks[0]).__enter__()
    except ValueError as exc:
        assert "non-root" in str(exc) and "outermost" in str(exc), str(exc)
    else:
        raise AssertionError("non-root unit accepted")


@registry.case()
def non_root_unit_before_init() -> None:
    """FSDP1 decides its root at the first forward: the error comes from there."""
    model = make_net()
    ref = reference_copy(model)
    model = f1.wrap(model)
    try:
        with no_reshard_between_backwards(model.blocks[0]):
            model(batch(0))
    except ValueError as exc:
        assert "non-root" in str(exc) and "outermost" in str(exc), str(exc)
    else:
        raise AssertionError("non-root unit accepted")
    assert not hasattr(model.blocks[0], ACTIVE_ATTR)
    run_parity(model, ref, Scenario(passes=2, steps=2), f1.ADAPTER)


@registry.case()
def cpu_offload_refused() -> None:
    model = f1.wrap(make_net(), cpu_offload=CPUOffload(offload_params=True))
    try:
        no_reshard_between_backwards(model).__enter__()
    except ValueError as exc:
        assert "CPUOffload" in str(exc), str(exc)
    else:
        raise AssertionError("CPU offload accepted")
    assert not hasattr(model, ACTIVE_ATTR)


@registry.case()
def extra_pass_warns_and_stays_correct() -> None:
    """backwards=2 but 3 passes: a warning, the third pass re-gathers, gradients right."""
    model = make_net()
    ref = reference_copy(model)
    model = f1.wrap(model, use_orig_params=True)
    scenario = Scenario(passes=3, steps=3, options=dict(backwards=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_parity(model, ref, scenario, f1.ADAPTER)
    assert any("backwards=2" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert_restored(model)
