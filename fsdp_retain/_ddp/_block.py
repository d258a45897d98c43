"""DDP backend (``DistributedDataParallel``). All private DDP access lives here and
in ``_buckets.py``.

What the block does to a DDP model (see [Note: how the block reduces DDP
gradients] in ``_buckets.py``):

- Nothing is sharded, so nothing is kept or re-gathered: ``keep_unsharded`` has no
  effect and ``reshard_to`` is refused. Every pass may build a gradient graph
  (``create_graph=True``).
- Forwards inside the block run with ``require_backward_grad_sync`` off, so DDP's
  reducer arms no hook. A pass that reaches the model's parameters is a block pass;
  a pass that accumulated a gradient into one of them (a hook after accumulation)
  reduces at its end when the policy says so: ``sync_grads="every"`` each pass,
  ``"last"`` the last announced one (``backwards=N``) or the block exit.
- Inside ``no_sync()`` (gradient accumulation) the block reduces nothing, as DDP.
- ``static_graph``: DDP's first-iteration delayed all-reduce is held off inside the
  block (the block reduces); DDP learns its static graph at its first step outside.
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

import torch
import torch.nn as nn

from .. import _pass_start
from .._common import eager_modules, queue_callback, require_attr
from .._lifecycle import BlockBase
from .._loss_grads import GradSlots
from .._nested import GradStashSpan, Span
from .._grad_layout import per_param_layout
from .._policy import RetainOptions
from ._buckets import FLAVOUR, Buckets

_MIXED_PRECISION = (
    "no_reshard_between_backwards does not support DDP's experimental mixed_precision "
    "(its comm hook upcasts on a side stream the block does not drive): use "
    "torch.autocast around the forward instead."
)
_GRADS_NEED_SYNC = (
    "block.grads() needs each pass reduced: this DDP model is inside no_sync(). Call it "
    "outside gradient accumulation, or on the micro-batch that syncs."
)


class DDPBlock(BlockBase):
    """One ``no_reshard_between_backwards`` block on a ``DistributedDataParallel`` model."""

    def __init__(self, model: nn.Module, options: RetainOptions) -> None:
        super().__init__(model, options)
        options.check_reshard_to("DDP")
        if getattr(model, "mixed_precision", None) is not None:
            raise ValueError(_MIXED_PRECISION)
        self._all_kept = True  # nothing to re-gather: any pass may build a graph
        self._buckets: Buckets | None = None
        self._syncs = True  # False inside the user's no_sync()
        self._saved: dict[str, Any] = {}
        self._handles: list[Any] = []
        self._nodes: list[Any] = []  # the managed parameters' AccumulateGrad nodes
        self._accumulated = False  # a pass wrote .grad since the last reduction

    # Entering and leaving (see BlockBase) #
    def _root_decided(self) -> bool:
        return True

    def _init_root(self) -> None:
        """DDP has no lazy root."""

    def _install(self) -> None:
        ddp = self.model
        self._buckets = Buckets(ddp)
        require_attr(ddp, "require_backward_grad_sync", FLAVOUR)
        self._syncs = bool(ddp.require_backward_grad_sync)
        self._saved = {"require_backward_grad_sync": ddp.require_backward_grad_sync}
        ddp.require_backward_grad_sync = False
        if ddp.static_graph:
            flag = "_static_graph_delay_allreduce_enqueued"
            self._saved[flag] = require_attr(ddp, flag, FLAVOUR)
            setattr(ddp, flag, True)
        for param in self._buckets.params:
            self._handles.append(param.register_post_accumulate_grad_hook(self._on_accumulate))
            self._nodes.append(_accumulate_node(param))
        module = ddp.module
        for unit in eager_modules(module):
            if any(True for _ in unit.parameters(recurse=False)):
                self._handles.append(self.probe_targets.hook_unit(unit))
        self._installed = True
        self._watch()

    def _uninstall(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._nodes.clear()
        for name, value in self._saved.items():
            setattr(self.model, name, value)
        self._saved = {}
        self._release_model()

    def _finish(self) -> None:
        self.tracker.warn_if_short()
        if self._accumulated and self._syncs:
            self._reduce()
        if self._syncs:
            # As after a synced forward: DDP broadcasts buffers at the next one.
            self.model.require_forward_param_sync = True

    def _abort(self) -> None:
        if self._accumulated and self._syncs and self._buckets is not None:
            for param in self._buckets.params:
                param.grad = None
        self._accumulated = False

    # Passes #
    def on_backward_start(self) -> None:
        if self._exited:
            return
        if not self.probing and not any(_pass_start.will_run(n) for n in self._nodes):
            return  # another model's backward
        self._start_pass()
        queue_callback(self._on_pass_end)

    def _on_pass_end(self) -> None:
        self._end_pass()
        index = self.tracker.started
        if self._accumulated and self._syncs and self.policy.reduces(index, probing=self.probing):
            self._reduce()

    def _on_accumulate(self, param: torch.Tensor) -> None:
        # A probe pass writes no parameter gradient: what its nested passes accumulate
        # the span drops (see [Note: nested passes on replicated gradients]).
        if not self.probing:
            self._accumulated = True

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
        return GradSlots(params, self.model.process_group, False,
                         per_param_layout(self.model.module, params))


def _accumulate_node(param: torch.Tensor) -> Any:
    """The ``AccumulateGrad`` node of a leaf (the graph holds the same one)."""
    return param.view_as(param).grad_fn.next_functions[0][0]
