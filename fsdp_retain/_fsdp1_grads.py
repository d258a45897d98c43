"""FSDP1 gradient bookkeeping of the block (private FSDP1 access).

Part of the FSDP1 backend with ``_fsdp1.py``: what the block does to the
gradients FSDP1 holds. ``GradLedger`` keeps its per-unit state on each
``Unit`` (``grads_before``, ``accumulating``, ``sentinel``).

- A pass that accumulates nothing into a unit (``autograd.grad``, a probe
  pass, a pass that never reaches the unit after its pre-backward ran) gets
  back what FSDP's pre-backward moved aside (``_restore_grads``); FSDP's final
  callback would otherwise drop a reduced ``.grad`` it finds in
  ``_saved_grad_shard`` with no new gradient.
- ``sync_grads="last"``: gradients held back are reduced at the block exit
  with FSDP's own post-backward path (``_flush_gradients``), and a
  ``zero_grad()`` between passes is applied to them and to the gradients FSDP
  holds aside from before the block (the sentinels).
- On an exception, unreduced gradients are dropped (``_drop_unreduced``).

The block tells the ledger what it cannot see itself: whether a probe pass
runs, whether the last pass has started (``freeing``), and which units FSDP1
accumulated into in the pass (``PostBackwardCheck.accumulated``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ._common import warn_once
from ._fsdp1_compat import internals
from ._fsdp1_units import Unit
from ._grad_layout import Layout, Segment, Selection, clean_name
from ._loss_grads import GradSlots


@dataclasses.dataclass
class _Sentinel:
    """The ``.grad`` tensors a unit showed at the end of a pass (see ``_record_sentinels``)."""

    flat_grad: torch.Tensor | None
    version: int
    param_grads: tuple[torch.Tensor | None, ...]
    param_versions: tuple[int, ...]

    def changed_in_place(self) -> bool:
        # FSDP's unsharded gradient views (``no_sync``) do not share the flat
        # gradient's version counter, so look at both.
        return _version(self.flat_grad) != self.version or any(
            _version(g) != v for g, v in zip(self.param_grads, self.param_versions)
        )


_MISSING = object()


def _version(t: torch.Tensor | None) -> int:
    return -1 if t is None else t._version


def _warn_in_place() -> None:
    warn_once(
        "fsdp_retain: with sync_grads='last', FSDP1 keeps gradients from before the "
        "block apart from .grad (in _saved_grad_shard); an in-place change of .grad "
        "between passes reaches them only where it zeroes a whole parameter.",
    )


class GradLedger:
    """The gradients the block holds or puts back per unit (see the module docstring)."""

    def __init__(self, model: Any, units: list[Unit], states: list[Any]) -> None:
        self.model = model
        self.units = units
        self.states = states
        self._fsdp = internals()
        self._phase = self._fsdp.HandleTrainingState

    def snapshot(self) -> None:
        """Each unit's (``.grad``, ``_saved_grad_shard``) before a pass."""
        for unit in self.units:
            flat_param = unit.flat_param
            unit.grads_before = (
                flat_param.grad,
                flat_param.__dict__.get("_saved_grad_shard", _MISSING),
            )
            unit.accumulating = True

    def forget_snapshot(self) -> None:
        for unit in self.units:
            unit.grads_before = None

    def restore(self, accumulated: set[Unit], probing: bool) -> None:
        """Undoes what FSDP's pre-backward did to the gradients of units the
        pass accumulated nothing into (its final callback would drop them)."""
        for unit in self.units:
            before, unit.grads_before = unit.grads_before, None
            if before is None:
                continue
            grad, saved = before
            if unit in accumulated and not probing:
                continue  # accumulated (also in a reentrant-checkpointing recompute)
            handle, flat_param = unit.handle, unit.flat_param
            if handle._use_orig_params and not handle.uses_sharded_strategy:
                # NO_SHARD: the catch-all reshard takes the unit for resharded
                # (pytorch/pytorch#83956), so put back the parameter views that
                # the post-backward hook would have.
                self._fsdp.reshard(unit.state, handle, False)
                if flat_param.grad is not None:
                    handle._use_sharded_grad_views()
            now = flat_param.__dict__.get("_saved_grad_shard", _MISSING)
            if flat_param.grad is grad and now is saved:
                continue
            # prepare_gradient_for_backward() moved a reduced .grad aside.
            flat_param.grad = grad
            if saved is _MISSING:
                flat_param.__dict__.pop("_saved_grad_shard", None)
            else:
                flat_param._saved_grad_shard = saved
            if handle._use_orig_params:
                handle._use_sharded_grad_views()

    def note_selection(self) -> None:
        """At a pass start: the original parameters the pass's ``inputs`` leave
        out of units it accumulates into (see [Note: inputs that name parameters])."""
        for unit in self.units:
            if not unit.accumulating:
                continue
            if unit.selected is None:
                unit.unnamed_none.clear()
                continue
            params = unit.flat_param._params or ()
            unit.unnamed_none |= {
                i for i, p in enumerate(params) if i not in unit.selected and p.grad is None
            }
            unit.unnamed_none -= unit.selected

    def clear_unnamed(self) -> None:
        """``None`` again as the ``.grad`` of parameters that only passes not naming
        them reached: FSDP1 shows the zeros of the unit's flat gradient there."""
        for unit in self.units:
            params = unit.flat_param._params or ()
            for index in unit.unnamed_none:
                params[index].grad = None

    @staticmethod
    def drop_unreduced(unit: Unit, pending_local: bool) -> None:
        handle, flat_param = unit.handle, unit.flat_param
        grad = flat_param.grad
        if handle.uses_sharded_strategy:
            if grad is not None and grad.shape != flat_param._sharded_size:
                grad = None
            saved = flat_param.__dict__.pop("_saved_grad_shard", None)
            if grad is None:
                grad = saved
        elif pending_local:
            grad = None  # NO_SHARD: reduced and local gradients share one tensor
        flat_param.grad = grad
        if handle._use_orig_params:
            handle._use_sharded_grad_views()

    def has_unreduced(self) -> bool:
        return any(_has_unreduced(u) for u in self.units)

    def flush(self) -> None:
        """Reduces the held-back gradients with FSDP's own post-backward path."""
        fsdp = self._fsdp
        for state in self.states:
            state.training_state = fsdp.TrainingState.FORWARD_BACKWARD
        for unit in self.units:
            # No pass follows (``rearm`` set this for a next one): FSDP's hook
            # must not prefetch a unit (BackwardPrefetch.BACKWARD_POST), which
            # would all-gather it for nothing and, with use_orig_params=True,
            # read the views that the hook dropped for a unit flushed before.
            unit.handle._needs_pre_backward_unshard = False
        for unit in self.units:
            flat_param = unit.flat_param
            if _has_unreduced(unit):
                unit.handle._training_state = self._phase.BACKWARD_PRE
                fsdp.post_backward_hook(unit.state, unit.handle, flat_param)
            elif not hasattr(flat_param, "_saved_grad_shard"):
                # Nothing to hand to .grad (e.g. dropped by zero_grad()).
                flat_param._post_backward_called = False
        fsdp.post_backward_final_callback(self.model, self.model)

    def record_sentinels(self) -> None:
        """Remembers the ``.grad`` each unit shows, to apply a ``zero_grad()`` later.

        With ``sync_grads="last"`` the gradients of earlier passes are local
        unsharded tensors in ``.grad`` (as in ``no_sync()``), while gradients
        from before the block sit aside in ``_saved_grad_shard``. FSDP alone
        would keep those, and with ``use_orig_params=True`` it zeroes a
        cleared parameter's gradient at its *sharded* offset in the unsharded
        gradient (``_writeback_orig_params``), i.e. the wrong elements.
        """
        for unit in self.units:
            unit.sentinel = None
            handle, flat_param = unit.handle, unit.flat_param
            params = tuple(flat_param._params or ()) if handle._use_orig_params else ()
            grads = tuple(p.grad for p in params)
            if flat_param.grad is None and all(g is None for g in grads):
                continue
            unit.sentinel = _Sentinel(
                flat_param.grad,
                _version(flat_param.grad),
                grads,
                tuple(_version(g) for g in grads),
            )

    def forget_sentinels(self) -> None:
        for unit in self.units:
            unit.sentinel = None

    def has_sentinels(self) -> bool:
        return any(u.sentinel is not None for u in self.units)

    def check_sentinels(self) -> None:
        for unit in self.units:
            self.check_sentinel(unit)

    def pre_unshard(self, unit: Unit, original) -> bool:
        # Before FSDP's gradient writeback in the pre-backward unshard.
        if unit.handle._training_state == self._phase.BACKWARD_PRE:
            self.check_sentinel(unit)
        return original()

    def check_sentinel(self, unit: Unit) -> None:
        sentinel, unit.sentinel = unit.sentinel, None
        if sentinel is None:
            return
        handle, flat_param = unit.handle, unit.flat_param
        if not handle._use_orig_params:
            grad = flat_param.grad
            if not hasattr(flat_param, "_saved_grad_shard"):
                return
            if grad is not sentinel.flat_grad:
                del flat_param._saved_grad_shard  # set to None or replaced
            elif sentinel.changed_in_place():
                if not grad.any():
                    del flat_param._saved_grad_shard  # zeroed in place
                else:
                    _warn_in_place()
            return
        params = flat_param._params
        if all(p.grad is None for p in params):
            flat_param.grad = None
            flat_param.__dict__.pop("_saved_grad_shard", None)
            return
        cleared = [
            i
            for i, (param, old) in enumerate(zip(params, sentinel.param_grads))
            if old is not None and param.grad is None
        ]
        if cleared:
            for i in cleared:
                sentinel.param_grads[i].zero_()  # a view into the flat gradient
            # Show them again, so FSDP's writeback has nothing to "fix".
            handle._use_unsharded_grad_views()
        if not hasattr(flat_param, "_saved_grad_shard"):
            return
        if sentinel.changed_in_place():
            zeroed = {
                i
                for i, g in enumerate(sentinel.param_grads)
                if g is not None and not g.any()
            }
            cleared = sorted(set(cleared) | zeroed)
        _zero_saved_shard(handle, cleared)


def _has_unreduced(unit: Unit) -> bool:
    flat_param = unit.flat_param
    return flat_param.grad is not None and getattr(flat_param, "_post_backward_called", False)


def _zero_saved_shard(handle: Any, indices: list[int]) -> None:
    flat_param = handle.flat_param
    saved = flat_param._saved_grad_shard
    for i in indices:
        info = flat_param._shard_param_infos[i]
        if info.in_shard:
            offset = info.offset_in_shard
            saved[offset : offset + info.numel_in_shard].zero_()


# Per-loss gradients: see [Note: per-loss gradients] in _loss_grads.py #
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
