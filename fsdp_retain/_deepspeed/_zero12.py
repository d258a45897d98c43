"""DeepSpeed ZeRO stages 0, 1 and 2. All private DeepSpeed access lives in this package.

[Note: ZeRO stages 0-2 in the block]
Stages 0-2 never shard parameters, so a retained graph's saved tensors stay valid;
what goes wrong is the gradients. ZeRO-1 and ZeRO-2 reduce from each parameter's
``AccumulateGrad`` hook into a bucket, and the engine's backward epilogue turns the
reduced partition into the step's gradient (``averaged_gradients``) at the
accumulation boundary, from the last backward alone: over one forward,
``engine.backward(l1, retain_graph=True); engine.backward(l2)`` steps on ``l2``'s
gradient only (``loss.backward()`` fails or is as wrong; gradient accumulation and a
cached loss's replays fail on "Gradient computed twice for this partition"). ZeRO-0
all-reduces every pass's ``.grad`` at the boundary, which is right for
``engine.backward``, but not for ``loss.backward()`` (DeepSpeed refuses it there) or a
probe pass.

So while the block is installed DeepSpeed reduces nothing by itself: the engine's
``_backward_prologue`` and ``_backward_epilogue`` are shadowed by the block's
(``_prologue_from_output_hook``, a no-op epilogue), and the hooks of ZeRO-1/2 hold
(``_coalesce_grad_reduction``). Each pass accumulates its local gradient into ``.grad``
and the block reduces (``_zero12_reduce.Reducer.flush``): at the end of every pass
(``sync_grads="every"``), or once, at the end of pass ``backwards`` or at the block
exit (``"last"``). On ZeRO-1/2 a flush is one micro-step of DeepSpeed's own gradient
accumulation, off the boundary (the reduced partition adds to the step's sum); at the
exit of a block at the boundary the block finalizes that sum as the step reads it. On
ZeRO-0 a flush all-reduces ``.grad`` (averaging is linear, so it may run per pass).
``keep_unsharded`` changes nothing here; ``reshard_to`` is refused.

With gradient accumulation DeepSpeed itself reduces nothing off the boundary on ZeRO-0
and ZeRO-1 (``engine.allreduce_gradients`` and ZeRO-1's hooks act at the boundary only;
ZeRO-2 partitions gradients, so it reduces every micro-batch). Neither does the block
there, whatever ``sync_grads`` says (``Reducer.defers``, from ``defers_reduction`` at
entry): a flush only holds (the gradients stay in ``.grad``, or in ZeRO-1's ``grad_accum``
with a separate accumulation dtype, as DeepSpeed's backward epilogue leaves them), and
the boundary micro-batch's flushes reduce the held sum with its own passes, as the
policy says. ``block.grads`` works there too: ``FullGradSlots`` all-reduces each loss's
gradient itself, and what ``apply_grads`` adds (the same on every rank) waits with the
rest. An exception exit there drops every held gradient, the earlier micro-batches'
included (none was reduced).

Backward passes inside a pass (a tiled MLP's tiles, [Note: nested backward passes] in
``_nested.py``) accumulate into ``.grad`` like the rest of their pass, which reduces them
once; in a probe pass the span drops what they wrote ([Note: nested passes on
replicated gradients] in ``fsdp_retain/_nested.py``).

A pass starts (``on_backward_start``) when it reaches a parameter's ``AccumulateGrad``
node, the engine output or a probe target; a cached loss's replay, a pass nested in
another model's backward, starts from the engine output's hook, as on ZeRO-3.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

import torch
import torch.nn as nn

from .. import _pass_start
from .._common import (
    RetainError, eager_modules, grad_tensors, has_own_params, queue_callback, require_attr,
)
from .._kept_hooks import KeptHooks, kept_hooks, tree_signature
from .._lifecycle import BlockBase
from .._loss_grads import GradSlots
from .._nested import GradStashSpan, Span, kernel_holds
from .._policy import RetainOptions
from .._probe import keep_probe_hooks
from ._engine import check_engine_common, flavour, zero_stage
from ._step import StepContract
from ._zero12_reduce import FullGradSlots, Reducer, Zero0Reducer

_SHADOWED = ("_backward_prologue", "_backward_epilogue")

FP16_LOSS_BACKWARD = (
    "no_reshard_between_backwards on DeepSpeed ZeRO-{stage} with fp16: this pass is a "
    "loss.backward(), which skips DeepSpeed's loss scaling (its gradients would be off by "
    "the loss scale, or overflow unseen). Use engine.backward(loss), which scales the "
    "loss, or engine.scale(loss).backward()."
)


def check_zero12(engine: Any, options: RetainOptions) -> int:
    """The stage; ``ValueError`` for what the stage 0-2 block does not handle."""
    stage = zero_stage(engine)
    if stage not in (0, 1, 2):
        raise ValueError(f"DeepSpeedZero12Block handles ZeRO stages 0-2, got stage {stage}")
    if options.reshard_to is not None:
        raise ValueError(
            f"no_reshard_between_backwards(reshard_to={options.reshard_to}) has no meaning "
            f"on DeepSpeed ZeRO-{stage}: stages 0-2 never shard parameters, so no pass "
            "re-gathers them. Drop reshard_to (or use ZeRO-3 with zero_hpz_partition_size)."
        )
    check_engine_common(engine, stage)
    if engine.optimizer is None or type(engine.optimizer).__name__ == "DummyOptim":
        raise ValueError(
            "no_reshard_between_backwards needs the engine's optimizer; pass an optimizer "
            "(or an optimizer config) to deepspeed.initialize."
        )
    if stage == 0 and (engine.fp16_enabled() or engine.bfloat16_enabled()):
        raise ValueError(
            "no_reshard_between_backwards on DeepSpeed ZeRO stage 0 supports fp32 training "
            "only: fp16 and bf16 there use DeepSpeed's FP16/BF16 optimizer wrappers, whose "
            "gradients over several passes fsdp_retain has not verified. Set "
            "zero_optimization.stage to 1 or 2 (same parameters, partitioned optimizer "
            "state), or train in fp32 on stage 0."
        )
    if stage > 0 and not hasattr(engine.optimizer, "_coalesce_grad_reduction"):
        raise ValueError(
            f"no_reshard_between_backwards needs DeepSpeed's ZeRO-{stage} optimizer, got "
            f"{type(engine.optimizer).__name__}; pass a torch optimizer to deepspeed.initialize."
        )
    return stage


class DeepSpeedZero12Block(BlockBase):
    """One ``no_reshard_between_backwards`` block on a ZeRO stage 0, 1 or 2 engine;
    see [Note: ZeRO stages 0-2 in the block]."""

    def __init__(self, engine: Any, options: RetainOptions) -> None:
        self.stage = check_zero12(engine, options)
        super().__init__(engine, options)
        self._all_kept = True  # nothing is ever sharded: create_graph=True passes work
        self._flavour = flavour(self.stage)
        self._root: nn.Module = require_attr(engine, "module", self._flavour)
        self._reducer = Zero0Reducer(engine) if self.stage == 0 else Reducer(engine)
        self._kept: KeptHooks | None = None
        self._outputs: list[Any] = []  # grad_fn of the block's forwards' outputs
        self._acc_nodes = _pass_start.ParamNodes()  # the parameters' AccumulateGrad nodes
        self._prologue: Any = None
        self._pending = False  # local gradients not reduced yet
        # See [Note: who steps and who scales on DeepSpeed] in _step.py.
        self._contract = StepContract(engine, self._flavour)

    # Entering and leaving (see BlockBase) #
    def _root_decided(self) -> bool:
        return True

    def _init_root(self) -> None:
        raise AssertionError("a DeepSpeed engine is set up by deepspeed.initialize")

    def _install(self) -> None:
        for name in _SHADOWED:
            require_attr(self.model, name, self._flavour)
        require_attr(self.model, "_running_engine_backward", self._flavour)
        self._contract.check_entry()
        self._installed = True
        self._contract.install()
        self._reducer.install()
        self._prologue = self.model._backward_prologue
        self.model._backward_prologue = self._prologue_from_output_hook
        self.model._backward_epilogue = _no_epilogue
        self._acc_nodes = _pass_start.param_nodes(self.model, self._reducer.params())
        # See [Note: hooks kept on the model] in fsdp_retain/_kept_hooks.py.
        self._kept = kept_hooks(self.model, tree_signature(self._root), self._keep_hooks)
        self._kept.block = self
        self._watch()

    def _keep_hooks(self, kept: KeptHooks) -> None:
        root = self._root
        kept.add(root, root.register_forward_hook, attrgetter("_record_outputs"))
        modules = list(eager_modules(root))
        keep_probe_hooks(kept, filter(has_own_params, modules), modules)

    def _uninstall(self) -> None:
        if self._kept is not None:
            self._kept.block = None
            self._kept = None
        self._outputs.clear()
        self._acc_nodes = _pass_start.ParamNodes()
        for name in _SHADOWED:
            self.model.__dict__.pop(name, None)
        if self._installed:
            self._contract.uninstall()
            self._reducer.uninstall()
        self._release_model()

    def _finish(self) -> None:
        self.tracker.warn_if_short()
        if self._pending or self._reducer.holds():
            self._flush()
        if self.model.is_gradient_accumulation_boundary():
            self._reducer.finish_step()
        self._contract.finish(self.tracker.wrote)

    def _abort(self) -> None:
        """Exception exit: drop what no pass reduced yet, no collectives."""
        if self._pending or self._reducer.holds():
            self._reducer.abort()
        self._pending = False

    def _flush(self) -> None:
        self._pending = False
        self._reducer.flush()

    def _open_span(self) -> Span:
        # See [Note: nested passes on replicated gradients] in fsdp_retain/_nested.py.
        return GradStashSpan(self._reducer.params(), self.probing)

    # See [Note: per-loss gradients] in _loss_grads.py.
    def _check_grads(self) -> None:
        if self.model.fp16_enabled():
            raise ValueError(
                "block.grads() on DeepSpeed needs bf16 or fp32 training: with fp16 the "
                "loss scale would be in the gradients it returns. Use \"bf16\": "
                "{\"enabled\": true} in the DeepSpeed config."
            )

    def _make_grad_slots(self) -> GradSlots:
        group = getattr(self.model.optimizer, "dp_process_group", None)  # stage 0: all ranks
        return FullGradSlots(self, self._reducer.params(), group)

    # Pass boundaries #
    def _record_outputs(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled() and not self._in_backward():
            self._outputs.extend(t.grad_fn for t in grad_tensors(output) if t.grad_fn is not None)

    def on_backward_start(self) -> None:
        """Inside every backward, before its first node runs (see ``_pass_start``)."""
        run = _pass_start.will_run
        reaches_output = any(map(run, self._outputs))
        # The probe targets last: a pass that reaches the output or a parameter (every
        # pass but a probe pass from inside the forward) makes no edges.
        if not (reaches_output or self._acc_nodes.any_run()
                or any(map(run, (edge.node for edge in self.probe_targets.edges())))):
            return  # another model's backward
        if not (self.probing or self.tracker.in_backward) and kernel_holds(self._reducer.params()):
            return  # see [Note: passes a tiled kernel holds] in fsdp_retain/_nested.py
        self._begin(reaches_output)

    def _prologue_from_output_hook(self) -> None:
        """The engine's ``_backward_prologue`` while the block is installed: DeepSpeed
        calls it from a once-per-forward hook on the engine output. A no-op, except
        for a pass the block did not start: one nested in another model's backward
        (a cached loss's replay from a hook on its loss), which starts here."""
        if self.nested.outside_block_pass and not self.tracker.in_backward:
            self._begin(reaches_output=True)

    def _begin(self, reaches_output: bool) -> None:
        engine_backward = bool(self.model._running_engine_backward)
        if not (self.probing or engine_backward or self._grads_running):
            if self.model.fp16_enabled():
                raise RetainError(FP16_LOSS_BACKWARD.format(stage=self.stage))
        self._contract.check_pass(reaches_output, self.probing)
        index = self._start_pass()
        reduces = self.policy.reduces(index, probing=self.probing) and not self._grads_running
        holds = not (self.probing or self._grads_running)
        queue_callback(lambda: self._end_of_pass(reduces, holds))

    def _end_of_pass(self, reduces: bool, holds: bool) -> None:
        self._end_pass()
        self._pending = self._pending or holds
        if reduces and self._pending:
            self._flush()


def _no_epilogue() -> None:
    """Stands in for the engine's ``_backward_epilogue`` in the block: it reduces."""
