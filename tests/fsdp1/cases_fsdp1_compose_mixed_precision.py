"""FSDP1 mixed precision against the two-forward way (part of
``tests/fsdp1/cases_fsdp1_compose.py``).

bf16 ``MixedPrecision`` and ``torch.autocast`` (3 passes, 3 SGD steps, ``TOL_SAME``),
two forwards in one block under bf16 parameters, and the refusal where torch lacks
the autograd-engine query the block needs.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from fsdp_retain import no_reshard_between_backwards
from fsdp_retain._fsdp1._inspect import fsdp1_snapshot
from tests.support import fsdp1_utils as f1
from tests.support.fsdp1_compose_utils import (
    BF16_MP,
    GRID,
    TOL_SAME,
    _assert_trained_alike,
    _bf16_model,
    _check_twin,
    _compare_with_two_forward,
    _maybe_no_sync,
    _plain_stepped,
    _tag,
    _warm_up_twins,
    assert_close_dicts_tol,
    assert_same_state,
)
from tests.support.harness import Registry
from tests.support.parity import LOSSES, batch, block_options, make_net, sgd

registry = Registry()


# --- Block vs. the two-forward way (same mixed-precision configuration) -------


def _mixed_precision_case(keep, sync, uop, backwards):
    """MixedPrecision(param_dtype=bf16, reduce_dtype=fp32), 3 passes, 3 SGD steps,
    against two forwards with the same policy (TOL_SAME); afterwards FSDP1's
    state is that of a model after a plain step."""

    def run() -> None:
        make = functools.partial(_bf16_model, uop)
        options = block_options(keep, sync, 3 if backwards else None)
        model = _compare_with_two_forward(make, options, TOL_SAME, contextlib.nullcontext)
        assert fsdp1_snapshot(model) == fsdp1_snapshot(_plain_stepped(make)), "state left"

    return run


for i, (keep, sync, uop) in enumerate(GRID):
    backwards = i % 3 == 0
    registry.add(
        f"mixed_precision_bf16_vs_two_forward_{_tag(keep, sync, uop)}"
        f"{'_backwards' if backwards else ''}",
        _mixed_precision_case(keep, sync, uop, backwards),
    )


def _autocast_case(keep, sync, uop):
    """torch.autocast("cpu", bf16) around the forward inside the block, 3 passes,
    3 SGD steps, against two forwards under the same autocast (TOL_SAME). Plain
    FSDP1 fails on the second backward under autocast (checked first)."""

    def run() -> None:
        ctx = functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16)
        make = lambda: f1.wrap(make_net(), use_orig_params=uop)  # noqa: E731
        plain = make()
        with ctx():
            out = plain(batch(0))
        LOSSES[0](out).float().backward(retain_graph=True)
        with pytest.raises(RuntimeError):
            LOSSES[1](out).float().backward()
        _compare_with_two_forward(make, block_options(keep, sync), TOL_SAME, ctx)

    return run


for keep, sync, uop in GRID:
    registry.add(
        f"autocast_bf16_vs_two_forward_{_tag(keep, sync, uop)}", _autocast_case(keep, sync, uop)
    )


# --- Two forwards in one block with parameter mixed precision -----------------


def _pipelined(model, xa, xb, block, between=None) -> None:
    """Forward A, forward B, then backward A, backward B, backward A+B."""
    with block:
        out_a, out_b = model(xa), model(xb)
        for i, loss in enumerate((out_a, out_b, out_a + out_b)):
            LOSSES[i](loss).float().backward(retain_graph=i < 2)
            if between is not None and i < 2:
                between(i)


def _one_forward_per_pass(model, xa, xb, sync, between=None) -> None:
    """The same three losses, each from its own forwards (plain FSDP1)."""
    with _maybe_no_sync(model, sync, False):
        LOSSES[0](model(xa)).float().backward()
    if between is not None:
        between(0)
    with _maybe_no_sync(model, sync, False):
        LOSSES[1](model(xb)).float().backward()
    if between is not None:
        between(1)
    LOSSES[2](model(xa) + model(xb)).float().backward()


def _two_forwards_mp_case(keep, sync, uop):
    """bf16 parameters give every forward its own AccumulateGrad node and FSDP1
    hooks only the first one; the block reduces each pass once, after all nodes
    the pass runs (pass 2 runs only forward B's node). Against plain FSDP1 doing
    one forward per pass, same policy, 3 SGD steps, TOL_SAME; with "every" the
    gradients are also compared after each pass."""

    def run() -> None:
        make = functools.partial(_bf16_model, uop)
        new, old = make(), make()
        init = f1.full_params(old)
        new_opt, old_opt = sgd(new), sgd(old)
        tol = TOL_SAME
        for step in range(3):
            xa, xb = batch(step), batch(step + 100)
            seen: dict[str, list] = {"new": [], "old": []}

            def between(i, key, model):
                if sync == "every":
                    seen[key].append(f1.full_grads(model))

            old_between = functools.partial(between, key="old", model=old)
            _one_forward_per_pass(old, xa, xb, sync, old_between)
            block = no_reshard_between_backwards(new, **block_options(keep, sync))
            _pipelined(new, xa, xb, block, functools.partial(between, key="new", model=new))
            where = f"step {step} keep={keep} sync={sync} uop={uop}"
            for i, (a, b) in enumerate(zip(seen["new"], seen["old"])):
                assert_close_dicts_tol(a, b, tol, f"{where}: after pass {i + 1}")
            _assert_trained_alike(new, old, new_opt, old_opt, tol, where, init)
        assert fsdp1_snapshot(new) == fsdp1_snapshot(_plain_stepped(make)), "state left"

    return run


for keep, sync, uop in GRID:
    registry.add(
        f"two_forwards_mixed_precision_{_tag(keep, sync, uop)}",
        _two_forwards_mp_case(keep, sync, uop),
    )


@registry.case()
def missing_engine_query_refused() -> None:
    """Where torch lacks the autograd-engine query the block needs (to see where
    each pass starts and which units it reaches), entering the block raises,
    naming the internal and the torch version; FSDP1 is left as it was."""
    model = f1.wrap(make_net(), mixed_precision=BF16_MP)
    twin = f1.wrap(make_net(), mixed_precision=BF16_MP)
    _warm_up_twins(model, twin)
    before = fsdp1_snapshot(model)
    saved = torch._C._will_engine_execute_node
    del torch._C._will_engine_execute_node
    try:
        with pytest.raises(RuntimeError, match="_will_engine_execute_node") as caught:
            with no_reshard_between_backwards(model):
                raise AssertionError("block entered")
    finally:
        torch._C._will_engine_execute_node = saved
    assert f"torch {torch.__version__}" in str(caught.value), caught.value
    assert_same_state(model, before, "refusal")
    _check_twin(model, twin, "after the refusal")
