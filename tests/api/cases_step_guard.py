"""``optimizer.step()`` inside the block is refused (CPU, gloo, world size 2).

Run inside ranks by ``tests/api/test_step_guard.py``. See [Note: why an optimizer
step inside the block is refused] in ``fsdp_retain/_step_guard.py``.

- A step between two passes, and a step after the last pass but inside the
  ``with``, raise a RuntimeError that names the fix before any parameter
  changes; the block then goes on, and with the step after the block the run
  matches the unsharded reference over 3 steps (nothing is lost). FSDP1
  FULL_SHARD (both ``use_orig_params``) and FSDP2, every option.
- An optimizer over another model steps freely inside the block, and the
  model's own optimizer after it.
- Without the guard the same step between passes is accepted silently (FSDP1
  ``use_orig_params=True``, FSDP2: the next pass uses the forward's weights) or
  crashes in autograd with an error that does not name the cause (FSDP1 flat
  parameters), while the unsharded model raises autograd's in-place error.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.nn as nn

from fsdp_retain import _lifecycle, no_reshard_between_backwards
from tests.support import fsdp1_utils as f1
from tests.support import fsdp2_utils as f2
from tests.support.harness import Registry
from tests.support.parity import (
    LOSSES,
    OPTION_GRID,
    Scenario,
    assert_close_dicts,
    batch,
    block_options,
    make_net,
    reference_copy,
    reference_step,
    sgd,
)

registry = Registry()
STEPS = 3
BACKENDS = {
    "fsdp1_flat": (lambda m: f1.wrap(m, use_orig_params=False), f1),
    "fsdp1_orig": (lambda m: f1.wrap(m, use_orig_params=True), f1),
    "fsdp2": (f2.wrap, f2),
}


def _local(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's parameters as the optimizer holds them (no collective)."""
    return [p.detach().clone() for group in opt.param_groups for p in group["params"]]


def _stepped(opt: torch.optim.Optimizer) -> bool:
    before = _local(opt)
    opt.step()
    return any(not torch.equal(a, b) for a, b in zip(_local(opt), before))


def _refused(opt: torch.optim.Optimizer) -> None:
    before = _local(opt)
    with pytest.raises(RuntimeError, match=r"after the\s+`with` block exits"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(_local(opt), before)), "the step wrote"


def _refused_then_parity(backend: str, keep: bool, sync: str, where: str) -> None:
    """A refused step (between passes, or after the last one inside the block)
    changes nothing: continuing and stepping after the block matches the reference."""
    wrap, utils = BACKENDS[backend]
    torch.manual_seed(0)
    net = make_net()
    ref = reference_copy(net)
    model = wrap(net)
    opt, ref_opt = sgd(model), sgd(ref)
    for step in range(STEPS):
        x = batch(step)
        reference_step(ref, ref_opt, x, Scenario(passes=2))
        with no_reshard_between_backwards(model, **block_options(keep, sync)):
            out = model(x)
            LOSSES[0](out).backward(retain_graph=True)
            if where == "between":
                _refused(opt)
            LOSSES[1](out).backward()
            if where == "after_last":
                _refused(opt)
        opt.step()
        opt.zero_grad()
        ref_params = {n: p.detach() for n, p in ref.named_parameters()}
        assert_close_dicts(utils.full_params(model), ref_params, f"step {step}: params")


for _backend in BACKENDS:
    for _keep, _sync in OPTION_GRID:
        for _where in ("between", "after_last"):
            _tag = f"{'keep' if _keep else 'regather'}_{_sync}"
            registry.add(
                f"step_{_where}_refused_{_backend}_{_tag}",
                lambda b=_backend, k=_keep, s=_sync, w=_where: _refused_then_parity(b, k, s, w),
            )


def _other_optimizer(backend: str) -> None:
    """A critic's optimizer steps inside the actor's block; the actor's does not."""
    wrap, _ = BACKENDS[backend]
    torch.manual_seed(0)
    model = wrap(make_net())
    critic = nn.Linear(4, 1)
    critic_opt = torch.optim.SGD(critic.parameters(), lr=0.1)
    opt = sgd(model)
    with no_reshard_between_backwards(model):
        out = model(batch(0))
        LOSSES[0](out).backward(retain_graph=True)
        critic(torch.ones(2, 4)).sum().backward()
        before = critic.weight.detach().clone()
        critic_opt.step()
        assert not torch.equal(critic.weight, before), "the critic did not step"
        _refused(opt)
        LOSSES[1](out).backward()
    assert _stepped(opt), "no step after the block"


for _backend in BACKENDS:
    registry.add(f"other_optimizer_steps_{_backend}", lambda b=_backend: _other_optimizer(b))


class _NoHook:
    def remove(self) -> None:
        pass


def _without_guard(backend: str) -> None:
    """Without the guard the step between passes is silent (FSDP1 orig params, FSDP2)
    or crashes in autograd far from the cause (FSDP1 flat params); plain PyTorch
    raises its in-place error."""
    wrap, _ = BACKENDS[backend]
    torch.manual_seed(0)
    net = make_net()
    ref = reference_copy(net)
    ref_opt = sgd(ref)
    out = ref(batch(0))
    LOSSES[0](out).backward(retain_graph=True)
    ref_opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        LOSSES[1](out).backward()

    model = wrap(net)
    opt = sgd(model)
    crash = (
        pytest.raises(RuntimeError, match="is a view and its base")
        if backend == "fsdp1_flat"
        else contextlib.nullcontext()
    )
    with mock.patch.object(_lifecycle, "refuse_step", lambda model, *params: _NoHook()):
        with no_reshard_between_backwards(model):
            out = model(batch(0))
            LOSSES[0](out).backward(retain_graph=True)
            opt.step()  # accepted
            with crash:
                LOSSES[1](out).backward()


for _backend in BACKENDS:
    registry.add(f"without_guard_silent_{_backend}", lambda b=_backend: _without_guard(b))


def _hook_removed_on_error(backend: str) -> None:
    """The refusal ends with the block, also when the block exits by an exception."""
    wrap, _ = BACKENDS[backend]
    torch.manual_seed(0)
    model = wrap(make_net())
    opt = sgd(model)
    with contextlib.suppress(KeyError):
        with no_reshard_between_backwards(model):
            out = model(batch(0))
            LOSSES[0](out).backward()
            _refused(opt)
            raise KeyError("user code failed")
    for group in opt.param_groups:  # whatever the exception exit left in .grad
        for param in group["params"]:
            param.grad = torch.ones_like(param)
    assert _stepped(opt), "the step was refused"


for _backend in BACKENDS:
    registry.add(f"hook_removed_on_error_{_backend}", lambda b=_backend: _hook_removed_on_error(b))
