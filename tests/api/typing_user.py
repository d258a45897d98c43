"""User-style code that CI type-checks with mypy (``.ci/run``); never executed.

It uses the public API as a user's training loop would. mypy runs with
``warn_unused_ignores``, so each ``# type: ignore[...]`` below is a check that the
annotation still rejects that misuse.
"""

from __future__ import annotations

from typing import assert_type

import torch
import torch.nn as nn

from fsdp_retain import (
    LossGrads,
    RetainBlock,
    SyncGrads,
    apply_grads,
    combine,
    gramian,
    no_reshard_between_backwards,
)


def two_losses(model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> int:
    with no_reshard_between_backwards(model, backwards=2, sync_grads="last") as block:
        assert_type(block, RetainBlock)
        out = model(batch)
        block.backward(out.pow(2).mean(), param_grads=False, retain_graph=True)
        out.mean().backward()
        passes: int = block.backward_passes
    optimizer.step()
    return passes


def options_from_config(model: nn.Module, sync: SyncGrads, keep: bool) -> None:
    with no_reshard_between_backwards(model, keep_unsharded=keep, sync_grads=sync) as block:
        block.backward(model(torch.ones(1)).sum(), retain_graph=None)


def budget_and_one_pass_hook(model: nn.Module, batch: torch.Tensor) -> None:
    with no_reshard_between_backwards(model, keep_unsharded=8 * 2**30) as block:

        def hook(module: nn.Module, grad_input: object, grad_output: object) -> None:
            if block.probing and block.pass_index == 1:
                pass

        model.register_full_backward_hook(hook)
        out = model(batch)
        block.backward(out.sum(), param_grads=False, retain_graph=True)


def shared_trunk(model: nn.Module, trunk: nn.Module, losses: list[torch.Tensor]) -> dict[str, float]:
    with no_reshard_between_backwards(model) as block:
        grads = [block.grads(loss, retain_graph=True) for loss in losses]
        shared = [g.select(trunk) for g in grads]
        assert_type(shared[0], LossGrads)
        apply_grads(combine(shared, gramian(shared).diagonal().rsqrt()))
        apply_grads(combine([g.select(exclude=trunk) for g in grads], [1.0] * len(grads)))
        head = block.grads(losses[0], params=["head.weight"])
        names: tuple[str, ...] = head.names
    return {name: float(norm) for name, norm in grads[0].norms().items() if name in names}


def misuse(model: nn.Module, loss: torch.Tensor) -> None:
    with no_reshard_between_backwards(model, sync_grads="sometimes"):  # type: ignore[arg-type]
        pass
    with no_reshard_between_backwards(model) as block:
        block.backward(loss, True)  # type: ignore[call-arg]
        block.backward_passes = 3  # type: ignore[misc]
