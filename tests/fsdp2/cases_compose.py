"""Composability with the rest of FSDP2 (CPU, gloo, world size 2).

Run inside ranks by ``tests/fsdp2/test_compose.py``. Configurations whose numerics
differ from fp32 (bf16 mixed precision, autocast) are compared against the
same configuration trained the two-forward way (what users do today), with
the tolerance stated in each case; the others against the unsharded reference.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.utils.checkpoint import checkpoint

from fsdp_retain import no_reshard_between_backwards
from tests.support import fsdp2_utils as f2
from tests.support.harness import Registry
from tests.support.parity import (
    OPTION_GRID,
    block_options,
    penalty_step,
    LOSSES,
    Scenario,
    assert_close_dicts,
    batch,
    make_net,
    reference_copy,
    run_parity,
    sgd,
)

registry = Registry()




def _two_forward_step(model, opt, x, passes, forward_ctx) -> None:
    for i in range(passes):
        with forward_ctx():
            out = model(x)
        LOSSES[i](out).float().backward()
    opt.step()
    opt.zero_grad()


def _retain_step(model, opt, x, passes, forward_ctx, options) -> None:
    with no_reshard_between_backwards(model, **options):
        with forward_ctx():
            out = model(x)
        for i in range(passes):
            LOSSES[i](out).float().backward(retain_graph=i < passes - 1)
    opt.step()
    opt.zero_grad()


def _compare_with_two_forward(make_model, options, tol, forward_ctx=contextlib.nullcontext, passes=3, steps=3):
    """Trains two identical models, two-forward vs. the block; params must agree."""
    new, old = make_model(), make_model()
    new_opt, old_opt = sgd(new), sgd(old)
    for step in range(steps):
        x = batch(step)
        _two_forward_step(old, old_opt, x, passes, forward_ctx)
        _retain_step(new, new_opt, x, passes, forward_ctx, options)
        assert_close_dicts(f2.full_params(new), f2.full_params(old), f"step {step} {options}")
        # Guard against a vacuous comparison: training moved the parameters.
    init = f2.full_params(make_model())
    moved = max((init[n] - p).abs().max().item() for n, p in f2.full_params(new).items())
    assert moved > 10 * tol["atol"], moved


@registry.case()
def mixed_precision_bf16_params_fp32_reduce() -> None:
    """bf16 params, fp32 reduce: against two-forward with the same policy.

    sync_grads="every" runs exactly the two-forward arithmetic (rtol/atol 1e-5);
    "last" sums the passes' bf16 gradients before one fp32 reduce-scatter
    instead of after, so it gets bf16 tolerance (rtol 1e-2, atol 1e-3).
    """
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for keep, sync in OPTION_GRID:
        tol = dict(rtol=1e-5, atol=1e-5) if sync == "every" else dict(rtol=1e-2, atol=1e-3)
        make = lambda: f2.wrap(make_net(), mp_policy=mp)  # noqa: E731
        _compare_with_two_forward(make, block_options(keep, sync), tol)


@registry.case()
def autocast_bf16_forward() -> None:
    """torch.autocast(cpu, bf16) around the forward; same tolerances as above."""
    ctx = functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16)
    for keep, sync in OPTION_GRID:
        tol = dict(rtol=1e-5, atol=1e-5) if sync == "every" else dict(rtol=1e-2, atol=1e-3)
        _compare_with_two_forward(lambda: f2.wrap(make_net()), block_options(keep, sync), tol, ctx)


class CheckpointedNet(nn.Module):
    """``Net`` with non-reentrant activation checkpointing around each block."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.inp, self.blocks, self.out = net.inp, net.blocks, net.out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False)
        return self.out(h)


@registry.case()
def activation_checkpointing_non_reentrant() -> None:
    """The recompute in every backward finds its parameters; parity with the reference.

    keep_unsharded=True still all-gathers each unit once per step: the
    recompute reuses the kept parameters.
    """
    for keep, sync in OPTION_GRID:
        ref = reference_copy(make_net())
        model = f2.wrap(CheckpointedNet(make_net()))
        scenario = Scenario(passes=3, options=block_options(keep, sync), check_between=sync == "every")

        def expect(counts, keep=keep) -> None:
            if keep:
                assert counts.all_gather == f2.units(model), counts.by_op

        run_parity(model, ref, scenario, f2.ADAPTER, expect)


@registry.case()
def cpu_offload_policy() -> None:
    for keep, sync in OPTION_GRID:
        ref = reference_copy(make_net())
        model = f2.wrap(make_net(), offload_policy=CPUOffloadPolicy(pin_memory=False))
        scenario = Scenario(passes=2, options=block_options(keep, sync), check_between=sync == "every")
        run_parity(model, ref, scenario, f2.ADAPTER)


@registry.case()
def two_forwards_then_their_backwards() -> None:
    """Pipelining pattern: forward A, forward B, then backward A, backward B."""
    for keep, sync in OPTION_GRID:
        ref = reference_copy(make_net())
        model = f2.wrap(make_net())
        opt, ref_opt = sgd(model), sgd(ref)
        for step in range(3):
            xa, xb = batch(step), batch(step + 100)
            for m, o in ((ref, ref_opt), (model, opt)):
                block = (
                    no_reshard_between_backwards(m, **block_options(keep, sync))
                    if m is model
                    else contextlib.nullcontext()
                )
                with block:
                    out_a, out_b = m(xa), m(xb)
                    LOSSES[0](out_a).backward(retain_graph=True)
                    LOSSES[1](out_b).backward(retain_graph=True)
                    LOSSES[2](out_a + out_b).backward()
                if m is ref:
                    for p in ref.parameters():
                        torch.distributed.all_reduce(p.grad)
                        p.grad /= torch.distributed.get_world_size()
                o.step()
                o.zero_grad()
            ref_params = {n: p.detach() for n, p in ref.named_parameters()}
            assert_close_dicts(f2.full_params(model), ref_params, f"step {step} {keep} {sync}")



@registry.case()
def gradient_penalty_create_graph() -> None:
    """Higher-order gradients: plain FSDP2 crashes, keep_unsharded=True matches the
    reference over 3 steps, keep_unsharded=False refuses with a clear error."""
    model = f2.wrap(make_net())
    try:
        penalty_step(model, batch(0), contextlib.nullcontext())
    except RuntimeError as exc:
        assert "storage of size 0" in str(exc), exc
    else:
        raise AssertionError("plain FSDP2 no longer fails with create_graph=True")
    for sync in ("every", "last"):
        ref = reference_copy(make_net())
        model = f2.wrap(make_net())
        opt, ref_opt = sgd(model), sgd(ref)
        for step in range(3):
            x = batch(step)
            penalty_step(ref, x, contextlib.nullcontext())
            for p in ref.parameters():
                torch.distributed.all_reduce(p.grad)
                p.grad /= torch.distributed.get_world_size()
            penalty_step(model, x, no_reshard_between_backwards(model, sync_grads=sync))
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
            ref_params = {n: p.detach() for n, p in ref.named_parameters()}
            assert_close_dicts(f2.full_params(model), ref_params, f"step {step} {sync}")
    model = f2.wrap(make_net())
    try:
        penalty_step(model, batch(0), no_reshard_between_backwards(model, keep_unsharded=False))
    except RuntimeError as exc:
        assert "needs keep_unsharded=True" in str(exc), exc
    else:
        raise AssertionError("keep_unsharded=False accepted create_graph=True")
    run_parity(model, reference_copy(make_net()), Scenario(passes=2, steps=1), f2.ADAPTER)
