"""What the ZeRO-3 block keeps gathered between passes and how it lets go (part of the
DeepSpeed backend with ``_block.py``: see its module docstring, ``keep_unsharded``).

``keep_unsharded=True``: the parameter coordinator's per-parameter release is a no-op
from the block's entry to its exit, so the forward's all-gathers serve every pass.
``False``: ZeRO-3's hooks fetch a module's parameters only while
``applied_pre_backward_ref_cnt > 0`` and release them when ``ds_grads_remaining`` reaches
0; the forward sets both and the first pass uses them up, so they are recorded at the
start of pass 1 and put back at the start of every later pass. At the exit every
gathered parameter is released locally and the counters are zeroed.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from .._common import require_attr

RELEASE = "_PartitionedParameterCoordinator__release_param"
_COUNTERS = ("applied_pre_backward_ref_cnt", "ds_grads_remaining")


class Gathered:
    """The coordinator's release and the modules' hook counters for one block."""

    def __init__(self, coordinator: Any, keeps_all: bool) -> None:
        self.coordinator = coordinator
        self.keeps_all = keeps_all
        self._release: Any = None  # the coordinator's own
        self._saved: dict[nn.Module, tuple[int, ...]] = {}

    def install(self, flavour: str) -> None:
        self._release = require_attr(self.coordinator, RELEASE, flavour)
        if self.keeps_all:
            setattr(self.coordinator, RELEASE, _keep_gathered)

    def uninstall(self) -> None:
        self.coordinator.__dict__.pop(RELEASE, None)

    def rearm(self, root: nn.Module, first: bool) -> None:
        """``keep_unsharded=False``: pass 1 records the counters, later passes get them back."""
        if first:
            self._saved = {m: tuple(getattr(m, name, 0) for name in _COUNTERS)
                           for m in root.modules() if "pre_bwd_fn" in m.__dict__}
            return
        for module, values in self._saved.items():
            for name, value in zip(_COUNTERS, values):
                setattr(module, name, value)

    def release_all(self, params: list[Any]) -> None:
        """Frees every gathered parameter locally and zeroes ZeRO-3's hook counters."""
        self.uninstall()
        self.coordinator.release_backward_leftovers()
        for param in params:
            if getattr(param, "ds_persist", False):
                continue
            param.ds_active_sub_modules.clear()
            self._release(param)
        for module in self._saved:
            for name in _COUNTERS:
                setattr(module, name, 0)
        self._saved.clear()


def _keep_gathered(param: Any, free_data: bool = True) -> None:
    """Stands in for the coordinator's release while ``keep_unsharded=True``."""
