"""FSDP1 parameters named in a pass's ``inputs``: the backend's part of
[Note: inputs that name parameters] (``_inputs.py``).

Part of the FSDP1 backend with ``_block.py``. ``ParamIndex`` finds the unit of a
parameter the user holds (a flat parameter, an original parameter of
``use_orig_params=True``, a tied duplicate, a view a forward used), answers
what stands for it in the graph (the ``AccumulateGrad`` nodes the unit's
forwards made), and restricts a pass to the named parameters of each unit
(``select``; what their ``.grad`` shows after the pass: ``GradLedger``'s
``note_selection`` and ``clear_unnamed``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.graph import GradientEdge

from ._compat import acc_grad_node, orig_params, param_segments, storage_ptrs
from ._units import Unit
from .._inputs import ParamLookup


class ParamIndex(ParamLookup):
    """Which unit each parameter the user holds belongs to (built at first use)."""

    def __init__(self, units: list[Unit]) -> None:
        self._units = units  # the block's list, filled at install
        self._params: dict[int, tuple[Unit, int | None]] | None = None

    def find(self, tensor: torch.Tensor) -> tuple[Unit, int | None] | None:
        """The unit of ``tensor`` and its index there (``None``: the flat parameter)."""
        if self._params is None:
            self._params = {}
            for unit in self._units:
                self._params[id(unit.flat_param)] = (unit, None)
                for index, param in orig_params(unit.flat_param):
                    self._params[id(param)] = (unit, index)
        found = self._params.get(id(tensor))
        if found is not None:
            return found
        for unit in self._units:  # a view a forward used (use_orig_params)
            for index, view in enumerate(unit.forward_tensors or ()):
                if view is tensor:
                    return unit, index
        return None

    def graph_inputs(self, tensor: torch.Tensor) -> list[Any] | None:
        found = self.find(tensor)
        if found is None:
            return None
        unit = found[0]
        # The nodes this block's forwards made (a new one per forward under
        # parameter mixed precision; see _fsdp1_units), else the flat parameter.
        return [GradientEdge(node, 0) for node in unit.acc_grads] or [unit.flat_param]

    def storages(self) -> set[int]:
        ptrs = set().union(*(storage_ptrs(u.flat_param) for u in self._units))
        ptrs.discard(0)
        return ptrs

    def select(self, named: list[torch.Tensor]) -> list[Any]:
        """Marks each unit's named parameters (``Unit.selected``) and hooks its
        ``AccumulateGrad`` nodes to zero the others' parts; returns the handles."""
        chosen: dict[Unit, set[int]] = {}
        whole: set[Unit] = set()
        for tensor in named:
            found = self.find(tensor)
            assert found is not None, "a named parameter was mapped before"
            unit, index = found
            if index is None:
                whole.add(unit)
            else:
                chosen.setdefault(unit, set()).add(index)
        handles = []
        for unit, indices in chosen.items():
            if unit not in whole:
                unit.selected = indices
                handles.extend(_keep_only(unit, indices))
        return handles

    def forget_selection(self) -> None:
        for unit in self._units:
            unit.selected = None


def _keep_only(unit: Unit, indices: set[int]) -> list[Any]:
    """Hooks that zero, in each gradient the pass accumulates into ``unit``, the
    parts of parameters not in ``indices`` (FSDP1 keeps one gradient per unit)."""
    drop = [seg for i, seg in enumerate(param_segments(unit.flat_param)) if i not in indices]
    if not drop:
        return []

    def zero_others(grad_outputs: tuple) -> tuple:
        grad = grad_outputs[0].clone()
        for start, end in drop:
            grad[start:end] = 0
        return (grad,) + tuple(grad_outputs[1:])

    nodes = unit.acc_grads or [acc_grad_node(unit.flat_param)]
    return [node.register_prehook(zero_others) for node in nodes]
