"""The block where trainers put it (part of ``tests/real_stacks/cases_real_stacks.py``).

- Opened inside the FSDP root's forward: Lightning's ``FSDPStrategy`` wraps the
  LightningModule and runs ``training_step`` (the forward and both ``manual_backward``
  calls) inside the root's forward. FSDP1 without the library fails there even with
  one pass; with it, every option and a probe pass match the reference. FSDP2 too.
- Given a wrapper that holds one FSDP root and no parameter of its own (the
  LightningModule whose ``configure_model`` sharded ``self.net``, Fabric's module):
  the block takes the root; a wrapper holding more is refused, naming the fix.

Lightning itself runs in ``tests/docs/test_examples.py`` (``examples/lightning_manual.py``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fsdp_retain import no_reshard_between_backwards
from tests.support import fsdp1_utils as f1
from tests.support import fsdp2_utils as f2
from tests.support.harness import Registry
from tests.support.parity import (
    DIM,
    Net,
    assert_close_dicts,
    averaged_grads,
    batch,
    device,
    reference_copy,
    sgd,
)
from tests.support.real_stacks_hf import OPTIONS, STEPS, _opt_tag

registry = Registry()


class StepNet(Net):
    """A root whose forward runs a whole training step when given one, as Lightning's
    wrapper of the LightningModule runs ``training_step``."""

    def forward(self, x: torch.Tensor, step=None) -> torch.Tensor:
        if step is None:
            return super().forward(x)
        return step(lambda: super(StepNet, self).forward(x))


def make_step_net() -> StepNet:
    torch.manual_seed(42)
    return StepNet(DIM, 3).to(device())


def _passes(out: torch.Tensor) -> None:
    out.mean().backward(retain_graph=True)
    out.pow(2).mean().backward()


def _reference_step(ref: nn.Module, ref_opt, x: torch.Tensor) -> dict[str, torch.Tensor]:
    _passes(ref(x))
    grads = averaged_grads(ref)
    for name, param in ref.named_parameters():
        param.grad = grads[name]
    ref_opt.step()
    ref_opt.zero_grad()
    return grads


def _inside_root_forward(flavour: str, keep, sync: str, probe: bool,
                         strategy=f1.FULL, uop: bool = True) -> None:
    """The block opened inside the root's forward, two passes (after a probe pass),
    3 SGD-momentum steps against the unsharded reference."""
    model = make_step_net()
    ref = reference_copy(model)
    if flavour == "fsdp1":
        model, adapter = f1.wrap(model, strategy, use_orig_params=uop), f1.ADAPTER
    else:
        model, adapter = f2.wrap(model), f2.ADAPTER
    opt, ref_opt = sgd(model), sgd(ref)
    passes = []

    def train_step(forward) -> torch.Tensor:
        with no_reshard_between_backwards(model, keep_unsharded=keep, sync_grads=sync) as b:
            out = forward()
            if probe:
                b.backward(out.sum(), param_grads=False, retain_graph=True)
            _passes(out)
        passes.append(b.backward_passes)
        return out.detach()

    for step in range(STEPS):
        x = batch(step)
        expected = _reference_step(ref, ref_opt, x)
        model(x, train_step)
        assert_close_dicts(adapter.full_grads(model), expected, f"step {step}")
        opt.step()
        opt.zero_grad()
    assert passes == [2 + probe] * STEPS, passes
    assert_close_dicts(adapter.full_params(model), dict(ref.named_parameters()), "params")


for _flavour in ("fsdp1", "fsdp2"):
    for _keep, _sync in OPTIONS:
        for _probe in (False, True):
            registry.add(
                f"inside_root_forward_{_flavour}_{_opt_tag(_keep, _sync)}"
                f"{'_probe' if _probe else ''}",
                lambda f=_flavour, k=_keep, s=_sync, p=_probe: _inside_root_forward(f, k, s, p),
            )
# FSDP1's other strategies and flat parameters (the root's pre-backward unshard is the
# mechanism they share): the re-gathering options, with a probe pass.
for _strategy, _uop in ((f1.FULL, False), (f1.GRAD_OP, True), (f1.GRAD_OP, False),
                        (f1.NO_SHARD, True)):
    for _sync in ("every", "last"):
        registry.add(
            f"inside_root_forward_fsdp1_{f1.STRATEGY_NAMES[_strategy]}_"
            f"{'orig' if _uop else 'flat'}_regather_{_sync}",
            lambda st=_strategy, u=_uop, s=_sync: _inside_root_forward(
                "fsdp1", False, s, False, st, u),
        )
        registry.add(
            f"inside_root_forward_fsdp1_{f1.STRATEGY_NAMES[_strategy]}_"
            f"{'orig' if _uop else 'flat'}_regather_{_sync}_probe",
            lambda st=_strategy, u=_uop, s=_sync: _inside_root_forward(
                "fsdp1", False, s, True, st, u),
        )


@registry.case()
def inside_root_forward_fsdp1_without_block_fails() -> None:
    """Plain FSDP1 refuses a backward inside the root's forward, even a single one
    (what Lightning's own FSDP wrapping with manual optimization hits)."""
    model = f1.wrap(make_step_net(), f1.FULL, use_orig_params=True)

    def train_step(forward) -> torch.Tensor:
        out = forward()
        out.mean().backward()
        return out.detach()

    with pytest.raises((AssertionError, RuntimeError)):
        model(batch(0), train_step)


class Holder(nn.Module):
    """What a trainer holds around the sharded model (a LightningModule, Fabric's
    module): no parameter of its own."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@registry.case()
def wrapper_holding_one_root() -> None:
    """A wrapper of one FSDP root (FSDP1 and FSDP2) is taken for the root: two passes
    over 3 steps match the reference. A wrapper with a parameter of its own, or
    several roots, is refused before any gradient is written, naming the fix."""
    for flavour in ("fsdp1", "fsdp2"):
        net = make_step_net()
        ref = reference_copy(net)
        if flavour == "fsdp1":
            net, adapter = f1.wrap(net, f1.FULL, use_orig_params=True), f1.ADAPTER
        else:
            net, adapter = f2.wrap(net), f2.ADAPTER
        holder = Holder(net)
        opt, ref_opt = sgd(holder), sgd(ref)
        for step in range(STEPS):
            x = batch(step)
            expected = _reference_step(ref, ref_opt, x)
            with no_reshard_between_backwards(holder, sync_grads="last") as b:
                _passes(holder(x))
            assert b.backward_passes == 2
            assert_close_dicts(adapter.full_grads(net), expected, f"{flavour} step {step}")
            opt.step()
            opt.zero_grad()
        holder.extra = nn.Linear(2, 2)
        with pytest.raises(ValueError, match="parameters outside it.*Wrap the root too"):
            with no_reshard_between_backwards(holder):
                pass
        assert all(p.grad is None for p in holder.parameters())
