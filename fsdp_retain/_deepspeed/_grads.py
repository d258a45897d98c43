"""ZeRO-3's reduced gradients as ``block.grads`` sees them: its gradient partitions.

ZeRO-3 reduce-scatters each parameter's gradient into a partition of the optimizer
(``__param_id_to_grad_partition``, by ``ds_id``), copying over it in the first
micro-step after ``zero_grad`` (``micro_step_id == 0``) and adding to it after; the
parameters' ``.grad`` is dropped. The partitions hold this step's gradient once a
backward's epilogue ran (``_epilogue_ran_this_backward``) or a later micro-step
started; ``zero_grad()`` sets both back without touching the partitions. The step reads the partitions. So for
[Note: per-loss gradients] the slots are the partitions, and "moved aside" means:
their contents and the copy-or-add state put away, the pass run as a first
micro-step into zeroed partitions (its own gradient alone), then both put back.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .._grad_layout import Selection, per_param_layout
from .._loss_grads import GradSlots


@dataclasses.dataclass
class _Saved:
    partitions: list[torch.Tensor] | None  # None: they held nothing of this step
    micro_step_id: int
    epilogue_ran: bool
    writes_state: dict[str, Any]


class PartitionSlots(GradSlots):
    """``holders``: the parameters (for identity); the values are their partitions.

    ``writes`` is the block's ``PartitionWrites`` (``_zero3_reduce.py``): ``reduced``
    says whether a pass of the block wrote the partitions, ``bumped_micro_step`` whether
    it made ZeRO-3 add to them.
    """

    _WRITES_STATE = ("reduced", "bumped_micro_step")

    def __init__(self, writes: Any, root: Any, params: list[Any], group: Any) -> None:
        parts = [writes.partitions[p.ds_id] for p in params]
        layout = per_param_layout(root, params, [p.numel() for p in parts])
        super().__init__(params, group, True, layout)
        self._writes = writes
        self._opt = writes.opt
        self._parts = parts

    def _holds_step(self) -> bool:
        """Whether the partitions hold this step's gradient (else a past step's, or
        one a ``zero_grad()`` dropped: it sets both back, whoever reduced)."""
        return bool(self._opt.micro_step_id > 0 or self._opt._epilogue_ran_this_backward)

    def take(self) -> _Saved:
        saved = _Saved(
            [p.clone() for p in self._parts] if self._holds_step() else None,
            self._opt.micro_step_id,
            self._opt._epilogue_ran_this_backward,
            {name: getattr(self._writes, name) for name in self._WRITES_STATE},
        )
        for part in self._parts:
            part.zero_()
        self._opt.micro_step_id = 0
        self._writes.reduced = False
        self._writes.bumped_micro_step = False
        return saved

    def read(self) -> list[torch.Tensor | None]:
        return [p.clone() for p in self._parts]

    def put(self, saved: _Saved) -> None:
        for i, part in enumerate(self._parts):
            if saved.partitions is None:
                part.zero_()
            else:
                part.copy_(saved.partitions[i])
        self._opt.micro_step_id = saved.micro_step_id
        self._opt._epilogue_ran_this_backward = saved.epilogue_ran
        for name, value in saved.writes_state.items():
            setattr(self._writes, name, value)

    def add(self, values: list[torch.Tensor | None], selection: Selection) -> None:
        if not self._holds_step():
            for part in self._parts:
                part.zero_()
            # What a reducing pass leaves: later passes of the block add to these
            # (PartitionWrites._accumulate_into_partitions), as does a next micro-batch.
            self._writes.reduced = True
            self._opt._epilogue_ran_this_backward = True
        for index, (part, value) in enumerate(zip(self._parts, values)):
            if value is not None and selection.ranges[index] is not None:
                part.add_(value.detach().to(part.dtype).view(part.shape))
