"""FSDP1's gradient holders as ``block.grads`` sees them (private FSDP1 access).

Part of the FSDP1 backend with ``_block.py``; see [Note: per-loss gradients] in
``_loss_grads.py`` and [Note: which parameters a per-loss gradient covers] in
``_grad_layout.py``. ``FlatGradSlots``: where FSDP1 keeps the reduced gradients (each
unit's flat parameter and, with ``use_orig_params=True``, the original parameters'
``.grad`` views into it); ``flat_layout``: which original parameter each element of a
flat shard belongs to.
"""

from __future__ import annotations

from typing import Any

import torch

from ._units import Unit
from .._grad_layout import Layout, Segment, Selection, clean_name
from .._loss_grads import GradSlots


class FlatGradSlots(GradSlots):
    """FSDP1's gradient holders for ``block.grads``: each unit's flat parameter.

    With ``use_orig_params=True`` the optimizer steps on the original parameters'
    ``.grad`` (views into the flat gradient that FSDP reconciles with it only in a
    sharded pre-forward or pre-backward), and that is where the user changes them
    (``zero_grad()``, with either ``set_to_none``). So ``take``/``put`` move aside
    and put back those tensors themselves, and ``add`` first takes what they hold
    into the flat gradient. It holds the handles, not the block: ``apply_grads``
    after the block exits works the same.
    """

    def __init__(self, handles: list[Any], group: Any, sharded: bool, layout: Layout) -> None:
        super().__init__([h.flat_param for h in handles], group, sharded, layout)
        self._handles = handles

    @classmethod
    def of_units(cls, model: Any, units: list[Unit]) -> FlatGradSlots:
        """The slots of a block's units: one sharding strategy and process group."""
        handles = [u.handle for u in units]
        sharded = {h.uses_sharded_strategy for h in handles}
        groups = {h.process_group for h in handles}
        if len(sharded) != 1 or len(groups) != 1:
            raise ValueError(
                "block.grads() needs every FSDP1 unit of one sharding strategy and "
                "process group: not supported yet for mixed units."
            )
        return cls(handles, groups.pop(), sharded.pop(), flat_layout(model, units))

    def take(self) -> list[tuple[Any, list[Any], list[bool] | None]]:
        saved = []
        for handle in self._handles:
            flat_param = handle.flat_param
            orig = _orig_params(handle)
            mask = flat_param._is_grad_none_mask if orig else None
            saved.append((flat_param.grad, [p.grad for p in orig], None if mask is None else list(mask)))
            flat_param.grad = None
            for param in orig:
                param.grad = None
        return saved

    def put(self, saved: list[tuple[Any, list[Any], list[bool] | None]]) -> None:
        for handle, (grad, orig_grads, mask) in zip(self._handles, saved):
            flat_param = handle.flat_param
            flat_param.grad = grad
            for param, orig_grad in zip(_orig_params(handle), orig_grads):
                _assign_grad(param, orig_grad)
            if mask is not None:
                flat_param._is_grad_none_mask[:] = mask

    def add(self, values: list[torch.Tensor | None], selection: Selection) -> None:
        for index, (handle, value) in enumerate(zip(self._handles, values)):
            if value is None or selection.ranges[index] is None:
                continue
            flat_param = handle.flat_param
            if not handle._use_orig_params:
                if flat_param.grad is None:
                    flat_param.grad = torch.zeros_like(value)
                selection.mask_into(index, flat_param.grad, value)
                continue
            grad, present = _grad_from_orig(handle, value)
            selection.mask_into(index, grad, value)
            flat_param.grad = grad
            covered = self.layout.segments[index]
            names = set(selection.names)
            for i, seg in enumerate(covered):
                if seg.name in names and seg.trainable:
                    present[i] = True
            flat_param._is_grad_none_mask[:] = [not p for p in present]
            handle._use_sharded_grad_views()


def _orig_params(handle: Any) -> list[Any]:
    if not handle._use_orig_params:
        return []
    flat_param = handle.flat_param
    return list(flat_param._params or ()) + list(flat_param._shared_params or ())


def _assign_grad(param: Any, grad: torch.Tensor | None) -> None:
    try:
        param.grad = grad
    except RuntimeError:
        # FSDP's own way for a gradient of another shape or dtype than the
        # parameter's current view (FSDP1 _use_sharded_grad_views).
        holder = torch.empty_like(param)
        holder.data = grad  # type: ignore[assignment]
        param.grad = holder


def _grad_from_orig(handle: Any, like: torch.Tensor) -> tuple[torch.Tensor, list[bool]]:
    """The flat gradient as the original parameters' ``.grad`` show it (what FSDP's
    ``_writeback_orig_params`` makes of them, also inside the block where FSDP
    skips it), and which of them have one."""
    flat_param = handle.flat_param
    grad = flat_param.grad
    if grad is None:
        grad = torch.zeros_like(like)
    present = []
    for param, info in zip(flat_param._params, flat_param._shard_param_infos):
        present.append(param.grad is not None)
        if not info.in_shard:
            continue
        start, numel = info.offset_in_shard, info.numel_in_shard
        section = grad[start : start + numel]
        if param.grad is None:
            section.zero_()
        elif param.grad.data_ptr() != section.data_ptr() or param.grad.dtype != section.dtype:
            section.copy_(param.grad.reshape(-1))
    return grad, present


def flat_layout(model: Any, units: list[Unit]) -> Layout:
    """The segments of each unit's flat parameter (see [Note: which parameters a
    per-loss gradient covers]): names from the FSDP1 root, frozen original
    parameters marked, tied ones as aliases."""
    prefixes = {id(m): clean_name(n) for n, m in model.named_modules()}
    segments, numels = [], []
    tensors: dict[int, tuple[str, ...]] = {}
    flat: set[int] = set()
    for unit in units:
        handle, flat_param = unit.handle, unit.flat_param
        prefix = prefixes[id(unit.state)]

        def full(name: str, prefix: str = prefix) -> str:
            return clean_name(f"{prefix}.{name}" if prefix else name)

        aliases: dict[tuple[int, str], list[str]] = {}
        for name, module, module_name, prim_name, prim_module, _ in flat_param._shared_param_infos:
            alias = f"{module_name}.{name}" if module_name else name
            aliases.setdefault((id(prim_module), prim_name), []).append(full(alias))
        holder = []
        for i, (fqn, info, (pname, module, _)) in enumerate(
            zip(flat_param._fqns, flat_param._shard_param_infos, flat_param._param_infos)
        ):
            trainable = (
                flat_param._params[i].requires_grad if handle._use_orig_params
                else flat_param.requires_grad
            )
            start = info.offset_in_shard if info.in_shard else 0
            stop = start + info.numel_in_shard if info.in_shard else 0
            holder.append(Segment(full(fqn), start, stop, trainable,
                                  tuple(aliases.get((id(module), pname), ()))))
        segments.append(holder)
        numels.append(flat_param._sharded_size.numel())
        if handle._use_orig_params:
            for param, seg in zip(flat_param._params, holder):
                tensors[id(param)] = seg.names()
            for param, info in zip(flat_param._shared_params or (), flat_param._shared_param_infos):
                name, _, module_name = info[0], info[1], info[2]
                tensors[id(param)] = (full(f"{module_name}.{name}" if module_name else name),)
        else:
            tensors[id(flat_param)] = tuple(n for seg in holder for n in seg.names())
            flat.add(id(flat_param))
    return Layout(model, segments, numels, tensors, flat)
