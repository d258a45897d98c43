"""A forward before the block and the FSDP1 guards (part of ``tests/real_stacks/cases_real_stacks.py``).

- ``out = model(x)`` above the ``with``: FSDP1 refuses the pass before any gradient
  moves and stays usable (without the block it crashes or is wrong); FSDP2 is right.
  A loss that also reaches a forward inside the block is right on both.
- The FSDP1 guards (see ``[Note: what the FSDP1 guards check]``): a unit whose
  reduction hook is gone raises instead of leaving an unreduced gradient.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from fsdp_retain import no_reshard_between_backwards
from tests.support import fsdp1_utils as f1
from tests.support import fsdp2_utils as f2
from tests.support.harness import Registry
from tests.support.parity import (
    Block,
    Scenario,
    assert_close_dicts,
    averaged_grads,
    batch,
    block_options,
    make_net,
    reference_copy,
    run_parity,
    sgd,
)
from tests.support.real_stacks_hf import OPTIONS, STEPS, _opt_tag

registry = Registry()


# --- A forward before the block -----------------------------------------------


def _forward_before_fsdp1(strategy, uop: bool, keep: bool, sync: str) -> None:
    """``out = model(x)`` above the ``with``: the first pass raises a RuntimeError that
    names the block and the fix before any gradient is written; the next plain steps
    and block steps match the reference."""
    model = make_net()
    ref = reference_copy(model)
    model = f1.wrap(model, strategy, use_orig_params=uop)
    run_parity(model, ref, Scenario(passes=1, steps=1, use_block=False), f1.ADAPTER)
    grads_before = f1.full_grads(model)
    out = model(batch(5))
    with pytest.raises(RuntimeError) as caught:
        with no_reshard_between_backwards(model, keep_unsharded=keep, sync_grads=sync):
            out.sum().backward(retain_graph=True)
            out.pow(2).sum().backward()
    text = str(caught.value)
    assert text.startswith("no_reshard_between_backwards:"), text
    assert "forward ran before the block" in text and "Run the forward inside" in text, text
    assert_close_dicts(f1.full_grads(model), grads_before, "grads after the refused pass")
    model.zero_grad()
    ref.zero_grad()
    run_parity(model, ref, Scenario(passes=1, steps=2, use_block=False), f1.ADAPTER)
    run_parity(
        model, ref,
        Scenario(passes=2, steps=1, options=block_options(keep, sync), check_between=False),
        f1.ADAPTER,
    )


def _add_forward_before_cases() -> None:
    for strategy, uop in itertools.product((f1.FULL, f1.GRAD_OP, f1.NO_SHARD), (True, False)):
        for keep, sync in OPTIONS if strategy == f1.FULL else OPTIONS[:1]:
            name = (
                f"forward_before_block_fsdp1_{f1.STRATEGY_NAMES[strategy]}_"
                f"{'orig' if uop else 'flat'}_{_opt_tag(keep, sync)}"
            )
            registry.add(name, functools.partial(_forward_before_fsdp1, strategy, uop, keep, sync))


_add_forward_before_cases()


@registry.case()
def forward_before_block_fsdp1_without_block_wrong() -> None:
    """Without the library the same layout crashes or gives wrong gradients on FSDP1
    (so the refusal is needed)."""
    model = make_net()
    ref = reference_copy(model)
    model = f1.wrap(model, f1.FULL, use_orig_params=True)
    x = batch(0)
    out = model(x)
    try:
        out.sum().backward(retain_graph=True)
        out.pow(2).sum().backward()
    except RuntimeError:
        return
    ref_out = ref(x)
    ref_out.sum().backward(retain_graph=True)
    ref_out.pow(2).sum().backward()
    expected = averaged_grads(ref)
    got = f1.full_grads(model)
    assert any(
        got.get(n) is None or not torch.allclose(got[n], expected[n], atol=1e-4)
        for n in expected
    ), "plain FSDP1 got the right gradients: the refusal would not be needed"


@registry.case()
def forward_before_block_fsdp2_parity() -> None:
    """FSDP2: a forward above the ``with`` then two passes inside match the reference
    over 3 steps, every option."""
    for keep, sync in OPTIONS:
        model = make_net()
        ref = reference_copy(model)
        model = f2.wrap(model)
        opt, ref_opt = sgd(model), sgd(ref)
        for step in range(STEPS):
            x = batch(step)
            ref_out = ref(x)
            ref_out.mean().backward(retain_graph=True)
            ref_out.pow(2).mean().backward()
            ref_grads = averaged_grads(ref)
            for name, param in ref.named_parameters():
                param.grad = ref_grads[name]
            ref_opt.step()
            ref_opt.zero_grad()
            out = model(x)
            with no_reshard_between_backwards(model, keep_unsharded=keep, sync_grads=sync):
                out.mean().backward(retain_graph=True)
                out.pow(2).mean().backward()
            assert_close_dicts(f2.full_grads(model), ref_grads, f"{keep}/{sync} step {step}")
            opt.step()
            opt.zero_grad()


def _mixed_forwards(wrap, full_grads, keep: bool, sync: str, passes: int) -> None:
    """One loss over a forward from before the block and one inside (each pass sums
    its loss over both): matches the reference over 3 steps. The pass reaches the
    block's forward, so it is not refused as a forward outside the block."""
    model = make_net()
    ref = reference_copy(model)
    model = wrap(model)
    opt, ref_opt = sgd(model), sgd(ref)
    losses = [lambda o: o.mean(), lambda o: o.pow(2).mean()][:passes]
    for step in range(STEPS):
        x0, x1 = batch(2 * step), batch(2 * step + 1)
        r0, r1 = ref(x0), ref(x1)
        for i, loss in enumerate(losses):
            (loss(r0) + loss(r1)).backward(retain_graph=i < passes - 1)
        ref_grads = averaged_grads(ref)
        for name, param in ref.named_parameters():
            param.grad = ref_grads[name]
        ref_opt.step()
        ref_opt.zero_grad()
        before = model(x0)
        with no_reshard_between_backwards(model, keep_unsharded=keep, sync_grads=sync):
            inside = model(x1)
            for i, loss in enumerate(losses):
                (loss(before) + loss(inside)).backward(retain_graph=i < passes - 1)
        assert_close_dicts(full_grads(model), ref_grads, f"{keep}/{sync} step {step}")
        opt.step()
        opt.zero_grad()


def _add_mixed_forward_cases() -> None:
    flavours = {
        f"fsdp1_{f1.STRATEGY_NAMES[strategy]}_{'orig' if uop else 'flat'}": (
            functools.partial(f1.wrap, strategy=strategy, use_orig_params=uop), f1.full_grads)
        for strategy, uop in itertools.product((f1.FULL, f1.GRAD_OP, f1.NO_SHARD), (True, False))
    }
    flavours["fsdp2"] = (f2.wrap, f2.full_grads)
    for (tag, (wrap, grads)), passes in itertools.product(flavours.items(), (1, 2)):
        for keep, sync in OPTIONS if tag in ("fsdp1_full_orig", "fsdp2") else OPTIONS[::3]:
            registry.add(
                f"mixed_forward_before_and_inside_{tag}_{_opt_tag(keep, sync)}_p{passes}",
                functools.partial(_mixed_forwards, wrap, grads, keep, sync, passes),
            )


_add_mixed_forward_cases()


# --- The FSDP1 guards ----------------------------------------------------------


class LossNet(nn.Module):
    """Returns a scalar loss from inside the root: backward starts at the root's
    output, where FSDP1's root pre-backward hook queues its final callback first."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).pow(2).mean()


def _drop_reduction_hook(model: nn.Module) -> None:
    """What a missed post-backward hook looks like: FSDP1 keeps the hook state,
    but the hook on the first block's AccumulateGrad node is gone."""
    unit = next(m for m in FSDP.fsdp_modules(model) if isinstance(m._fsdp_wrapped_module, Block))
    unit._handle.flat_param._post_backward_hook_state[-1].remove()


def _guard_case(strategy, root_output: bool, sync: str) -> None:
    """A unit that accumulates a gradient without FSDP1's reduction hook raises a
    RuntimeError naming the block, instead of leaving a wrong gradient."""
    torch.manual_seed(0)
    net = LossNet() if root_output else make_net()
    model = FSDP(
        net, auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=strategy,
        device_id=torch.device("cpu"),
    )
    x = batch(0)
    with pytest.raises(RuntimeError) as caught:
        with no_reshard_between_backwards(model, sync_grads=sync):
            out = model(x)
            loss = out if root_output else out.pow(2).mean()
            _drop_reduction_hook(model)
            loss.backward()
    text = str(caught.value)
    assert text.startswith("no_reshard_between_backwards:"), text
    assert "blocks.0" in text, text
    if root_output and sync == "every":
        assert "unsharded .grad" in text, text
    else:
        assert "without running FSDP1's post-backward hook" in text, text
    model.zero_grad()
    loss = model(x)
    (loss if root_output else loss.pow(2).mean()).backward()  # usable again


def _add_guard_cases() -> None:
    for strategy, root_output, sync in itertools.product(
        (f1.FULL, f1.NO_SHARD), (False, True), ("every", "last")
    ):
        if strategy == f1.NO_SHARD and root_output and sync == "every":
            continue  # reduced and unreduced look alike; see the guards' note
        name = (
            f"guard_missed_reduction_fsdp1_{f1.STRATEGY_NAMES[strategy]}_"
            f"{'root_output' if root_output else 'loss_outside'}_{sync}"
        )
        registry.add(name, functools.partial(_guard_case, strategy, root_output, sync))


_add_guard_cases()
