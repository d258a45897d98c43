"""FSDP2 wrapping and readers for the parity harness (run inside ranks)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from tests.support.parity import Adapter, device, world


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _fsdp_sharded(t: torch.Tensor) -> bool:
    """FSDP2's layout: Shard(0) on the last mesh dim, replicated on the others (HSDP)."""
    if not isinstance(t, DTensor):
        return False
    *outer, last = t.placements
    return last == Shard(0) and all(p == Replicate() for p in outer)


def _full_all(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``full_tensor()`` of each, with one all-gather per dtype for FSDP2's shards of one
    mesh (a per-tensor all-gather costs ~1 ms on gloo; the readers run many). The gather
    uses c10d, not DTensor's functional collectives: those segfaulted on gloo with a 2 x 2
    HSDP mesh on a loaded 2-core CI machine (torch 2.13.0)."""
    fast = [n for n, t in named.items() if _fsdp_sharded(t)]
    if len({id(named[n].device_mesh) for n in fast}) != 1:
        return {n: _full(t) for n, t in named.items()}
    result = {n: _full(t) for n, t in named.items() if n not in set(fast)}
    for dtype in {named[n].dtype for n in fast}:
        result.update(_gather_dim0([(n, named[n]) for n in fast if named[n].dtype == dtype]))
    return {n: result[n] for n in named}


def _gather_dim0(items: list[tuple[str, DTensor]]) -> dict[str, torch.Tensor]:
    mesh = items[0][1].device_mesh
    ws = mesh.size(mesh.ndim - 1)
    layout, pieces = [], []  # (name, shape, padded local numel, each rank's rows, row numel)
    for name, t in items:
        shape = tuple(t.shape)
        rows = [len(c) for c in torch.arange(shape[0]).chunk(ws)]  # FSDP2's torch.chunk
        rows += [0] * (ws - len(rows))
        inner = math.prod(shape[1:])
        padded = max(rows) * inner
        local = t.to_local().detach().reshape(-1)
        pieces.append(torch.nn.functional.pad(local, (0, padded - local.numel())))
        layout.append((name, shape, padded, rows, inner))
    send = torch.cat(pieces)
    out = torch.empty(ws * send.numel(), dtype=send.dtype, device=send.device)
    dist.all_gather_into_tensor(out, send, group=mesh.get_group(mesh.ndim - 1))
    per_rank = out.view(ws, -1)
    result, offset = {}, 0
    for name, shape, padded, rows, inner in layout:
        parts = [per_rank[r, offset:offset + rows[r] * inner] for r in range(ws)]
        result[name] = torch.cat(parts).view(shape).clone()
        offset += padded
    return result


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return _full_all(dict(model.named_parameters()))


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return _full_all({n: p.grad for n, p in model.named_parameters() if p.grad is not None})


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


def wrap_replicate(model: nn.Module) -> nn.Module:
    """``replicate_with_fsdp``'s ``replicate`` (DDP on FSDP2's machinery) on each block,
    then the root, as ``wrap`` does with ``fully_shard``: a 1-D mesh of every rank, or
    where a torch's replicate takes only a 2-D mesh, ``(replicate=world, shard=1)``."""
    import inspect

    from torch.distributed._composable.replicate_with_fsdp import replicate

    # The mesh's keyword: mesh= where replicate names it, else (torch 2.9) device_mesh=.
    key = "mesh" if "mesh" in inspect.signature(replicate).parameters else "device_mesh"
    mesh = init_device_mesh(device().type, (world(),))
    try:  # on a scratch module: a refused replicate() leaves its registry entry behind
        replicate(nn.Linear(1, 1, device=device()), **{key: mesh})
    except ValueError as exc:  # an HSDP-based replicate_with_fsdp
        if "2D" not in str(exc):
            raise
        mesh = init_device_mesh(device().type, (world(), 1), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        replicate(block, **{key: mesh})
    replicate(model, **{key: mesh})
    return model


def units(model: nn.Module) -> int:
    """FSDP units with parameters: the wrapped blocks and the root."""
    from fsdp_retain._fsdp2._inspect import fsdp2_param_groups

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
