"""DDP backend (``DistributedDataParallel`` and the composable ``replicate``, whose
reducer is DDP's: see [Note: composable replicate] in ``_wrappers.py``). All private
DDP access lives here, in ``_buckets.py`` and in ``_wrappers.py``.

What the block does to a DDP model (see [Note: how the block reduces DDP
gradients] in ``_buckets.py``):

- Nothing is sharded, so nothing is kept or re-gathered: ``keep_unsharded`` has no
  effect and ``reshard_to`` is refused. Every pass may build a gradient graph
  (``create_graph=True``).
- Forwards inside the block run with ``require_backward_grad_sync`` off (replicate:
  its ``_no_sync`` on), so DDP's reducer arms no hook. A pass that reaches the
  model's parameters is a block pass; a pass that accumulated a gradient into one of
  them (it runs their ``AccumulateGrad`` nodes: ``ParamNodes`` in ``_pass_start.py``,
  also for a backward nested in another) reduces at its end when the policy says so:
  ``sync_grads="every"`` each pass, ``"last"`` the last announced one
  (``backwards=N``) or the block exit.
- Inside ``no_sync()`` (replicate: after ``set_requires_gradient_sync(False)``;
  gradient accumulation) the block reduces nothing, as DDP.
- ``static_graph``: DDP's first-iteration delayed all-reduce is held off inside the
  block (the block reduces); DDP learns its static graph at its first step outside.
  Under Lightning's ``DDPStrategy`` DDP's forward runs around the block, so its first
  iteration is the run's first step even in a block: there the block leaves the sync
  on for the first ``manual_backward`` (see [Note: Lightning's DDPStrategy around the
  block] in ``_lightning.py``).
- Probe passes differentiate against the inputs of every module with parameters
  of its own ([Note: probe passes] in ``_common.py``): no parameter gradient.
- Backward passes nested in a pass (a tiled MLP's tiles) accumulate into ``.grad`` with
  their pass, which reduces once; in a probe pass what they wrote is dropped ([Note:
  nested passes on replicated gradients] in ``fsdp_retain/_nested.py``).
- An exception: nothing is communicated; if a pass accumulated since the last
  reduction, every managed ``.grad`` is dropped (part of it is local to the rank).
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from .._pass_start import ParamNodes
from .._common import eager_modules, has_own_params, queue_callback, require_attr
from .._kept_hooks import KeptHooks, kept_hooks, tree_signature
from .._lifecycle import BlockBase
from .._loss_grads import GradSlots
from .._nested import GradStashSpan, Span, kernel_holds
from .._grad_layout import per_param_layout
from .._policy import RetainOptions
from .._probe import keep_probe_hooks
from ._buckets import FLAVOUR, Buckets
from ._lightning import static_graph_unlearned
from ._wrappers import DDPModel, ddp_model, fully_sharded_inside

_MIXED_PRECISION = (
    "no_reshard_between_backwards does not support DDP's experimental mixed_precision "
    "(its comm hook upcasts on a side stream the block does not drive): use "
    "torch.autocast around the forward instead."
)
_FULLY_SHARDED_INSIDE = (
    "no_reshard_between_backwards does not support replicate(...) over submodules that "
    "fully_shard manages ({names} in the {cls}): their gradients are FSDP2's, the rest "
    "DDP's. Shard the root too (fully_shard over a 2-D (replicate, shard) mesh: HSDP) and "
    "pass it."
)
_GRADS_NEED_SYNC = (
    "block.grads() needs each pass reduced: this DDP model is inside no_sync() (or "
    "set_requires_gradient_sync(False) under replicate). Call it outside gradient "
    "accumulation, or on the micro-batch that syncs."
)


class DDPBlock(BlockBase):
    """One ``no_reshard_between_backwards`` block on a ``DistributedDataParallel`` model
    or a module ``replicate`` was applied to."""

    def __init__(self, model: nn.Module, options: RetainOptions) -> None:
        super().__init__(model, options)
        options.check_reshard_to("DDP")
        wrapped = ddp_model(model)
        assert wrapped is not None, type(model)
        sharded = fully_sharded_inside(wrapped)
        if sharded:
            raise ValueError(_FULLY_SHARDED_INSIDE.format(cls=type(model).__name__,
                                                           names=", ".join(sharded[:3])))
        self._wrapped: DDPModel = wrapped
        self._all_kept = True  # nothing to re-gather: any pass may build a graph
        self._buckets: Buckets | None = None
        self._syncs = True  # False inside the user's no_sync() (replicate: sync off)
        self._saved: list[tuple[Any, str, Any]] = []  # (object, attribute, value before)
        self._kept: KeptHooks | None = None
        self._nodes = ParamNodes()  # the managed parameters' AccumulateGrad nodes
        self._accumulated = False  # a pass wrote .grad since the last reduction
        # Lightning's DDPStrategy is to run DDP's first static-graph iteration in a pass.
        self._graph_unlearned = False

    # Entering and leaving (see BlockBase) #
    def _root_decided(self) -> bool:
        return self._wrapped.initialized

    def _init_root(self) -> None:
        """replicate builds its DDP at the first forward (``DistributedDataParallel``
        has no lazy init)."""
        self._wrapped.init()

    def _install(self) -> None:
        ddp = self._wrapped.ddp
        if getattr(ddp, "mixed_precision", None) is not None:
            raise ValueError(_MIXED_PRECISION)
        self._buckets = Buckets.for_ddp(ddp)
        self._syncs = self._wrapped.syncs()
        # See [Note: Lightning's DDPStrategy around the block] in _lightning.py.
        self._graph_unlearned = static_graph_unlearned(ddp)
        if self._graph_unlearned:
            # Lightning's pre_backward sets it where it arms the reducer (before_backward).
            self._set(ddp, "require_forward_param_sync", False)
        else:
            self._sync_off()
        if ddp.static_graph:
            self._set(ddp, "_static_graph_delay_allreduce_enqueued", True)
        # See [Note: hooks kept on the model] in fsdp_retain/_kept_hooks.py.
        key = (self._buckets, tree_signature(self._wrapped.module))
        self._kept = kept_hooks(ddp, key, self._keep_hooks)
        self._kept.block = self
        self._nodes = self._buckets.nodes
        self._installed = True
        self._watch()

    def _sync_off(self) -> None:
        """No forward or ``manual_backward`` arms DDP's reducer from here on: the block
        reduces."""
        for owner, name, value in self._wrapped.sync_off():
            self._set(owner, name, value)

    def _keep_hooks(self, kept: KeptHooks) -> None:
        units = filter(has_own_params, eager_modules(self._wrapped.module))
        keep_probe_hooks(kept, units, ())

    def _uninstall(self) -> None:
        if self._kept is not None:
            self._kept.block = None
            self._kept = None
        self._nodes = ParamNodes()
        for owner, name, value in reversed(self._saved):
            setattr(owner, name, value)
        self._saved = []
        self._release_model()

    def _set(self, owner: Any, name: str, value: Any) -> None:
        """Sets a DDP flag for the block; ``_uninstall`` puts the old value back."""
        self._saved.append((owner, name, require_attr(owner, name, FLAVOUR)))
        setattr(owner, name, value)

    def _finish(self) -> None:
        self.tracker.warn_if_short()
        if self._accumulated and self._syncs:
            self._reduce()
        if self._syncs:
            # As after a synced forward: DDP broadcasts buffers at the next one.
            self._wrapped.ddp.require_forward_param_sync = True

    def _abort(self) -> None:
        if self._accumulated and self._syncs and self._buckets is not None:
            for param in self._buckets.params:
                param.grad = None
        self._accumulated = False

    # Passes #
    def before_backward(self) -> None:
        super().before_backward()
        if self._graph_unlearned and self._wrapped.ddp.require_forward_param_sync:
            # Lightning armed the reducer for this pass, DDP's first static-graph
            # iteration, and flushes it after the pass: later passes are the block's.
            self._graph_unlearned = False
            self._sync_off()

    def on_backward_start(self) -> None:
        if self._exited:
            return
        accumulates = not self.probing and self._nodes.any_run()
        if not (self.probing or accumulates):
            return  # another model's backward
        # The pass runs a managed parameter's AccumulateGrad: it writes .grad. A probe
        # pass writes none; what its nested passes accumulate the span drops (see [Note:
        # nested passes on replicated gradients]).
        self._accumulated = self._accumulated or accumulates
        assert self._buckets is not None
        if not (self.probing or self.tracker.in_backward) and kernel_holds(self._buckets.params):
            return  # see [Note: passes a tiled kernel holds] in fsdp_retain/_nested.py
        self._start_pass()
        queue_callback(self._on_pass_end)

    def on_nested_start(self) -> None:
        """A backward inside a running one (a tiled MLP's tile, a cached loss's replay
        from a hook on another model's loss) that writes a managed ``.grad`` too."""
        if not (self._exited or self.probing) and self._nodes.any_run():
            self._accumulated = True

    def _on_pass_end(self) -> None:
        self._end_pass()
        index = self.tracker.started
        if self._accumulated and self._syncs and self.policy.reduces(index, probing=self.probing):
            self._reduce()

    def _open_span(self) -> Span:
        # See [Note: nested passes on replicated gradients] in fsdp_retain/_nested.py.
        assert self._buckets is not None
        return GradStashSpan(self._buckets.params, self.probing)

    def _reduce(self) -> None:
        assert self._buckets is not None
        self._buckets.reduce()
        self._accumulated = False

    # Per-loss gradients #
    def _check_grads(self) -> None:
        if not self._syncs:
            raise ValueError(_GRADS_NEED_SYNC)

    def _make_grad_slots(self) -> GradSlots:
        assert self._buckets is not None
        params = self._buckets.params
        # Replicated: every rank holds the whole averaged gradient (no all-reduce of
        # a Gramian or a norm).
        return GradSlots(params, self._wrapped.ddp.process_group, False,
                         per_param_layout(self._wrapped.module, params))

