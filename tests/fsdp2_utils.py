"""FSDP2 wrapping and readers for the parity harness (run inside ranks)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from tests.parity import Adapter, device, world


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: _full(p) for n, p in model.named_parameters()}


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}


ADAPTER = Adapter(full_params=full_params, full_grads=full_grads)


def wrap(
    model: nn.Module,
    reshard_after_forward: bool = True,
    wrapped_blocks: list[int] | None = None,
    **kwargs,
) -> nn.Module:
    """``fully_shard`` each block (or those listed), then the root (FSDP2's root default)."""
    mesh = init_device_mesh(device().type, (world(),))
    for i, block in enumerate(model.blocks):
        if wrapped_blocks is not None and i not in wrapped_blocks:
            continue
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def units(model: nn.Module) -> int:
    """FSDP units with parameters: the wrapped blocks and the root."""
    from fsdp_retain._fsdp2_inspect import fsdp2_param_groups

    return len(fsdp2_param_groups(model))


def expected_all_gathers(
    model: nn.Module, passes: int, keep_unsharded: bool, reshard_after_forward: bool
) -> int:
    """All-gathers per step, from FSDP2's rules.

    Forward: one per unit. ``keep_unsharded``: nothing more. Otherwise each
    backward re-gathers every unit that is sharded when it starts: in pass 1
    the blocks if they reshard after forward (the root never does), in later
    passes every unit.
    """
    n = units(model)
    if keep_unsharded:
        return n
    first = (n - 1) if reshard_after_forward else 0
    return n + first + (passes - 1) * n


def expected_reduce_scatters(model: nn.Module, passes: int, sync_grads: str) -> int:
    """One per unit per backward with ``"every"``; one per unit with ``"last"``."""
    return units(model) * (passes if sync_grads == "every" else 1)
