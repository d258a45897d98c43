"""The gradients an FSDP2 block holds back (``sync_grads="last"``).

Part of the FSDP2 backend with ``_block.py``. With gradients held back as
unsharded tensors, the sharded ``.grad`` the optimizer clears is not where
they live. ``HeldGrads`` marks each sharded ``.grad`` after a pass that held
gradients back, so that a ``zero_grad()`` between passes reaches them too: a
parameter with pending gradients gets a zero ``.grad`` if it has none; if that
tensor is later replaced, set to None or zeroed in place, the pending
gradients go too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ._compat import (
    clear_unsharded_grad,
    grad_version,
    has_pending_grad,
    replica_weights,
    shard_group,
)
from .._grad_layout import Layout, Segment, clean_name
from .._loss_grads import GradSlots


@dataclasses.dataclass
class _Sentinel:
    grad: torch.Tensor
    version: tuple[int, int]
    created: bool


class HeldGrads:
    """The sentinels of one block, per FSDP parameter."""

    def __init__(self) -> None:
        self._sentinels: dict[Any, _Sentinel] = {}

    def record(self, groups: list[Any]) -> None:
        """Marks the sharded ``.grad`` of every parameter with pending gradients."""
        for group in groups:
            for fsdp_param in group.fsdp_params:
                if not has_pending_grad(fsdp_param):
                    continue
                param = fsdp_param.sharded_param
                old = self._sentinels.get(fsdp_param)
                created = param.grad is None or (old is not None and old.created)
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                self._sentinels[fsdp_param] = _Sentinel(
                    param.grad, grad_version(param.grad), created
                )

    def check(self) -> None:
        """Drops the pending gradients of every parameter whose ``.grad`` was cleared."""
        for fsdp_param, sentinel in list(self._sentinels.items()):
            grad = fsdp_param.sharded_param.grad
            if grad is sentinel.grad and grad_version(grad) == sentinel.version:
                continue
            clear_unsharded_grad(fsdp_param)
            del self._sentinels[fsdp_param]

    def drop_unused(self) -> None:
        """Removes the zero ``.grad`` this block created where nothing was added."""
        for fsdp_param, sentinel in self._sentinels.items():
            param = fsdp_param.sharded_param
            if (
                sentinel.created
                and param.grad is sentinel.grad
                and grad_version(param.grad) == sentinel.version
            ):
                param.grad = None
        self._sentinels.clear()

    def forget(self) -> None:
        """Before a reduction that adds onto the marked ``.grad`` tensors: keep them."""
        self._sentinels.clear()


def fsdp2_layout(model: Any, groups: list[Any]) -> Layout:
    """One segment per FSDP parameter, named from ``model`` (see [Note: which
    parameters a per-loss gradient covers]). Between passes a module may show the
    unsharded parameter rather than the sharded one: both stand for its name."""
    prefixes = {id(m): clean_name(n) for n, m in model.named_modules()}

    def full(module: Any, name: str) -> str:
        prefix = prefixes.get(id(module), "?")
        return f"{prefix}.{name}" if prefix else name

    segments, numels = [], []
    tensors: dict[int, tuple[str, ...]] = {}
    for group in groups:
        for fsdp_param in group.fsdp_params:
            info = fsdp_param._module_info
            names = (full(info.module, info.param_name),) + tuple(
                full(m, n) for m, n in zip(info.shared_modules, info.shared_param_names)
            )
            sharded = fsdp_param.sharded_param
            numel = sharded._local_tensor.numel()
            segments.append([Segment(names[0], 0, numel, sharded.requires_grad, names[1:])])
            numels.append(numel)
            tensors[id(sharded)] = names
            unsharded = fsdp_param.__dict__.get("_unsharded_param")
            if unsharded is not None:
                tensors[id(unsharded)] = names
    return Layout(model, segments, numels, tensors)


def fsdp2_grad_slots(model: Any, groups: list[Any]) -> GradSlots:
    """Where ``block.grads`` reads and puts gradients: each sharded parameter."""
    holders = [fp.sharded_param for g in groups for fp in g.fsdp_params]
    process_groups = {shard_group(p) for p in holders}
    # 1-D FSDP2 or HSDP: the shards of one group; with tensor parallelism (or
    # parameters on different meshes) each counts once over all ranks.
    one = len(process_groups) == 1 and None not in process_groups
    return GradSlots(holders, process_groups.pop() if one else None, True,
                     fsdp2_layout(model, groups), None if one else replica_weights(holders))
