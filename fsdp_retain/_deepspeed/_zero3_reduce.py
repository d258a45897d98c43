"""How the ZeRO-3 block's passes write ZeRO-3's reduced gradient partitions (part of the
DeepSpeed backend with ``_block.py``: see its module docstring, "Gradients", and
[Note: the engine's backward prologue in the block] there).

ZeRO-3 reduce-scatters each parameter's gradient from its ``AccumulateGrad`` hook into a
partition (``__param_id_to_grad_partition``, by ``ds_id``), copying over it while
``micro_step_id == 0`` and adding to it after. ``PartitionWrites`` makes every pass of a
block after one that reduced add (``micro_step_id`` bumped to 1, put back at the exit),
zeroes the partitions a copying pass does not reach, runs the engine's backward prologue
at the start of every pass that computes gradients, and with ``sync_grads="last"`` holds
the gradients in ``.grad`` (``_coalesce_grad_reduction``) until the last pass or the
exit reduces them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._common import require_attr
from .._policy import Policy
from ._graph import ForwardGraph

_GRAD_PARTITIONS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"


class PartitionWrites:
    """One block's writes into ZeRO-3's gradient partitions, pass by pass."""

    def __init__(self, engine: Any, policy: Policy, graph: ForwardGraph,
                 trainable: list[Any], flavour: str) -> None:
        self.engine = engine
        self.opt = engine.optimizer
        self.policy = policy
        self._graph = graph
        self._trainable = trainable
        self._flavour = flavour
        self.partitions: dict[int, torch.Tensor] = {}
        self.reduced = False  # a pass of this block reduce-scattered
        self.bumped_micro_step = False  # this block made ZeRO-3 add to the partitions
        self.pending = False  # "last": unreduced gradients held in .grad
        self._saved_coalesce: bool | None = None
        self._prologue: Any = None  # the engine's _backward_prologue (shadowed by the block)

    def install(self) -> None:
        flavour, opt = self._flavour, self.opt
        require_attr(opt, "_backward_hook_state", flavour)
        require_attr(opt, "micro_step_id", flavour)
        self._saved_coalesce = require_attr(opt, "_coalesce_grad_reduction", flavour)
        self.partitions = require_attr(opt, _GRAD_PARTITIONS, flavour)
        self._prologue = require_attr(self.engine, "_backward_prologue", flavour)
        if self.policy.holds_back:
            opt._coalesce_grad_reduction = True

    def uninstall(self) -> None:
        if self._saved_coalesce is not None:
            self.opt._coalesce_grad_reduction = self._saved_coalesce

    def pass_start(self, index: int, will_run: Callable[[Any], bool]) -> None:
        """A pass that computes gradients starts (``index``: its 1-based index)."""
        opt = self.opt
        if self.policy.holds_back and self.policy.is_last(index):
            opt._coalesce_grad_reduction = self._saved_coalesce
        reduces = not opt._coalesce_grad_reduction
        if self.reduced and reduces:
            self._accumulate_into_partitions()
        if reduces and opt.micro_step_id == 0:
            self._zero_unreached_partitions(will_run)
        self._engine_prologue()
        self.reduced = self.reduced or reduces
        self.pending = not reduces

    def finish(self) -> None:
        """Clean exit: reduce what is held, put ``micro_step_id`` back."""
        if self.pending:
            self._flush_gradients()
        self._restore_micro_step()

    def abort(self, params: list[Any]) -> None:
        """Exception exit: drop every gradient not reduced yet, no collectives."""
        for param in params:
            param.grad = None
        for bucket in getattr(self.opt, "ipg_buckets", {}).values():
            bucket.params.clear()
            bucket.elements = 0
        self.opt._backward_hook_state.backward_active_depth = 0
        self.pending = False
        self._restore_micro_step()

    def _accumulate_into_partitions(self) -> None:
        """Makes this pass add to the reduced partitions instead of overwriting them."""
        opt = self.opt
        # optimizer.zero_grad() since the last pass clears both: copy, dropping it.
        if opt.micro_step_id == 0 and opt._epilogue_ran_this_backward:
            opt.micro_step_id = 1
            self.bumped_micro_step = True

    def _zero_unreached_partitions(self, will_run: Callable[[Any], bool]) -> None:
        """A pass at ``micro_step_id == 0`` copies over the partitions it reaches,
        and later passes add to every partition. Zeroes the ones it does not
        reach, which still hold the previous step's gradient (seen: a first pass
        from inside the model left the last layer's gradient of the step before).
        A parameter without a held node (``held_node``) is zeroed too: when a
        checkpoint's recompute reaches it after all, its reduction copies over."""
        for param in self._graph.unreached(will_run, self._trainable):
            partition = self.partitions.get(param.ds_id)
            if partition is not None:
                partition.zero_()

    def _restore_micro_step(self) -> None:
        # optimizer.zero_grad() in between already set it back to 0.
        if self.bumped_micro_step and self.opt.micro_step_id == 1:
            self.opt.micro_step_id = 0
        self.bumped_micro_step = False

    def _engine_prologue(self) -> None:
        """Runs the engine's backward prologue for this pass.

        See [Note: the engine's backward prologue in the block]. Depth 0: a
        pass before ran its epilogue, or it did not run (an exception).
        """
        state = self.opt._backward_hook_state
        state.backward_active_depth = 0
        state.backward_seen_this_step = False  # enter_backward then resets its counters
        self._prologue()

    def _flush_gradients(self) -> None:
        """Reduce-scatters the held-back gradients, as ``coalesce_grad_reduction`` does."""
        opt = self.opt
        opt._coalesce_grad_reduction = self._saved_coalesce
        self.pending = False
        for group in opt.fp16_groups:
            for param in group:
                if param.requires_grad and param.grad is not None:
                    opt.reduce_ready_partitions_and_remove_grads(param)
        opt.independent_gradient_partition_epilogue()
