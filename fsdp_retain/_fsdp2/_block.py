"""FSDP2 (``fully_shard``) backend: the mechanics of a block on FSDP2.

Private FSDP2 access lives here and beside it: ``_compat.py`` (what
differs between torch versions, probed at install), ``_nodes.py`` (which
states a pass uses; what stands for a parameter named in ``inputs``),
``_reshard.py`` (the per-group flags, ``reshard_to``, which parameters the
modules show between passes), ``_grads.py`` (gradients held back by
``sync_grads="last"``; ``block.grads``' slots); ``_inspect.py`` holds readers for tests and the
report.

See [Note: why a retained graph needs unsharded storage] in ``_common.py``.

What the block does to FSDP2, per FSDP parameter group (one per unit):

- ``keep_unsharded=True``: ``post_forward_mesh_info=None`` (no reshard after
  forward) and ``reshard_after_backward=False``, so one all-gather per unit
  serves the forward and every backward. Between passes the modules show the
  sharded parameters again (``model.parameters()``, ``zero_grad()`` and
  ``clip_grad_norm_`` see the usual DTensors) while the unsharded storage
  stays alive for the graph.
- ``keep_unsharded=False``: ``reshard_after_backward=True``; FSDP2's own
  pre-backward hook re-gathers per unit on each pass. The backward prefetch
  order recorded by the forward is replayed on every pass.
- A byte budget (``keep_unsharded=<int>``): ``Policy.kept`` in ``_policy.py``
  picks the groups; kept groups get the ``True`` flags, the others the
  ``False`` ones (their re-gathers prefetched from the replayed order).
- ``reshard_to`` (or a model built with ``reshard_after_forward=<int>``): the
  groups not kept are resharded to groups of ranks between passes, see
  [Note: resharding to groups of ranks between passes] in ``_reshard.py``,
  which also sets the flags above.
- ``sync_grads="last"``: ``reduce_grads=False`` until the last pass (or the
  block exit), so unsharded gradients accumulate and are reduce-scattered once.
- Probe passes (see [Note: probe passes] in ``_common.py``): ``reduce_grads``
  and ``all_reduce_grads`` are ``False`` from the pass start to its end; the
  per-unit post-backward then only reshards (``keep_unsharded=False``) and
  leaves the accumulated unsharded gradients as they are. At its end the
  modules show the parameters they showed before it (see [Note: a probe pass
  leaves each group as it found it] in ``_reshard.py``).

Pass boundaries (see [Note: the block lifecycle] in ``_lifecycle.py``):
``_pass_start`` calls ``on_backward_start`` before the first node of every
backward. If the pass uses this model, the block registers FSDP2's root final
callback (what FSDP2's first pre-backward hook of a pass does), through its
own wrapper of that registration: the wrapper starts the pass and queues the
block's pass end right after FSDP2's callback. The wrapper also catches a pass
FSDP2's own hooks start where the block recorded nothing. With
``keep_unsharded=False`` the block also runs the pre-backward (the all-gather)
of units the pass uses but whose outputs it never reaches, e.g. when it starts
inside the unit.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn

from .. import _pass_start
from .._common import is_compiled_in_place, queue_callback, require_attr
from ._compat import (
    backward_order,
    FLAVOUR,
    GROUP_FLAGS,
    PASS_START_HOOK,
    check_installable,
    clear_unsharded_grad,
    param_groups,
    reset_iteration,
    run_root_final_callback,
    training_state_enum,
)
from ._grads import HeldGrads, fsdp2_grad_slots
from ._nested import FSDP2Span
from ._nodes import ForwardNodes, ParamLeaves
from ._reshard import BetweenPasses, ProbeRecord, ShownParams
from .._lifecycle import BlockBase
from .._loss_grads import GradSlots
from .._nested import Span
from .._policy import RetainOptions


_NOT_ROOT = (
    "no_reshard_between_backwards got a non-root FSDP2 unit ({}). Pass the root: the "
    "module fully_shard was applied to last, whose forward runs the others."
)
_NOT_ROOT_AT_FORWARD = (
    "no_reshard_between_backwards got a non-root FSDP2 unit: another FSDP2 module ran "
    "forward first and became the root. Pass that root module."
)


class FSDP2Block(BlockBase):
    """One ``no_reshard_between_backwards`` block on an FSDP2 root."""

    def __init__(self, model: nn.Module, options: RetainOptions) -> None:
        super().__init__(model, options)
        get_state = require_attr(model, "_get_fsdp_state", FLAVOUR)
        self._state = get_state()
        if self._state._is_root is False:
            raise ValueError(_NOT_ROOT.format(type(model).__name__))
        self._states: list[Any] = []
        self._groups: list[Any] = []
        self._saved_groups: list[tuple[Any, dict[str, Any]]] = []
        self._patched: list[Any] = []
        self._forward_hooks: list[Any] = []
        self._shown = ShownParams(self._groups)  # between passes: see _fsdp2_reshard
        self._prefetch: tuple[list[Any], list[list[int]]] | None = None
        self._held = HeldGrads()  # sync_grads="last": see _fsdp2_grads
        self._pending_unreduced = False
        self._probe: list[ProbeRecord] = []  # see _fsdp2_reshard
        self._nodes = ForwardNodes()  # which states a pass uses: see _fsdp2_nodes
        self._kept: set[int] = set()  # ids of the groups kept unsharded between passes
        self._lookup = ParamLeaves(self._groups)  # passes with inputs=
        self._between = BetweenPasses()  # the flags, reshard_to: see _fsdp2_reshard

    # Entering and leaving (see BlockBase) #
    def _root_decided(self) -> bool:
        return self._state._is_root is not None

    def _init_root(self) -> None:
        if self._state._is_root is False:
            # We are inside the real root's forward; leave FSDP2 clean before raising.
            reset_iteration(self._state._state_ctx.all_states[0])
            raise ValueError(_NOT_ROOT_AT_FORWARD)
        require_attr(self._state, "_lazy_init", FLAVOUR)()

    def _install(self) -> None:
        state_ctx = require_attr(self._state, "_state_ctx", FLAVOUR)
        self._states = list(require_attr(state_ctx, "all_states", FLAVOUR))
        self._groups.extend(g for s in self._states for g in param_groups(s))
        check_installable(self._state, self._states, self._groups)
        for group in self._groups:
            saved = {name: getattr(group, name) for name in GROUP_FLAGS}
            self._saved_groups.append((group, saved))
        self._installed = True
        self._kept = {id(g) for g in self.policy.kept(backward_order(self._states))}
        self._all_kept = len(self._kept) == len(self._groups)
        self._kept_total = len(self._kept)
        self._between.install(self._groups, self._kept, self.policy, self.frees_now)
        for state in self._states:
            original = getattr(state, PASS_START_HOOK)
            setattr(state, PASS_START_HOOK, self._wrap_pass_start(state, original))
            self._patched.append(state)
        for state in self._states:
            for module in state._modules:
                if is_compiled_in_place(module):
                    continue  # see [Note: the block under torch.compile]
                self._forward_hooks.append(self.probe_targets.hook_unit(module))
                self._forward_hooks.extend(self._nodes.hook(state, module))
        self._forward_hooks.extend(self.probe_targets.hook_sources(self.model))
        self._nodes.record_running_root(self._state)
        self._watch()
        self._forward_hooks.extend(self._shown.hook_forwards(self._kept))

    def _block_params(self) -> Callable[[], Iterable[torch.Tensor]]:
        def params() -> list[torch.Tensor]:
            # Not installed yet (FSDP2 picks its root at the first forward): the
            # modules still show what they showed at entry.
            found = []
            for group in self._groups:
                for fsdp_param in group.fsdp_params:
                    found.append(fsdp_param.sharded_param)
                    unsharded = getattr(fsdp_param, "_unsharded_param", None)
                    if unsharded is not None:
                        found.append(unsharded)
            return found

        return params

    def _uninstall(self) -> None:
        self._nodes.clear()
        for handle in self._forward_hooks:
            handle.remove()
        self._forward_hooks.clear()
        for state in self._patched:
            state.__dict__.pop(PASS_START_HOOK, None)
        self._patched.clear()
        self._between.uninstall()
        for group, saved in self._saved_groups:
            for name, value in saved.items():
                setattr(group, name, value)
        self._saved_groups.clear()
        self._release_model()

    def _finish(self) -> None:
        """Clean exit: reduce what is still unreduced, reshard everything."""
        self.tracker.warn_if_short()
        self._held.check()
        if self._pending_unreduced:
            self._flush_gradients()
        self._held.drop_unused()
        self._reshard_all(user_flags=True)
        self._state._comm_ctx.post_forward_order.clear()
        for group in self._groups:
            group._post_forward_indices.clear()

    def _abort(self) -> None:
        """Exception exit: no collectives (other ranks may not be here)."""
        reset_iteration(self._state)
        for group in self._groups:
            for fsdp_param in group.fsdp_params:
                clear_unsharded_grad(fsdp_param)
        self._held.drop_unused()
        self._reshard_all()

    def _reshard_all(self, user_flags: bool = False) -> None:
        """Reshards every group; with ``user_flags`` (a clean exit) not those whose
        owner set ``reshard_after_backward=False`` (``set_reshard_after_backward``:
        kept gathered across micro-batches), which show their unsharded parameters
        as after a plain backward."""
        state_enum = training_state_enum()
        for group, saved in self._saved_groups:
            if user_flags and not saved["reshard_after_backward"] and group.is_unsharded:
                self._shown.show_unsharded(group)
                continue
            if not group.is_sharded:
                with group.use_training_state(state_enum.IDLE):
                    group.reshard()
        self._shown.swapped.clear()

    # Probe passes: see [Note: a probe pass leaves each group as it found it] #
    def _before_probe(self) -> None:
        self._probe = [ProbeRecord(group) for group in self._groups]

    def _end_probe(self) -> None:
        freed = [record.group for record in self._probe if not record.end(self._shown)]
        self._probe.clear()
        if freed and not self.frees_now():
            warnings.warn(_PROBE_FREED.format(len(freed)), stacklevel=2)

    # Per-loss gradients: see [Note: per-loss gradients] in _loss_grads.py #
    def _check_grads(self) -> None:
        if not all(saved["reduce_grads"] for _, saved in self._saved_groups):
            raise ValueError(_GRADS_NEED_SYNC)

    def _make_grad_slots(self) -> GradSlots:
        return fsdp2_grad_slots(self.model, self._groups)

    # Pass boundaries #
    def on_backward_start(self) -> None:
        """Inside every backward, before its first node runs (see ``_pass_start``)."""
        if self._exited:
            return
        run = _pass_start.will_run
        used = [state for state in self._states if self._nodes.uses(state, run)]
        if not used:
            return  # another model's backward
        if not self._state._state_ctx.post_backward_final_callback_queued:
            # No root output in this pass: what FSDP2's first pre-backward does.
            self._state._register_root_post_backward_final_callback()
        for state in used:
            if all(id(g) in self._kept for g in param_groups(state)):
                continue  # nothing to gather
            if not self._nodes.reaches_outputs(state, run):
                # The pass starts inside this unit: gather it before its nodes run.
                state._pre_backward(torch.empty(0))

    def _open_span(self) -> Span:
        return FSDP2Span(self._groups, self.probing)

    def _wrap_pass_start(self, state: Any, original):
        def register_final_callback() -> None:
            if not self._state._state_ctx.post_backward_final_callback_queued:
                self._on_pass_start()
                original()
                queue_callback(self._on_pass_end)
            else:
                original()

        return register_final_callback

    def _on_pass_start(self) -> None:
        policy = self.policy
        index = self._start_pass()
        ctx = self._state._comm_ctx
        if index == 1:
            self._prefetch = (
                list(ctx.post_forward_order),
                [list(g._post_forward_indices) for g in self._groups],
            )
        elif not self._all_kept and self._prefetch is not None:
            order, indices = self._prefetch
            ctx.post_forward_order[:] = order
            for group, group_indices in zip(self._groups, indices):
                group._post_forward_indices[:] = group_indices
        self._shown.show_unsharded()
        if policy.holds_back:
            self._held.check()
        if policy.is_last(index):
            for group, saved in self._saved_groups:
                # The last pass frees what the user lets FSDP2 free after backward.
                group.reshard_after_backward = saved["reshard_after_backward"]
                if policy.holds_back:
                    group.reduce_grads = saved["reduce_grads"]
                    group.all_reduce_grads = saved["all_reduce_grads"]
        if self.probing:
            # Reduce nothing; held-back gradients stay pending (flushed at exit
            # if this was the last pass).
            for record in self._probe:
                record.start()
        else:
            self._pending_unreduced = not policy.reduces(index, probing=False)

    def _on_pass_end(self) -> None:
        self._end_pass()
        if self._kept:
            self._shown.show_sharded()
        self._end_probe()  # after the swap: a probe pass shows what it found
        if self._pending_unreduced:
            self._held.record(self._groups)

    def _flush_gradients(self) -> None:
        """Reduce-scatters the held-back gradients, as FSDP2's last backward would."""
        for group, saved in self._saved_groups:
            group.reduce_grads = saved["reduce_grads"]
            group.all_reduce_grads = saved["all_reduce_grads"]
            group.reshard_after_backward = saved["reshard_after_backward"]
        self._pending_unreduced = False
        if not any(saved["reduce_grads"] for _, saved in self._saved_groups):
            return  # the user asked FSDP2 not to sync (gradient accumulation)
        self._shown.show_unsharded()
        self._held.forget()
        run_root_final_callback(self._state)


_PROBE_FREED = (
    "block.backward(..., param_grads=False) freed the unsharded parameters of {} FSDP2 "
    "unit(s) that keep_unsharded does not keep, and their .grad held gradients "
    "accumulated under set_requires_gradient_sync(False). Between passes and after the "
    "block, model.parameters() shows those units' sharded parameters, whose .grad does "
    "not hold these gradients (FSDP2 still does: nothing is lost, the syncing "
    "micro-batch reduces them). To read them through model.parameters(), keep these "
    "units unsharded (keep_unsharded=True or a larger byte budget)."
)
_GRADS_NEED_SYNC = (
    "block.grads() needs each pass reduced: this model has gradient sync off "
    "(set_requires_gradient_sync(False)). Call it outside gradient accumulation, or "
    "turn sync on for this micro-batch."
)
