"""FSDP1: exceptions leave FSDP1 as before the block (part of
``tests/fsdp1/cases_fsdp1_compose.py``).

An exception in the forward, a second forward, between passes, or in a gradient
hook during a backward: ``fsdp1_snapshot`` is as before the block, nothing unsharded
is held, and the next plain and block steps match.
"""

from __future__ import annotations

import itertools

import pytest
import torch.nn as nn

from fsdp_retain import no_reshard_between_backwards
from fsdp_retain._fsdp1._inspect import fsdp1_snapshot
from tests.support import fsdp1_utils as f1
from tests.support.fsdp1_compose_utils import (
    BF16_MP,
    _check_twin,
    _check_usable,
    _tag,
    _warm_up,
    _warm_up_twins,
    assert_same_state,
)
from tests.support.harness import Registry
from tests.support.parity import LOSSES, batch, block_options, make_net, reference_copy

registry = Registry()


# --- Exceptions leave FSDP1 as before the block --------------------------------


class Boom(RuntimeError):
    pass


def _boom(*args):
    raise Boom("raised by the test")


def _raise_in(where: str, model: nn.Module, keep: bool, sync: str) -> None:
    """Both ranks raise at the same point, so no collective is left half-joined."""
    hooks = []
    calls = {"n": 0}

    def second_forward_boom(*args):
        calls["n"] += 1
        if calls["n"] == 2:
            _boom()

    try:
        with pytest.raises(Boom):
            with no_reshard_between_backwards(model, **block_options(keep, sync)):
                inner = {}
                if where == "forward":
                    hooks.append(model.blocks[1].register_forward_hook(_boom))
                elif where == "second_forward":
                    hooks.append(model.blocks[1].register_forward_hook(second_forward_boom))
                else:
                    hooks.append(
                        model.blocks[1].register_forward_hook(
                            lambda mod, args, out: inner.setdefault("out", out)
                        )
                    )
                out = model(batch(5))
                LOSSES[0](out).backward(retain_graph=True)
                if where == "second_forward":
                    model(batch(6))
                if where == "between_passes":
                    _boom()
                if where == "gradient_hook_on_output":
                    hooks.append(out.register_hook(_boom))
                if where == "mid_backward":
                    # After the root's and blocks.2's post-backward (reduced).
                    hooks.append(inner["out"].register_hook(_boom))
                LOSSES[1](out).backward()
    finally:
        for hook in hooks:
            hook.remove()


_WHERE = ("forward", "between_passes", "gradient_hook_on_output", "mid_backward")


def _exception_snapshot_case(where, keep, sync, uop, mixed_precision):
    """An exception in the forward, between passes, or in a gradient hook during
    a backward leaves every FSDP1 flag, hook and storage as before the block
    (``fsdp1_snapshot``), and the next plain and block steps match."""

    def run() -> None:
        model = make_net()
        ref = reference_copy(model)
        if mixed_precision:  # compared with a twin of the same policy instead
            model = f1.wrap(model, use_orig_params=uop, mixed_precision=BF16_MP)
            ref = f1.wrap(ref, use_orig_params=uop, mixed_precision=BF16_MP)
            _warm_up_twins(model, ref)
        else:
            model = f1.wrap(model, use_orig_params=uop)
            _warm_up(model, ref)
        before = fsdp1_snapshot(model)
        _raise_in(where, model, keep, sync)
        assert_same_state(model, before, where)
        assert f1.unsharded_storage_bytes(model) == 0
        if mixed_precision:
            _check_twin(model, ref, where)
        else:
            _check_usable(model, ref, keep, sync)

    return run


for where in _WHERE:
    for keep, sync in itertools.product((True, False), ("every", "last")):
        uop = keep != (sync == "last")  # each where meets both use_orig_params values
        registry.add(
            f"exception_{where}_{_tag(keep, sync, uop)}",
            _exception_snapshot_case(where, keep, sync, uop, False),
        )
for keep, sync, uop in ((True, "every", False), (False, "last", True)):
    registry.add(
        f"exception_second_forward_mixed_precision_{_tag(keep, sync, uop)}",
        _exception_snapshot_case("second_forward", keep, sync, uop, True),
    )
