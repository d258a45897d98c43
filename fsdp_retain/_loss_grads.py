"""Per-loss gradients under FSDP: one reduced, sharded gradient per loss.

[Note: per-loss gradients]
Gradient surgery (PCGrad), GradNorm and Jacobian descent (UPGrad, MGDA) combine
one gradient per loss before the step. ``block.grads(loss)`` is the sharded
counterpart of ``torch.autograd.grad(loss, model.parameters())``: one backward
pass of ``loss`` that FSDP reduces and shards as any pass inside the block (one
reduce-scatter per unit), whose gradients come back as a ``LossGrads`` instead of
adding to ``.grad``. ``.grad`` is left exactly as it was: the block moves it
aside for the pass (``_make_grad_slots``: the ``.grad`` of FSDP2's sharded parameters,
of FSDP1's flat parameters and, with ``use_orig_params=True``, of its original
parameters; ZeRO-3's gradient partitions) and puts the same tensors back after.

What a ``LossGrads`` holds is each rank's shard (1/world of the model per loss;
never an unsharded copy). Reductions over the whole model need one collective:
``gramian(grads)`` sums each rank's k x k block of shard dot products and
all-reduces it once over the group the shards partition (a replicated copy, FSDP1
``NO_SHARD``, needs none), so any weighting written for one process (torchjd's
aggregators take a Gramian) runs unchanged on the k x k result, the same on every
rank. ``combine(grads, weights)`` is local; ``apply_grads`` adds the result to
``.grad`` for the optimizer, inside the block or after it (it writes through
whatever ``.grad`` holds then, e.g. after a ``zero_grad()``).

Every reduction covers the trainable parameters, or those a ``select`` names:
see [Note: which parameters a per-loss gradient covers] in ``_grad_layout.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ._grad_layout import Layout, Selection


class GradSlots:
    """Where a backend keeps the reduced gradients its optimizer steps on, and how
    ``block.grads`` moves them aside for its pass: here the ``.grad`` of ``holders``
    (FSDP2's sharded parameters). FSDP1 (``_fsdp1_grads.FlatGradSlots``) and ZeRO-3
    (``_deepspeed_grads.PartitionSlots``) subclass it. ``group``: the process group
    whose ranks hold disjoint shards; ``sharded`` False: every rank holds everything;
    ``layout``: which parameter each element of a holder's shard belongs to;
    ``weights``: per holder, 1 / the ranks of ``group`` that hold the same shard
    (tensor parallelism: ``group`` is then the default group), ``None``: all 1.
    """

    def __init__(self, holders: list[Any], group: Any, sharded: bool, layout: Layout,
                 weights: list[float] | None = None) -> None:
        self.holders = holders
        self.group = group
        self.sharded = sharded
        self.layout = layout
        self.weights = weights
        self.tracker: Any = None  # the block's PassTracker (set by block.grads)

    def weight(self, index: int) -> float:
        return 1.0 if self.weights is None else self.weights[index]

    def take(self) -> Any:
        """Moves the current gradients aside (the pass then starts from none); returns
        what ``put`` gives back."""
        saved = [h.grad for h in self.holders]
        for holder in self.holders:
            holder.grad = None
        return saved

    def read(self) -> list[torch.Tensor | None]:
        """What the pass since ``take`` reduced, per holder (``None``: nothing)."""
        return [h.grad for h in self.holders]

    def put(self, saved: Any) -> None:
        for holder, grad in zip(self.holders, saved):
            holder.grad = grad

    def add(self, values: list[torch.Tensor | None], selection: Selection) -> None:
        """Adds the ``selection`` of ``values`` to the gradients (sets them where
        there are none)."""
        for index, (holder, value) in enumerate(zip(self.holders, values)):
            if value is None or selection.ranges[index] is None:
                continue
            if selection.full[index]:
                if holder.grad is None:
                    holder.grad = value.detach().clone()
                else:
                    holder.grad.add_(value.detach())
                continue
            if holder.grad is None:
                holder.grad = torch.zeros_like(value)
            selection.mask_into(index, _local(holder.grad), _local(value))


@dataclasses.dataclass
class LossGrads:
    """The reduced, sharded gradients of one loss (``block.grads(loss)``).

    ``values[i]`` is what the pass would have added to the ``i``-th gradient the
    optimizer steps on (``slots.holders[i].grad``: a DTensor for FSDP2, a flat shard
    for FSDP1; a ZeRO-3 partition), or ``None`` where the loss does not depend on it.
    ``selection``: the parameters every reduction, ``combine`` and ``apply_grads``
    covers (the trainable ones unless ``select`` narrowed it).

    Example::

        g = block.grads(loss, retain_graph=True)
        trunk = g.select(model.trunk)              # a submodule, names or parameters
        heads = g.select(exclude=model.trunk)
        print(trunk.norm(), g.norms()["trunk.0.weight"])
    """

    slots: GradSlots
    values: list[torch.Tensor | None]
    selection: Selection = dataclasses.field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.selection is None:
            self.selection = self.slots.layout.default

    @property
    def group(self) -> Any:
        return self.slots.group

    @property
    def sharded(self) -> bool:
        return self.slots.sharded

    @property
    def names(self) -> tuple[str, ...]:
        """The parameters this covers (names as in the model's state dict)."""
        return self.selection.names

    def locals(self) -> list[torch.Tensor | None]:
        return [None if v is None else _local(v) for v in self.values]

    def select(self, params: Any = None, *, exclude: Any = None) -> LossGrads:
        """The same gradients over fewer parameters: those ``params`` names (a
        submodule, parameter names, a module's name, or the wrapped model's
        parameters), less those ``exclude`` names. No communication, no copy."""
        layout = self.slots.layout
        keep = set(self.names)
        if params is not None:
            keep &= set(layout.resolve(params).names)
        if exclude is not None:
            keep -= set(layout.resolve(exclude).names)
        if not keep:
            raise ValueError(
                "the selection covers no trainable parameter: check params= and exclude= "
                f"against the names this covers (e.g. {', '.join(self.names[:3])})"
            )
        return dataclasses.replace(self, selection=layout.selection(keep))

    def dot(self, other: LossGrads) -> torch.Tensor:
        """``<self, other>`` over the covered parameters, the same on every rank (one all-reduce)."""
        return gramian([self, other])[0, 1]

    def norm(self) -> torch.Tensor:
        """The gradient's L2 norm over the covered parameters (one all-reduce)."""
        return gramian([self])[0, 0].sqrt()

    def norms(self) -> dict[str, torch.Tensor]:
        """Each covered parameter's gradient norm by name (float64), the same on
        every rank: one all-reduce for all of them (for logging per layer)."""
        layout, wanted = self.slots.layout, set(self.names)
        names: list[str] = []
        sums: list[torch.Tensor] = []
        device = _device([self])
        for index, (holder, value) in enumerate(zip(layout.segments, self.locals())):
            flat = None if value is None else value.reshape(-1)
            for seg in holder:
                if seg.name not in wanted:
                    continue
                names.append(seg.name)
                if flat is None or seg.stop <= seg.start:
                    sums.append(torch.zeros((), dtype=torch.float64, device=device))
                else:
                    piece = flat[seg.start : seg.stop].to(torch.float64)
                    sums.append(piece.pow(2).sum() * self.slots.weight(index))
        total = torch.stack(sums) if sums else torch.zeros(0, dtype=torch.float64, device=device)
        if self.sharded and dist.is_initialized():
            dist.all_reduce(total, group=self.group)
        return dict(zip(names, total.sqrt().unbind()))


def _local(value: torch.Tensor) -> torch.Tensor:
    to_local = getattr(value, "to_local", None)
    return to_local() if callable(to_local) else value


def _device(grads: Sequence[LossGrads]) -> torch.device:
    return next(
        (v.device for g in grads for v in g.locals() if v is not None), torch.device("cpu")
    )


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
        if g.selection != first.selection:
            raise ValueError(
                "LossGrads over different parameters (one was select()-ed differently): "
                "select the same parameters on each, e.g. [g.select(model.trunk) for g in grads]"
            )
    return first


def gramian(grads: Sequence[LossGrads]) -> torch.Tensor:
    """The k x k Gramian ``G[i, j] = <g_i, g_j>`` over the parameters the gradients
    cover (float64, on the gradients' device), the same on every rank: one
    all-reduce of the k x k local block (see [Note: per-loss gradients])."""
    first = _check_same(grads)
    selection = first.selection
    k = len(grads)
    device = _device(grads)
    local = torch.zeros(k, k, dtype=torch.float64, device=device)
    per_loss = [g.locals() for g in grads]
    for index, rows in enumerate(zip(*per_loss)):
        present = [(i, r) for i, r in enumerate(rows) if r is not None]
        if not present or selection.ranges[index] is None:
            continue
        matrix = torch.stack(
            [selection.pieces(index, r).to(torch.float64) for _, r in present]  # type: ignore[union-attr]
        )
        block = (matrix @ matrix.T) * first.slots.weight(index)
        idx = torch.tensor([i for i, _ in present], device=device)
        local[idx[:, None], idx[None, :]] += block
    if first.sharded and dist.is_initialized():
        dist.all_reduce(local, group=first.group)
    return local


def combine(grads: Sequence[LossGrads], weights) -> LossGrads:
    """``sum_i weights[i] * grads[i]``, shard by shard (no communication), over the
    parameters the gradients cover."""
    first = _check_same(grads)
    weights = [float(w) for w in torch.as_tensor(weights).reshape(-1).tolist()]
    if len(weights) != len(grads):
        raise ValueError(f"got {len(weights)} weights for {len(grads)} gradients")
    values: list[torch.Tensor | None] = []
    for index in range(len(first.values)):
        total = None
        if first.selection.ranges[index] is not None:
            for w, g in zip(weights, grads):
                value = g.values[index]
                if value is not None:
                    total = value * w if total is None else total + value * w
        values.append(total)
    return dataclasses.replace(first, values=values)


def apply_grads(grads: LossGrads) -> None:
    """Adds ``grads`` to ``.grad`` (sets it where it is ``None``) over the parameters
    it covers: what the optimizer steps on (ZeRO-3: its gradient partitions). Inside
    the block or after it."""
    grads.slots.add(grads.values, grads.selection)
    if grads.slots.tracker is not None:
        grads.slots.tracker.wrote = True
