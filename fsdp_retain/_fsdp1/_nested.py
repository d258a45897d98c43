"""What an FSDP1 block does for nested backward passes: see [Note: nested backward
passes] in ``_nested.py``.

Part of the FSDP1 backend with ``_block.py`` (private FSDP1 access). FSDP1 runs a
unit's post-backward hook, which reduce-scatters and frees, in each nested pass
that accumulates into the unit; its pre-forward gathers the unit again for the next
tile. While a span is open its units run as under ``no_sync()`` (``_sync_gradients``
off: the tiles' gradients accumulate unsharded) and are not freed
(``Unit.in_span``: ``reshard`` in ``_fsdp1_mechanics`` leaves them as they are); at the close the post-backward hook
runs once more, with the flags of the pass, for each unit whose backward ran. FSDP1's
hook may run several times in one backward (it reduces into ``_saved_grad_shard``), so
a unit whose outer backward goes on after the span reduces again later.
"""

from __future__ import annotations

from typing import Any

from ._compat import internals
from ._grads import put_saved_grad_shard, saved_grad_shard
from ._units import Unit
from .._nested import Span



class FSDP1Span(Span):
    """The nested passes of one node: every sharded unit holds its reductions and stays
    gathered until the close (``NO_SHARD`` units are left to FSDP1)."""

    def __init__(self, units: list[Unit], probing: bool) -> None:
        fsdp = internals()
        self._post = fsdp.HandleTrainingState.BACKWARD_POST
        self._hook = fsdp.post_backward_hook
        pre = fsdp.HandleTrainingState.BACKWARD_PRE
        # A probe pass writes no parameter gradient: what every unit holds, to put back.
        self._all = units
        self._stash = [_keep_grad(u) for u in units] if probing else None
        # NO_SHARD frees and gathers nothing: its hook all-reduces per nested pass, as
        # without the block (its flat parameter's views are re-pointed by each reshard).
        units = [u for u in units if u.handle.uses_sharded_strategy]
        self._units = units
        # Inside its own backward in the outer pass (the tiling inside the unit's
        # forward): it may run backward after the close, then its own hook reduces;
        # else the end of the pass does.
        self._inside = {id(u) for u in units if u.handle._training_state == pre}
        self._sync = [(u.state, u.state._sync_gradients) for u in units]
        for unit in units:
            unit.in_span = True
            unit.state._sync_gradients = False

    def close(self) -> None:
        self._restore()
        for unit in self._units:
            if id(unit) not in self._inside:
                self._reduce(unit)

    def end_of_pass(self) -> None:
        for unit in self._units:
            if id(unit) in self._inside:
                self._reduce(unit)  # unless its own hook did since the close

    def _reduce(self, unit: Unit) -> None:
        """FSDP1's post-backward hook for ``unit`` if the span left it a gradient: it
        reduces (unless the pass holds back) and frees as the policy says."""
        handle = unit.handle
        if (handle._training_state == self._post and unit.flat_param.grad is not None
                and not handle.needs_unshard()):
            self._hook(unit.state, handle, unit.flat_param)

    def abort(self) -> None:
        self._restore()

    def _restore(self) -> None:
        for state, value in self._sync:
            state._sync_gradients = value
        self._sync = []
        for unit in self._units:
            unit.in_span = False
        if self._stash is not None:
            for unit, saved in zip(self._all, self._stash):
                _put_grad(unit, saved)
            self._stash = None


def _keep_grad(unit: Unit) -> tuple[Any, Any, Any]:
    """``.grad``, a copy of its values (the tiles may add to it in place) and
    ``_saved_grad_shard`` (FSDP1's pre-backward moves a reduced ``.grad`` there)."""
    flat_param = unit.flat_param
    grad = flat_param.grad
    values = None if grad is None else grad.detach().clone()
    return grad, values, saved_grad_shard(flat_param)


def _put_grad(unit: Unit, saved: tuple[Any, Any, Any]) -> None:
    """What ``_keep_grad`` kept; a ``.grad`` that was ``None``, or that FSDP1's
    pre-backward moved into ``_saved_grad_shard``, the probe's end puts back
    (``GradLedger.restore``)."""
    flat_param = unit.flat_param
    grad, values, shard = saved
    if grad is not None:
        grad.detach().copy_(values)
    if flat_param.grad is not grad:  # a unit the tiles ran through: unsharded now
        if grad is not None and grad.shape != flat_param.shape:
            flat_param.grad = None  # a reduced shard, moved aside
            return
        flat_param.grad = grad
    put_saved_grad_shard(flat_param, shard)
