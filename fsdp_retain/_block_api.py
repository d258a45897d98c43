"""What a block offers inside the ``with`` statement: its pass counters, probe passes
(``backward(..., param_grads=False)``) and per-loss gradients (``grads``).

``BlockAPI`` is the public half of ``BlockBase`` (``_lifecycle.py``), which drives the
block; the state it reads is the driver's. A backend adapts it through the hooks at
the top (``_before_probe``, ``_end_probe``, ``_check_grads``, ``_make_grad_slots``).
See [Note: probe passes] in ``_common.py`` and [Note: per-loss gradients] in
``_loss_grads.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from ._common import RetainError
from ._loss_grads import GradSlots, LossGrads
from ._policy import PassTracker, Policy
from ._probe import ProbeTargets, refuse_reentrant_checkpoint


class BlockAPI:
    """The methods and properties ``with no_reshard_between_backwards(...) as block`` binds
    (documented for users on ``RetainBlock`` in ``_api.py``)."""

    # Set by BlockBase.__init__.
    tracker: PassTracker
    policy: Policy
    probe_targets: ProbeTargets
    probing: bool
    _exited: bool
    _slots: Any
    _grads_running: bool

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
        edges = self.probe_targets.edges()
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
            # Normally done at the pass end already; not if the loss reached no unit,
            # nor if the pass raised (and the caller goes on inside the block).
            self._end_probe()

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
            self._slots.tracker = self.tracker  # apply_grads marks what it wrote
        slots = self._slots
        self._grads_running = True
        try:
            saved = slots.take()
            try:
                loss.backward(retain_graph=retain_graph)
                values = slots.read()
            finally:
                slots.put(saved)
        finally:
            self._grads_running = False
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
