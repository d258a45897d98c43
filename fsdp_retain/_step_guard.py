"""Refuses ``optimizer.step()`` over the block's parameters inside the block.

[Note: why an optimizer step inside the block is refused]
The passes of one block all differentiate the graph its forward recorded, and
that graph saved the unsharded parameters the forward gathered. A step between
two passes changes the sharded parameters only: the later pass still computes
with the forward's weights, and on FSDP1 with ``use_orig_params=True`` a step
while the block holds a unit unsharded writes into the unsharded views, which
the block's reshard then discards. Plain PyTorch raises an in-place error in
the first case; FSDP's copies hide it. With ``sync_grads="last"`` the gradients
are reduced only when the block exits, so even a step after the last pass
would read unreduced gradients. The block therefore refuses any
``torch.optim.Optimizer.step`` whose parameters include the model's, from its
entry to its exit, before the step changes anything (DeepSpeed's
``engine.step()`` is refused by its backend). It uses torch's global optimizer
step pre-hook, so it sees every optimizer class, and only parameters by
identity: an optimizer over another model steps freely, and an in-place edit of
a parameter by hand is not seen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ._common import RetainError


def refuse_step(
    model: nn.Module, block_params: Callable[[], Iterable[torch.Tensor]] | None = None
) -> Any:
    """Installs the refusal for ``model``'s parameters; returns the hook handle.

    The parameters are taken at each step, not at entry (no walk over the model
    while no step runs): the model's, and with ``block_params`` (every parameter
    object the backend registers on the modules, sharded or not) the backend's:
    FSDP2 registers unsharded parameters on the module while it holds them, and
    the optimizer was built over the sharded ones. DDP, FSDP1 and DeepSpeed
    register the same parameter objects from entry to exit.
    """

    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        mine = {id(p) for p in model.parameters()}
        if block_params is not None:
            mine.update(id(p) for p in block_params())
        if any(id(p) in mine for group in optimizer.param_groups for p in group["params"]):
            raise RetainError(
                f"{type(optimizer).__name__}.step() was called inside "
                "no_reshard_between_backwards over the block's parameters: later passes "
                "of the block would still use the weights of its forward, and the "
                "gradients may not be reduced yet. Call optimizer.step() after the "
                "`with` block exits (one block per optimizer step)."
            )

    return register_optimizer_step_pre_hook(hook)
