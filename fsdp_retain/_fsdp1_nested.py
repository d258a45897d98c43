"""What an FSDP1 block does for nested backward passes: see [Note: nested backward
passes] in ``_nested.py``.

Part of the FSDP1 backend with ``_fsdp1.py`` (private FSDP1 access). FSDP1 runs a
unit's post-backward hook, which reduce-scatters and frees, in each nested pass
that accumulates into the unit; its pre-forward gathers the unit again for the next
tile. While a span is open its units run as under ``no_sync()`` (``_sync_gradients``
off: the tiles' gradients accumulate unsharded) and are not freed
(``Unit.in_span``, read by ``should_free``); at the close the post-backward hook
runs once more, with the flags of the pass, for each unit whose backward ran.
"""

from __future__ import annotations

from typing import Any

from ._fsdp1_compat import internals
from ._fsdp1_units import Unit
from ._nested import Span

_MISSING = object()


class FSDP1Span(Span):
    """The nested passes of one node: units not inside their own backward."""

    def __init__(self, units: list[Unit], probing: bool) -> None:
        fsdp = internals()
        self._post = fsdp.HandleTrainingState.BACKWARD_POST
        self._hook = fsdp.post_backward_hook
        pre = fsdp.HandleTrainingState.BACKWARD_PRE
        # A unit inside its own backward in the outer pass: FSDP1 skips the pre-forward
        # of its tiles, and its post-backward hook there reduces what they added.
        self._units = [u for u in units if u.handle._training_state != pre]
        self._sync = [(u.state, u.state._sync_gradients) for u in self._units]
        for unit in self._units:
            unit.in_span = True
            unit.state._sync_gradients = False
        # A probe pass writes no parameter gradient: set aside what the units hold.
        self._stash = [_take_grad(u) for u in self._units] if probing else None

    def close(self) -> None:
        self._restore()
        if self._stash is not None:
            for unit, saved in zip(self._units, self._stash):
                _put_grad(unit, saved)
        for unit in self._units:
            handle = unit.handle
            if handle._training_state == self._post and not handle.needs_unshard():
                # Reduces (unless the pass holds back) and frees as the policy says.
                self._hook(unit.state, handle, unit.flat_param)

    def abort(self) -> None:
        self._restore()
        if self._stash is not None:
            for unit, saved in zip(self._units, self._stash):
                _put_grad(unit, saved)

    def _restore(self) -> None:
        for state, value in self._sync:
            state._sync_gradients = value
        self._sync = []
        for unit in self._units:
            unit.in_span = False


def _take_grad(unit: Unit) -> tuple[Any, Any]:
    flat_param = unit.flat_param
    saved = flat_param.grad, getattr(flat_param, "_saved_grad_shard", _MISSING)
    flat_param.grad = None
    return saved


def _put_grad(unit: Unit, saved: tuple[Any, Any]) -> None:
    flat_param = unit.flat_param
    grad, shard = saved
    flat_param.grad = grad
    if shard is _MISSING:
        if hasattr(flat_param, "_saved_grad_shard"):
            delattr(flat_param, "_saved_grad_shard")
    else:
        flat_param._saved_grad_shard = shard
