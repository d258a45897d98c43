"""The lifecycle every backend shares: one driver over per-flavour mechanics.

``BlockBase`` is what ``with no_reshard_between_backwards(model) as block``
binds. It drives a block from entry to exit and through each pass; a backend
(``FSDP1Block``, ``FSDP2Block``, ``DeepSpeedBlock``) subclasses it and
implements only the mechanics of its flavour, the abstract methods below.

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
from ._common import ACTIVE_ATTR, RetainError, create_graph_needs_keep, queue_callback
from ._inputs import ParamLookup, map_inputs
from ._loss_grads import GradSlots, LossGrads
from ._nested import NestedPasses, Span
from ._policy import PassTracker, Policy, RetainOptions
from ._probe import ProbeTargets, refuse_reentrant_checkpoint
from ._saved_tensors import SavedTensorCheck
from ._step_guard import refuse_step


class BlockBase(abc.ABC):
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
        self.nested = NestedPasses(self._open_span)  # see [Note: nested backward passes]

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

    def after_nested(self) -> None:
        """When that backward returned or raised."""
        self.nested.leave()

    def _open_span(self) -> Span:
        """The first nested pass of a node of a pass: what the backend does for them
        until the outer pass moves on (see [Note: nested backward passes])."""
        return Span()

    def _graph_inputs(self, tensor: torch.Tensor) -> list[Any] | None:
        """What stands for ``tensor``, a parameter this block manages, in the
        forward's graph (leaves, or ``GradientEdge``s of their ``AccumulateGrad``
        nodes); ``None`` if it manages no such parameter."""
        return self._lookup.graph_inputs(tensor)

    def _param_storages(self) -> set[int]:
        """Data pointers of the managed parameters' storages (unmappable views)."""
        return self._lookup.storages()

    def _select_grads(self, named: list[torch.Tensor]) -> list[Any]:
        """Before a pass whose ``inputs`` name ``named`` (managed parameters):
        graph hooks that keep the pass from writing to the parameters that
        share a leaf with them but are not named; returns their handles."""
        return self._lookup.select(named)

    def _kept_count(self) -> int:
        """Units kept unsharded between passes (for tests; also after the exit)."""
        return self._kept_total

    def _before_probe(self) -> None:
        """Prepare FSDP before a probe pass starts."""

    def _end_probe(self) -> None:
        """Undo ``_before_probe`` and the pass's flags (idempotent)."""

    # Public #
    @property
    def backward_passes(self) -> int:
        """Backward passes seen so far in this block, probe passes included."""
        return self.tracker.started

    @property
    def pass_index(self) -> int:
        """1-based index of the running backward pass (0 before the first).

        For hooks that act in one pass only: autograd captures a module's
        backward hooks at forward, so over a retained graph they fire in every
        pass. Inside a pass this is its index from the moment the pass reaches
        the model; between passes, the index of the last one. ``probing`` is
        true during a probe pass (``backward(..., param_grads=False)``).

        Example::

            def collect(module, grad_input, grad_output):
                if block.probing:  # influence probe only, not the policy loss
                    store(grad_output[0])
        """
        return self.tracker.started

    def backward(
        self,
        loss: torch.Tensor,
        *,
        param_grads: bool = True,
        retain_graph: bool | None = None,
        inputs: Any = None,
    ) -> None:
        """One backward pass of ``loss`` inside the block.

        ``param_grads=True`` is ``loss.backward(retain_graph=retain_graph,
        inputs=inputs)``: with ``inputs`` (parameters of the model, as
        ``model.parameters()`` gives them) only their gradients are computed,
        reduced and sharded; see [Note: inputs that name parameters] in ``_inputs.py``.
        ``param_grads=False`` is a probe pass: hooks on activations and full
        backward hooks on modules inside FSDP units fire with the gradients a
        plain backward gives them, but no parameter gradient is computed, no
        ``.grad`` changes (nor the gradients FSDP holds unreduced: ``no_sync()``
        micro-batches, passes held back by ``sync_grads="last"``), and nothing
        is reduced. See [Note: probe passes].

        Example::

            with no_reshard_between_backwards(model) as block:
                out = model(batch)
                block.backward(logp_loss(out), param_grads=False, retain_graph=True)
                policy_loss(out).backward()
        """
        if not isinstance(param_grads, bool):
            raise TypeError(
                f"param_grads must be a bool, got {param_grads!r}: True runs a normal "
                "backward, False a probe pass that only feeds gradient hooks"
            )
        if self._exited:
            raise RetainError(
                "block.backward() was called after its no_reshard_between_backwards "
                "block exited. Call it inside the `with` statement."
            )
        if param_grads:
            loss.backward(retain_graph=retain_graph, inputs=inputs)
            return
        if inputs is not None:
            raise ValueError(
                "block.backward(..., param_grads=False, inputs=...): a probe pass computes "
                "no parameter gradient, so it takes no inputs. Drop inputs=, or use "
                "param_grads=True to accumulate the gradients of those parameters."
            )
        refuse_reentrant_checkpoint(loss)
        edges = list(self.probe_targets.edges.values())
        if not edges:
            raise ValueError(
                "block.backward(..., param_grads=False) has nothing to differentiate "
                "against: no activation in this block's forward requires grad (the "
                "forward ran under torch.no_grad(), or every parameter is frozen). Run "
                "the forward inside the block with grad enabled, or use "
                "param_grads=True."
            )
        self._before_probe()
        self.probing = True
        try:
            # See [Note: probe passes]. Gradients of the unit inputs are
            # returned, not stored; materialize nothing into .grad.
            torch.autograd.grad(loss, edges, retain_graph=retain_graph, allow_unused=True)
        finally:
            self.probing = False
        # Normally done at the pass end already; not if the loss reached no unit.
        self._end_probe()

    def map_inputs(self, inputs: tuple, accumulate: bool, roots: list, nested: bool = False) -> tuple:
        """The ``inputs`` of a pass (over the autograd nodes ``roots``), with managed
        parameters replaced by what the graph uses (``_pass_start``)."""
        if not self._installed or self._exited:
            return inputs
        mapped, named = map_inputs(self, inputs, accumulate, roots, nested)
        if named:
            self._selection.extend(self._select_grads(named))
        return mapped

    def grads(self, loss: torch.Tensor, *, retain_graph: bool | None = None,
              params: Any = None) -> LossGrads:
        """One backward pass of ``loss`` whose reduced, sharded gradients come back
        instead of adding to ``.grad`` (left as it was): the sharded counterpart of
        ``torch.autograd.grad(loss, model.parameters())``, one reduce-scatter per
        unit. ``params`` (a submodule, parameter names, or the wrapped model's
        parameters) narrows what the result covers, as ``LossGrads.select`` does; the
        pass computes every gradient either way. See [Note: per-loss gradients] in
        ``_loss_grads.py``.

        Example::

            with no_reshard_between_backwards(model) as block:
                out = model(batch)
                grads = [block.grads(f(out), retain_graph=True) for f in losses]
                weights = my_weighting(fsdp_retain.gramian(grads))  # k x k, one all-reduce
                fsdp_retain.apply_grads(fsdp_retain.combine(grads, weights))
            optimizer.step()
        """
        if self._exited:
            raise RetainError(
                "block.grads() was called after its no_reshard_between_backwards block "
                "exited. Call it inside the `with` statement."
            )
        if self.policy.holds_back:
            raise ValueError(
                "block.grads() reduces each loss's gradients in its own pass, so it needs "
                "sync_grads='every' (the default); this block has sync_grads='last'."
            )
        self._check_grads()
        if self._slots is None:
            self._slots = self._make_grad_slots()
        slots = self._slots
        saved = slots.take()
        try:
            loss.backward(retain_graph=retain_graph)
            values = slots.read()
        finally:
            slots.put(saved)
        grads = LossGrads(slots, values)
        return grads if params is None else grads.select(params)

    def _check_grads(self) -> None:
        """Before every ``grads`` pass: raises where the pass would not reduce."""

    def _make_grad_slots(self) -> GradSlots:
        """Where the gradients the optimizer steps on are, for ``grads`` (once per block)."""
        raise ValueError(
            f"block.grads() is not supported on this backend ({type(self).__name__}); "
            "FSDP1, FSDP2 and DeepSpeed ZeRO-3 support it."
        )

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
        self.probe_targets.edges.clear()
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

    def _pop_guards(self) -> None:
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
        return self.tracker.begin()

    def _end_pass(self) -> None:
        self.tracker.end()

    def frees_now(self) -> bool:
        """Whether units go back to what FSDP leaves after a plain backward: the last
        announced pass runs, or the block exits."""
        return self._exited or self.policy.is_last(self.tracker.started)

    def _in_backward(self) -> bool:
        return _pass_start.in_backward()
