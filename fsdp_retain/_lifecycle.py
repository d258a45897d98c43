"""The lifecycle every backend shares: one driver over per-flavour mechanics.

``BlockBase`` is what ``with no_reshard_between_backwards(model) as block``
binds. It drives a block from entry to exit and through each pass; a backend
(``FSDP1Block``, ``FSDP2Block``, ``DeepSpeedBlock``, ``DDPBlock``) subclasses it
and implements only the mechanics of its flavour, the abstract methods below. Its
public half (the pass counters, probe passes, ``grads``) is ``BlockAPI`` in
``_block_api.py``; the mapping of a pass's ``inputs`` is ``PassInputs`` in ``_inputs.py``.

[Note: the block lifecycle]
- Entry (``enter``): the optimizer-step guard and the saved-tensor check go
  on, the model is marked active, then ``_install`` runs now or, while FSDP
  has not picked its root yet, from a pre-forward hook at the first forward
  (``_init_root`` first: FSDP's lazy init).
- A pass: ``_pass_start`` calls the backend's ``on_backward_start`` before
  the pass's first node. If the pass reaches the model, the backend calls
  ``_start_pass`` (the ``create_graph=True`` refusal, the pass index), does
  its mechanics for a pass (what ``self.policy`` says about it), and queues
  its pass end with ``queue_callback``, which calls ``_end_pass``.
- Exit (``exit``): ``_finish`` on a clean exit (reduce what is held back,
  reshard), ``_abort`` on an exception (no collectives: other ranks may not be
  here), then always ``_uninstall`` and the guards off.
- A probe pass (``backward(..., param_grads=False)``): ``_before_probe``,
  ``torch.autograd.grad`` against ``self.probe_targets`` with ``probing``
  true, then ``_end_probe``. See [Note: probe passes] in ``_common.py``.

Passes with ``inputs=``: see [Note: inputs that name parameters] in ``_inputs.py``.
Backward passes run inside a pass (tiled MLP, cached losses): see [Note: nested
backward passes] in ``_nested.py``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn

from . import _pass_start
from ._block_api import BlockAPI
from ._common import ACTIVE_ATTR, RetainError, create_graph_needs_keep, queue_callback
from ._inputs import ParamLookup, PassInputs
from ._nested import NestedPasses, Span
from ._policy import PassTracker, Policy, RetainOptions
from ._probe import ProbeTargets
from ._saved_tensors import SavedTensorCheck
from ._step_guard import refuse_step


class BlockBase(BlockAPI, PassInputs, abc.ABC):
    """One ``no_reshard_between_backwards`` block: the driver; see [Note: the block lifecycle]."""

    def __init__(self, model: Any, options: RetainOptions) -> None:
        self.model = model
        self.options = options
        self.policy = Policy(options)
        self.tracker = PassTracker(options.backwards)
        self.probe_targets = ProbeTargets(_pass_start.in_backward)
        # True while a probe pass runs (public: hooks read it, see pass_index).
        self.probing = False
        # Every unit stays unsharded between passes (a create_graph=True pass needs it).
        self._all_kept = False
        self._installed = False
        self._exited = False
        self._watching = False
        self._deferred_hook: Any = None
        self._saved_check: SavedTensorCheck | None = None
        self._step_hook: Any = None
        self._selection: list[Any] = []  # see _inputs.py
        self._lookup = ParamLookup()  # the backend's, for passes with inputs=
        self._kept_total = 0  # units kept unsharded between passes, set at install
        self._slots: Any = None  # the backend's GradSlots, made at the first grads()
        self._grads_running = False  # a block.grads() pass runs (from take to put)
        self.nested = NestedPasses(self._open_span)  # see [Note: nested backward passes]
        self._forwards = 0  # forwards of the model running now (a pass inside one)
        self._forward_hooks: list[Any] = []

    # The mechanics of one flavour #
    @abc.abstractmethod
    def _root_decided(self) -> bool:
        """Whether FSDP has picked its root (else install at the first forward)."""

    @abc.abstractmethod
    def _init_root(self) -> None:
        """At the first forward: refuse a non-root model, then FSDP's lazy init."""

    @abc.abstractmethod
    def _install(self) -> None:
        """Changes FSDP for the block; sets ``_installed``, calls ``_watch``."""

    @abc.abstractmethod
    def _uninstall(self) -> None:
        """Undoes ``_install`` (also a partial one); calls ``_release_model``."""

    @abc.abstractmethod
    def _finish(self) -> None:
        """Clean exit: reduce what is still unreduced, reshard every unit."""

    @abc.abstractmethod
    def _abort(self) -> None:
        """Exception exit: drop unreduced gradients, reshard locally, no collectives."""

    @abc.abstractmethod
    def on_backward_start(self) -> None:
        """Inside every backward, before its first node (``_pass_start``)."""

    def before_backward(self) -> None:
        """Before every backward, outside the engine (``_pass_start``)."""

    def after_backward(self) -> None:
        """After every backward, when the engine returned or raised (``_pass_start``)."""
        for handle in self._selection:
            handle.remove()
        self._selection.clear()
        self._lookup.forget_selection()

    def before_nested(self) -> None:
        """Before a backward that starts inside a running one (``_pass_start``)."""
        running = self._installed and not self._exited and self.tracker.in_backward
        self.nested.enter(running)

    def on_nested_start(self) -> None:
        """Inside that backward, before its first node (``will_run`` answers for it)."""

    def after_nested(self) -> None:
        """When that backward returned or raised."""
        self.nested.leave()

    def _open_span(self) -> Span:
        """The first nested pass of a node of a pass: what the backend does for them
        until the outer pass moves on (see [Note: nested backward passes])."""
        return Span()

    def _pass_in_forward_refusal(self) -> str | None:
        """Why a pass that starts inside a forward of the model is refused on this
        backend (``None``: it is not); see [Note: passes a tiled kernel holds]."""
        return None

    def _check_pass_in_forward(self) -> None:
        """Raises, before the pass's first node, where a pass starts inside the
        model's forward (``TiledFusedLogitsLoss``'s per-shard backward) and the
        backend refuses one."""
        if self._forwards and not (self.probing or self.tracker.in_backward):
            why = self._pass_in_forward_refusal()
            if why is not None:
                raise RetainError(why)

    def _kept_count(self) -> int:
        """Units kept unsharded between passes (for tests; also after the exit)."""
        return self._kept_total

    def _block_params(self) -> Callable[[], Iterable[torch.Tensor]] | None:
        """What ``refuse_step`` asks at a step for the parameter objects the backend
        registers on the model (``None``: it takes ``model.parameters()`` at entry)."""
        return None

    # Entry and exit #
    def enter(self) -> None:
        setattr(self.model, ACTIVE_ATTR, True)
        try:
            # See [Note: why an optimizer step inside the block is refused].
            self._step_hook = refuse_step(self.model, self._block_params())
            # Only a backend that refuses a pass inside the forward counts forwards.
            if isinstance(self.model, nn.Module) and self._pass_in_forward_refusal():
                self._forward_hooks = [
                    self.model.register_forward_pre_hook(self._forward_starts, prepend=True),
                    self.model.register_forward_hook(self._forward_ends, always_call=True),
                ]
            if self.options.check_saved_tensors:
                self._saved_check = SavedTensorCheck()
                self._saved_check.push()
            if self._root_decided():
                self._install()
            else:
                # FSDP picks its root at the first forward; install then.
                self._deferred_hook = self.model.register_forward_pre_hook(
                    self._install_at_first_forward, prepend=True
                )
        except BaseException:
            try:
                self._uninstall()
            finally:
                self._pop_guards()
            raise

    def exit(self, exc: BaseException | None) -> None:
        self._exited = True
        self.probe_targets.clear()
        try:
            if not self._installed:
                return
            if exc is None:
                self.nested.end_pass()
                self._finish()
            else:
                self.nested.abort()
                self._abort()
        finally:
            try:
                self._uninstall()
            finally:
                self._pop_guards()

    def _install_at_first_forward(self, module: nn.Module, args: Any) -> None:
        self._deferred_hook.remove()
        self._deferred_hook = None
        self._init_root()
        self._install()
        self.probe_targets.record_inputs(module, args, {})  # its hook runs from the next forward

    def _forward_starts(self, module: nn.Module, args: Any) -> None:
        self._forwards += 1

    def _forward_ends(self, module: nn.Module, args: Any, output: Any) -> None:
        self._forwards -= 1

    def _pop_guards(self) -> None:
        for handle in self._forward_hooks:
            handle.remove()
        self._forward_hooks.clear()
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        # The graph keeps the hooks it already has; see
        # [Note: why a retained graph can silently read changed saved tensors].
        if self._saved_check is not None:
            self._saved_check.pop()
            self._saved_check = None

    def _watch(self) -> None:
        _pass_start.watch(self)
        self._watching = True

    def _release_model(self) -> None:
        """The backend-independent part of ``_uninstall``."""
        if self._watching:
            _pass_start.unwatch(self)
            self._watching = False
        if self._deferred_hook is not None:
            self._deferred_hook.remove()
            self._deferred_hook = None
        self._installed = False
        if getattr(self.model, ACTIVE_ATTR, False):
            delattr(self.model, ACTIVE_ATTR)

    # Passes #
    def _start_pass(self) -> int:
        """A pass reaches the model: returns its 1-based index."""
        if torch.is_grad_enabled() and not self._all_kept:
            raise create_graph_needs_keep()
        # Before the backend's own end of pass: see [Note: nested backward passes].
        queue_callback(self.nested.end_pass)
        return self.tracker.begin(writes=not (self.probing or self._grads_running))

    def _end_pass(self) -> None:
        self.tracker.end()

    def frees_now(self) -> bool:
        """Whether units go back to what FSDP leaves after a plain backward: the last
        announced pass runs, or the block exits."""
        return self._exited or self.policy.is_last(self.tracker.started)

    def _in_backward(self) -> bool:
        return _pass_start.in_backward()
