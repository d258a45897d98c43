"""FSDP1 gradient bookkeeping of the block (private FSDP1 access).

Part of the FSDP1 backend with ``_block.py``: what the block does to the
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

from .._common import warn_once
from ._compat import internals
from ._units import Unit


@dataclasses.dataclass
class _Sentinel:
    """The ``.grad`` tensors a unit showed at the end of a pass (see ``record_sentinels``)."""

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


def saved_grad_shard(flat_param: Any) -> Any:
    """FSDP1's ``_saved_grad_shard`` (a reduced ``.grad`` its pre-backward moved aside), or
    ``_MISSING``; ``put_saved_grad_shard`` puts it back."""
    return flat_param.__dict__.get("_saved_grad_shard", _MISSING)


def put_saved_grad_shard(flat_param: Any, saved: Any) -> None:
    if saved is _MISSING:
        flat_param.__dict__.pop("_saved_grad_shard", None)
    else:
        flat_param._saved_grad_shard = saved


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
                saved_grad_shard(flat_param),
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
            now = saved_grad_shard(flat_param)
            if flat_param.grad is grad and now is saved:
                continue
            # prepare_gradient_for_backward() moved a reduced .grad aside.
            flat_param.grad = grad
            put_saved_grad_shard(flat_param, saved)
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

    def watch_zero_grad(self, held_back: bool) -> None:
        """After a pass: sentinels where the next pass accumulates onto gradients held
        back (``held_back``: ``sync_grads="last"`` before the last pass), else none."""
        if held_back:
            self.record_sentinels()
        else:
            self.forget_sentinels()

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

