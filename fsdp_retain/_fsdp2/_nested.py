"""What an FSDP2 block does for nested backward passes: see [Note: nested backward
passes] in ``_nested.py``.

Part of the FSDP2 backend with ``_block.py`` (private FSDP2 access). FSDP2's
``post_backward`` is "idempotent and safe to call even when ... not used": the span
runs it once more at its close, for each group whose backward ran, with the flags of
the pass, so it reduces (or holds back) and reshards what the tiles accumulated.
"""

from __future__ import annotations

from typing import Any

from ._compat import clear_unsharded_grad, has_pending_grad, training_state_enum
from .._nested import Span

_HELD = {"reduce_grads": False, "all_reduce_grads": False, "reshard_after_backward": False}


class FSDP2Span(Span):
    """The nested passes of one node: groups not inside their own backward hold their
    reductions and stay gathered until the close."""

    def __init__(self, groups: list[Any], probing: bool) -> None:
        state = training_state_enum()
        self._post_backward = state.POST_BACKWARD
        self._groups = groups
        self._done = {id(g) for g in groups if g._training_state == state.POST_BACKWARD}
        # A group inside its own backward (PRE_BACKWARD) in the outer pass runs no
        # hooks for a nested pass: its own post-backward reduces what they add.
        self._held = [g for g in groups if g._training_state != state.PRE_BACKWARD]
        self._saved = [{name: getattr(g, name) for name in _HELD} for g in self._held]
        for group in self._held:
            for name, value in _HELD.items():
                setattr(group, name, value)
        # A probe pass writes no parameter gradient: set aside what the groups hold.
        self._stash = _take_grads(groups) if probing else None

    def close(self) -> None:
        self._restore_flags()
        if self._stash is not None:
            _drop_grads(self._groups)
        for group in self._groups:
            if group._training_state != self._post_backward:
                continue  # not reached yet: its own post-backward comes later
            if id(group) in self._done and not _pending(group):
                continue  # done before the span, nothing added since
            group.post_backward()
        if self._stash is not None:
            _put_grads(self._stash)

    def abort(self) -> None:
        self._restore_flags()
        if self._stash is not None:
            _drop_grads(self._groups)
            _put_grads(self._stash)

    def _restore_flags(self) -> None:
        for group, saved in zip(self._held, self._saved):
            for name, value in saved.items():
                setattr(group, name, value)
        self._held = []


def _pending(group: Any) -> bool:
    return any(has_pending_grad(fp) for fp in group.fsdp_params)


def _take_grads(groups: list[Any]) -> list[tuple[Any, Any, Any]]:
    stash = []
    for group in groups:
        for fsdp_param in group.fsdp_params:
            if has_pending_grad(fsdp_param):
                unsharded = fsdp_param._unsharded_param
                stash.append((fsdp_param, unsharded.grad, fsdp_param.unsharded_accumulated_grad))
                clear_unsharded_grad(fsdp_param)
    return stash


def _drop_grads(groups: list[Any]) -> None:
    for group in groups:
        for fsdp_param in group.fsdp_params:
            clear_unsharded_grad(fsdp_param)


def _put_grads(stash: list[tuple[Any, Any, Any]]) -> None:
    for fsdp_param, grad, accumulated in stash:
        fsdp_param._unsharded_param.grad = grad
        if accumulated is not None and accumulated is not grad:  # torch 2.15: an alias
            fsdp_param.unsharded_accumulated_grad = accumulated
