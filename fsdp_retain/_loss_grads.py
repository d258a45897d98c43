"""Per-loss gradients under FSDP: one reduced, sharded gradient per loss.

[Note: per-loss gradients]
Gradient surgery (PCGrad), GradNorm and Jacobian descent (UPGrad, MGDA) combine
one gradient per loss before the step. ``block.grads(loss)`` is the sharded
counterpart of ``torch.autograd.grad(loss, model.parameters())``: one backward
pass of ``loss`` that FSDP reduces and shards as any pass inside the block (one
reduce-scatter per unit), whose gradients come back as a ``LossGrads`` instead of
adding to ``.grad``. ``.grad`` is left exactly as it was: the block moves it
aside for the pass (``_grad_holders``: FSDP2's sharded parameters, FSDP1's flat
parameters) and puts it back after.

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


@dataclasses.dataclass
class LossGrads:
    """The reduced, sharded gradients of one loss (``block.grads(loss)``).

    ``values[i]`` is what the pass would have added to ``holders[i].grad`` (a
    DTensor for FSDP2, a flat shard for FSDP1), or ``None`` where the loss does
    not depend on it. ``group`` is the process group whose ranks hold disjoint
    shards (``None``: every rank holds everything).
    """

    holders: list[torch.Tensor]
    values: list[torch.Tensor | None]
    group: Any
    sharded: bool
    refresh: Any = None  # the backend's after-.grad-changed callback

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
        if len(g.holders) != len(first.holders) or any(
            a is not b for a, b in zip(g.holders, first.holders)
        ):
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
    for index in range(len(first.holders)):
        rows = [g.locals()[index] for g in grads]
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
    for index in range(len(first.holders)):
        total = None
        for w, g in zip(weights, grads):
            value = g.values[index]
            if value is not None:
                total = value * w if total is None else total + value * w
        values.append(total)
    return dataclasses.replace(first, values=values)


def apply_grads(grads: LossGrads) -> None:
    """Adds ``grads`` to ``.grad`` (sets it where it is ``None``): what the optimizer steps on."""
    for holder, value in zip(grads.holders, grads.values):
        if value is None:
            continue
        if holder.grad is None:
            holder.grad = value.detach().clone()
        else:
            holder.grad.add_(value.detach())
    if grads.refresh is not None:
        grads.refresh()
