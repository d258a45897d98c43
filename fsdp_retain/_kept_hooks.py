"""Hooks installed once per model and switched by the block that runs.

[Note: hooks kept on the model]
A block needs a hook on each module with parameters of its own (a probe pass's
targets; on ZeRO-0 to 3 also one on every module, the sources, and on ZeRO-3 the
guard on each module's outputs and the recording of the engine's). Installing them at every
block entry and removing them at every exit costs host time per unit per block: for
DDP about as much as the rest of the block together (``scripts/bench_host_cost.py``).
Which passes write a gradient the block learns from the pass's ``AccumulateGrad`` nodes
(``ParamNodes`` in ``_pass_start.py``, also held per model), not from a hook on each
parameter, which would cost a Python call per parameter per pass.
So a backend installs them once per model, in a ``KeptHooks`` record kept on the model,
and each hook calls the running block, or returns at once when no block runs (one
Python call per unit outside a block). What a hook calls (a bound method of the block,
one per kind of hook) is looked up when the block is set, not at every module call, where
a hook runs. The record is built again, its old hooks removed, when what it hooked
changed: the module tree or a module compiled in place (``tree_signature``, a walk
without hooks or generators), or the backend's own key (DDP: its parameters and their
``requires_grad``; ZeRO-3: which modules it hooks itself). The record does not travel
with a copy of the model (deepcopy, pickle): a copy builds its own at its first block. The
module hooks themselves do travel with ``copy.deepcopy`` (it copies a module's hook
dicts), so a hook acts only for the objects it was registered on, and does nothing on a
copy's. Used by the DDP and DeepSpeed ZeRO-0 to 3 backends; FSDP1 and FSDP2 still
install theirs at every entry (there a block is already cheaper than plain code:
``docs/host_cost.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn as nn

ATTR = "_fsdp_retain_hooks"


class KeptHooks:
    """The hooks kept on one model, and the block they call (``block``: ``None`` when
    none runs)."""

    __slots__ = ("_block", "handles", "key", "_cells")

    def __init__(self, key: Any = None) -> None:
        self._block: Any = None
        self.handles: list[Any] = []
        self.key = key
        # One cell per method: what it gives for the running block (``None``: no
        # block). Resolved when the block is set, not at each call.
        self._cells: dict[Callable[[Any], Callable[..., Any]], list[Any]] = {}

    @property
    def block(self) -> Any:
        return self._block

    @block.setter
    def block(self, block: Any) -> None:
        self._block = block
        for method, cell in self._cells.items():
            cell[0] = None if block is None else method(block)

    def add(self, obj: Any, register: Callable[[Callable[..., Any]], Any],
            method: Callable[[Any], Callable[..., Any]]) -> None:
        """Registers on ``obj`` (a module or a parameter, passed to the hook first) a
        hook that runs ``method(block)(obj, ...)`` while a block runs. A copy of the
        model (``copy.deepcopy``, ``copy.copy``) may carry the hook: it does nothing
        there. Torch calls a module hook with positional arguments only."""
        cell = self._cells.get(method)
        if cell is None:
            cell = self._cells[method] = [None if self._block is None else method(self._block)]
        owner = id(obj)

        def hook(target: Any, *args: Any) -> Any:
            call = cell[0]
            if call is None or id(target) != owner:
                return None
            return call(target, *args)

        self.handles.append(register(hook))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for cell in self._cells.values():
            cell[0] = None
        self._cells.clear()

    def __deepcopy__(self, memo: dict) -> KeptHooks:
        return KeptHooks()

    def __reduce__(self) -> tuple:
        return (KeptHooks, ())


def kept_hooks(owner: Any, key: Any, install: Callable[[KeptHooks], None]) -> KeptHooks:
    """The record kept on ``owner`` (the wrapper the block is given), built
    (``install`` adds its hooks) unless one with ``key`` is there; see
    [Note: hooks kept on the model]."""
    record = owner.__dict__.get(ATTR)
    if isinstance(record, KeptHooks) and record.key is not None and record.key == key:
        return record
    if isinstance(record, KeptHooks):
        record.remove()
    record = KeptHooks()
    try:
        install(record)
    except BaseException:
        record.remove()
        raise
    record.key = key
    owner.__dict__[ATTR] = record
    return record


def tree_signature(root: nn.Module) -> tuple:
    """The modules under ``root`` (the objects, not their ids, which a new module may
    reuse), each followed by whether it is compiled in place, in walk order. It runs at
    every block entry: ``is_compiled_in_place`` inline, one flat tuple."""
    out: list[Any] = []
    stack: list[Any] = [root]
    pop, extend, append = stack.pop, stack.extend, out.append
    while stack:
        module = pop()
        if module is None:
            continue
        append(module)
        append(getattr(module, "_compiled_call_impl", None) is not None)
        extend(module._modules.values())
    return tuple(out)
