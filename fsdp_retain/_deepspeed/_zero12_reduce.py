"""How the ZeRO stage 0-2 block reduces: the gradients a pass left in ``.grad`` go
through DeepSpeed's own reduction once (``Reducer.flush``), or, on a micro-batch where
DeepSpeed itself reduces nothing (``defers_reduction``), stay local until the boundary;
the step's reduced gradients are finalized at the accumulation boundary
(``Reducer.finish_step``); ``FullGradSlots`` is what ``block.grads`` sees. Part of the
DeepSpeed backend with ``_zero12.py``: see [Note: ZeRO stages 0-2 in the block] there.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .._common import module_parameters
from .._grad_layout import Selection, per_param_layout
from .._loss_grads import GradSlots


def defers_reduction(engine: Any) -> bool:
    """Whether DeepSpeed itself reduces nothing in this micro-batch: ZeRO-0 and ZeRO-1
    (gradients not partitioned) under managed gradient accumulation, off the boundary.
    ``engine.allreduce_gradients`` reduces there only at the boundary, and ZeRO-1's hooks
    (``reduce_ready_partitions_and_remove_grads``) too; ZeRO-2 reduces every micro-batch.
    With ``managed_gradient_accumulation`` false the boundary is ``engine.step()``, after
    the block: the block reduces as the policy says."""
    if engine.zero_optimization_partition_gradients():
        return False
    managed = getattr(engine, "managed_gradient_accumulation", lambda: True)()
    return bool(managed) and not engine.is_gradient_accumulation_boundary()


class Reducer:
    """ZeRO-1 and ZeRO-2 (``DeepSpeedZeroOptimizer``): while the block is installed
    the per-parameter hooks reduce nothing (``_coalesce_grad_reduction``, what
    ``engine.coalesce_grad_reduction()`` sets), and ``flush`` runs what they would,
    off the accumulation boundary: every gradient into the reduce bucket, then the
    optimizer's epilogue, which adds the reduced partition to the step's sum
    (``all_grad_tensors``, or the CPU buffers with ``offload_optimizer``). A flush is
    a micro-step of DeepSpeed's own gradient accumulation.

    Where DeepSpeed defers the reduction to the boundary (``defers``: ZeRO-1 off the
    boundary) a flush reduces nothing: it does what DeepSpeed's backward epilogue does
    there (``hold``), and the gradients wait in ``.grad`` (or ``grad_accum``) for the
    boundary micro-batch's flushes, which reduce them with that micro-batch's passes."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.opt = engine.optimizer
        self._saved_coalesce: bool | None = None
        self.flushed = False  # a flush since the last step: finish_step has work
        self.defers = False  # this micro-batch reduces nothing (defers_reduction)
        self._params: list[torch.nn.Parameter] = []

    def install(self) -> None:
        self.defers = defers_reduction(self.engine)
        self._params = self._trainable()
        self._saved_coalesce = self.opt._coalesce_grad_reduction
        self.opt._coalesce_grad_reduction = True

    def uninstall(self) -> None:
        if self._saved_coalesce is not None:
            self.opt._coalesce_grad_reduction = self._saved_coalesce
        self.opt.set_gradient_accumulation_boundary(self.engine.is_gradient_accumulation_boundary())

    def params(self) -> list[torch.nn.Parameter]:
        """The parameters that require grad, found once per block (at ``install``)."""
        return self._params

    def _trainable(self) -> list[torch.nn.Parameter]:
        return [p for group in self.opt.bit16_groups for p in group if p.requires_grad]

    def holds(self) -> bool:
        """Whether some gradient waits in ``.grad`` (or ``grad_accum``) for a flush."""
        return any(self.opt.get_param_gradient_attribute(p) is not None or p.grad is not None
                   for p in self.params())

    def flush(self) -> None:
        if self.defers:
            self.hold()
            return
        opt = self.opt
        opt.set_gradient_accumulation_boundary(False)
        opt._coalesce_grad_reduction = False
        try:
            opt.setup_buckets()
            for index, group in enumerate(opt.bit16_groups):
                for param in group:
                    if not param.requires_grad:
                        continue
                    if opt.use_grad_accum_attribute:
                        opt._fill_param_grad_accum_attribute(param)
                    if opt.get_gradient_for_reduction(param) is not None:
                        # Not reduce_ready_partitions_and_remove_grads: ZeRO-1 reduces
                        # there only at the boundary.
                        opt.reduce_independent_p_g_buckets_and_remove_grads(param, index)
            opt.independent_gradient_partition_epilogue()
            if opt.use_grad_accum_attribute:
                # The epilogue holds them now; the next forward would drop them too.
                for param in self.params():
                    param.grad_accum = None
        finally:
            opt._coalesce_grad_reduction = True
        self.flushed = True

    def hold(self) -> None:
        """Off the boundary: no collective. With a separate accumulation dtype (bf16 on
        ZeRO-1) ``.grad`` moves into ``grad_accum``, as DeepSpeed's backward epilogue
        does, so the micro-batches add up in that dtype; the next forward keeps it (no
        epilogue ran since the last one)."""
        if self.opt.use_grad_accum_attribute:
            self.opt.fill_grad_accum_attribute()

    def finish_step(self) -> None:
        """At the accumulation boundary: the sum of the flushes, for ``engine.step()``."""
        if self.flushed:
            self.opt.finalize_gradient_accumulation_boundary()
        self.flushed = False

    def abort(self) -> None:
        for param in self.params():
            param.grad = None
            if self.opt.use_grad_accum_attribute:
                param.grad_accum = None
        for bucket in self.opt.ipg_buckets.values():
            bucket.clear()
        reduced = self.opt.params_already_reduced
        reduced[:] = [False] * len(reduced)


class Zero0Reducer(Reducer):
    """ZeRO stage 0 (plain data parallel, fp32): ``flush`` all-reduces (averages) every
    ``.grad`` in place, as DeepSpeed does at the boundary. The average is linear, so a
    later pass that adds its local gradient to an averaged one and is averaged in turn
    gives the average of the sum. Off the boundary (``defers``) a flush reduces
    nothing: ``.grad`` holds the micro-batch for the boundary's all-reduce, as in
    DeepSpeed."""

    def install(self) -> None:
        self.defers = defers_reduction(self.engine)
        self._params = self._trainable()

    def uninstall(self) -> None:
        pass

    def _trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in module_parameters(self.engine.module) if p.requires_grad]

    def holds(self) -> bool:
        # At the boundary an averaged .grad looks like a held one: the block keeps count.
        # Off it .grad is local (this micro-batch's and the earlier ones').
        return self.defers and any(p.grad is not None for p in self.params())

    def flush(self) -> None:
        if self.defers:
            return
        self.engine.buffered_allreduce_fallback(elements_per_buffer=_ALLREDUCE_ELEMENTS)
        self.flushed = True

    def finish_step(self) -> None:
        self.flushed = False

    def abort(self) -> None:
        for param in self.params():
            param.grad = None


# engine.allreduce_gradients' default bucket (MEMORY_OPT_ALLREDUCE_SIZE in 0.19.8).
_ALLREDUCE_ELEMENTS = 500_000_000


class FullGradSlots(GradSlots):
    """``block.grads`` on stages 0-2: the pass's local ``.grad``, all-reduced (averaged)
    once over the data-parallel group into full gradients, the same on every rank
    (``sharded`` False: ``gramian`` needs no collective). ``.grad`` is moved aside for
    the pass and put back; the block does not flush the pass (``block._grads_running``).
    ``add`` (``apply_grads``) writes into ``.grad``, which the block reduces at its
    exit (off the boundary on ZeRO-0/1: with the boundary micro-batch's): every rank
    adds the same average, so the reduction keeps it."""

    def __init__(self, block: Any, params: list[torch.nn.Parameter], group: Any) -> None:
        super().__init__(params, group, False, per_param_layout(block._root, params))
        self._block = block

    def read(self) -> list[torch.Tensor | None]:
        grads = [h.grad for h in self.holders]
        present = [g for g in grads if g is not None]
        if present and dist.is_initialized():
            flat = torch.cat([g.reshape(-1).float() for g in present])
            dist.all_reduce(flat, group=self.group)
            flat /= dist.get_world_size(self.group)
            offset = 0
            for grad in present:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()
        return grads

    def add(self, values: list[torch.Tensor | None], selection: Selection) -> None:
        if self._block._exited and self._block.stage != 0:
            raise ValueError(
                "fsdp_retain.apply_grads after the no_reshard_between_backwards block on "
                f"DeepSpeed ZeRO-{self._block.stage}: the block reduced .grad into "
                "ZeRO's gradient partitions at its exit. Call apply_grads inside the block."
            )
        super().add(values, selection)
        self._block._pending = True
