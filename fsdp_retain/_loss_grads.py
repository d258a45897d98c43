"""Per-loss gradients under FSDP: one reduced, sharded gradient per loss.

[Note: per-loss gradients]
Gradient surgery (PCGrad), GradNorm and Jacobian descent (UPGrad, MGDA) combine
one gradient per loss before the step. ``block.grads(loss)`` is the sharded
counterpart of ``torch.autograd.grad(loss, model.parameters())``: one backward
pass of ``loss`` that FSDP reduces and shards as any pass inside the block (one
reduce-scatter per unit), whose gradients come back as a ``LossGrads`` instead of
adding to ``.grad``. ``.grad`` is left exactly as it was: the block moves it
aside for the pass (``_grad_slots``: the ``.grad`` of FSDP2's sharded parameters,
of FSDP1's flat parameters, ZeRO-3's gradient partitions) and puts it back after.

What a ``LossGrads`` holds is each rank's shard (1/world of the model per loss;
never an unsharded copy). Reductions over the whole model need one collective:
``gramian(grads)`` sums each rank's k x k block of shard dot products and
all-reduces it once over the group the shards partition (a replicated copy, FSDP1
``NO_SHARD``, needs none), so any weighting written for one process (torchjd's
aggregators take a Gramian) runs unchanged on the k x k result, the same on every
rank. ``combine(grads, weights)`` is local; ``apply_grads`` adds the result to
``.grad`` for the optimizer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


class GradSlots:
    """Where a backend keeps the reduced gradients its optimizer steps on, and how
    ``block.grads`` moves them aside for its pass: here the ``.grad`` of ``holders``
    (FSDP2's sharded parameters, FSDP1's flat parameters; ``refresh`` after ``.grad``
    changed from outside FSDP). DeepSpeed keeps them in ZeRO-3's gradient partitions
    (``_deepspeed_grads``). ``group``: the process group whose ranks hold disjoint
    shards; ``sharded`` False: every rank holds everything.
    """

    def __init__(self, holders: list[Any], group: Any, sharded: bool, refresh: Any = None) -> None:
        self.holders = holders
        self.group = group
        self.sharded = sharded
        self._refresh = refresh

    def _changed(self) -> None:
        if self._refresh is not None:
            self._refresh()

    def take(self) -> Any:
        """Moves the current gradients aside (the pass then starts from none); returns
        what ``put`` gives back."""
        saved = [h.grad for h in self.holders]
        for holder in self.holders:
            holder.grad = None
        self._changed()
        return saved

    def read(self) -> list[torch.Tensor | None]:
        """What the pass since ``take`` reduced, per holder (``None``: nothing)."""
        return [h.grad for h in self.holders]

    def put(self, saved: Any) -> None:
        for holder, grad in zip(self.holders, saved):
            holder.grad = grad
        self._changed()

    def add(self, values: list[torch.Tensor | None]) -> None:
        """Adds ``values`` to the gradients (sets them where there are none)."""
        for holder, value in zip(self.holders, values):
            if value is None:
                continue
            if holder.grad is None:
                holder.grad = value.detach().clone()
            else:
                holder.grad.add_(value.detach())
        self._changed()


@dataclasses.dataclass
class LossGrads:
    """The reduced, sharded gradients of one loss (``block.grads(loss)``).

    ``values[i]`` is what the pass would have added to the ``i``-th gradient the
    optimizer steps on (``slots.holders[i].grad``: a DTensor for FSDP2, a flat shard
    for FSDP1; a ZeRO-3 partition), or ``None`` where the loss does not depend on it.
    """

    slots: GradSlots
    values: list[torch.Tensor | None]

    @property
    def group(self) -> Any:
        return self.slots.group

    @property
    def sharded(self) -> bool:
        return self.slots.sharded

    def locals(self) -> list[torch.Tensor | None]:
        return [None if v is None else _local(v) for v in self.values]

    def dot(self, other: LossGrads) -> torch.Tensor:
        """``<self, other>`` over the whole model, the same on every rank (one all-reduce)."""
        return gramian([self, other])[0, 1]

    def norm(self) -> torch.Tensor:
        """The gradient's L2 norm over the whole model (one all-reduce)."""
        return gramian([self])[0, 0].sqrt()


def _local(value: torch.Tensor) -> torch.Tensor:
    to_local = getattr(value, "to_local", None)
    return to_local() if callable(to_local) else value


def _check_same(grads: Sequence[LossGrads]) -> LossGrads:
    if not grads:
        raise ValueError("expected at least one LossGrads (from block.grads(loss))")
    first = grads[0]
    for g in grads[1:]:
        if g.slots is not first.slots and (len(g.slots.holders) != len(first.slots.holders) or any(
            a is not b for a, b in zip(g.slots.holders, first.slots.holders)
        )):
            raise ValueError(
                "LossGrads from different models or blocks: combine the gradients "
                "block.grads() returned for one model"
            )
    return first


def gramian(grads: Sequence[LossGrads]) -> torch.Tensor:
    """The k x k Gramian ``G[i, j] = <g_i, g_j>`` over the whole model (float64, on
    the gradients' device), the same on every rank: one all-reduce of the k x k
    local block (see [Note: per-loss gradients])."""
    first = _check_same(grads)
    k = len(grads)
    device = next(
        (v.device for g in grads for v in g.locals() if v is not None), torch.device("cpu")
    )
    local = torch.zeros(k, k, dtype=torch.float64, device=device)
    per_loss = [g.locals() for g in grads]
    for rows in zip(*per_loss):
        present = [(i, r) for i, r in enumerate(rows) if r is not None]
        if not present:
            continue
        matrix = torch.stack([r.reshape(-1).to(torch.float64) for _, r in present])
        block = matrix @ matrix.T
        idx = torch.tensor([i for i, _ in present], device=device)
        local[idx[:, None], idx[None, :]] += block
    if first.sharded and dist.is_initialized():
        dist.all_reduce(local, group=first.group)
    return local


def combine(grads: Sequence[LossGrads], weights) -> LossGrads:
    """``sum_i weights[i] * grads[i]``, shard by shard (no communication)."""
    first = _check_same(grads)
    weights = [float(w) for w in torch.as_tensor(weights).reshape(-1).tolist()]
    if len(weights) != len(grads):
        raise ValueError(f"got {len(weights)} weights for {len(grads)} gradients")
    values: list[torch.Tensor | None] = []
    for index in range(len(first.values)):
        total = None
        for w, g in zip(weights, grads):
            value = g.values[index]
            if value is not None:
                total = value * w if total is None else total + value * w
        values.append(total)
    return dataclasses.replace(first, values=values)


def apply_grads(grads: LossGrads) -> None:
    """Adds ``grads`` to ``.grad`` (sets it where it is ``None``): what the optimizer
    steps on (ZeRO-3: its gradient partitions)."""
    grads.slots.add(grads.values)
