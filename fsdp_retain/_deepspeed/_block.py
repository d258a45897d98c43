"""DeepSpeed ZeRO-3 backend. All private DeepSpeed access lives here.

Never imports deepspeed itself: a model can only be a ``DeepSpeedEngine`` if
the user already imported it. See [Note: why a retained graph needs unsharded
storage] in ``_common.py`` for what goes wrong without the block.

What the block does to a ZeRO-3 engine (``engine.optimizer`` is
``DeepSpeedZeroOptimizer_Stage3``, its ``parameter_offload`` owns the hooks
and the parameter coordinator):

- ``keep_unsharded=True``: the coordinator's per-parameter release is a no-op
  from block entry to exit, so the forward's all-gathers serve every backward
  pass; at exit every gathered parameter is released locally.
- ``keep_unsharded=False``: ZeRO-3's pre-backward hook fetches a module's
  parameters only while ``applied_pre_backward_ref_cnt > 0`` and its
  post-backward hook releases them when ``ds_grads_remaining`` reaches 0; both
  counters are set by the forward and used up by the first pass. They are
  recorded at the start of pass 1 and put back at the start of each later
  pass, so every pass re-gathers and frees per module. Both: ``Gathered`` in
  ``_zero3_gather.py``.
- Gradients (``PartitionWrites`` in ``_zero3_reduce.py``): ZeRO-3 reduce-scatters
  each parameter's gradient from its ``AccumulateGrad`` hook into a gradient
  partition, copying over it while ``micro_step_id == 0``. A pass after one that
  reduced runs with ``micro_step_id >= 1`` (restored at exit), so it adds. See
  [Note: the engine's backward prologue in the block] for how every pass gets the
  prologue that lets the post-backward epilogue flush the last bucket.
- ``sync_grads="last"``: ``optimizer._coalesce_grad_reduction`` (what
  ``engine.coalesce_grad_reduction()`` sets) keeps the unsharded gradients
  local until the last pass reduces them, or the block exit does.
- The engine's step and the division by the accumulation steps: [Note: who steps
  and who scales on DeepSpeed] in ``_step.py``.
- Probe passes (see [Note: probe passes] in ``_common.py``): every module
  ZeRO-3 put hooks on is a unit, its inputs are the probe's targets; no
  ``AccumulateGrad`` runs, so no reduce hook fires, and the pass skips the
  engine prologue and the partition bookkeeping above.

- Nested backward passes (a tiled MLP, a cached loss; see [Note: nested backward
  passes] in ``_nested.py``): the span of ``_nested.py`` holds ZeRO-3's
  per-parameter reductions and, with ``keep_unsharded=False``, its releases.
  A cached loss's replay inside another model's backward starts its pass from the
  engine output's prologue hook (``_prologue_from_output_hook``).

Pass boundaries: ``_pass_start`` runs ``on_backward_start`` before the first
node of every backward. A forward hook on the engine's module records the
autograd nodes that tell whether a pass uses the engine: its outputs', the
ZeRO-3 modules' inputs (the probe targets, see [Note: probe passes]) and the
parameters' ``AccumulateGrad`` nodes (those a graph holds, ``held_node``). If
the pass runs one of them (``_pass_start.will_run``: also the pass's root,
which autograd does not report) it starts (before ZeRO-3's hooks on the engine
output and on the modules) and queues the pass-end callback. So a pass may
start from any tensor of the forward, e.g. an activation inside the model, not
only from the engine's output. A pass that runs the parameters'
``AccumulateGrad`` nodes (recorded at entry) but none of the forwards' nodes
runs over a forward from before the block: refused (``FORWARD_OUTSIDE``), as
on FSDP1. A hook on each output of every ZeRO-3 module (the engine's module
included) of the block's forwards stays on its graph and refuses a backward
that reaches it after the block exited (``AFTER_EXIT``), also one that starts
inside the model: ZeRO-3 released the parameters that graph saved.

[Note: the engine's backward prologue in the block]
DeepSpeed runs ``engine._backward_prologue`` (``optimizer.enter_backward()``,
the post-backward callback that runs the epilogue for ``loss.backward()``)
from a once-per-forward hook on the engine's output tensors. Over a retained
graph that is wrong both ways: a pass that never reaches the output (it starts
at an activation inside the model) gets no prologue, so nothing flushes its
last gradient bucket under ``loss.backward()``; and with two forwards in the
block the second output's hook runs it on top of the block's, leaving
``backward_active_depth`` at 2 (then DeepSpeed skips the epilogue of every
later ``loss.backward()``); a forward from before the block has its hook
armed too (seen: one ``loss.backward()`` over a loss that mixes it with a
forward inside the block left gradients unreduced, off by 3e-3 with
``sync_grads="every"``, as plain DeepSpeed is for two forwards and one
``loss.backward()``). So, while the block is installed, the engine's
``_backward_prologue`` is shadowed by a no-op (``_prologue_from_output_hook``:
the output hooks' per-tensor gradient scaling still runs), and the block runs
the real one at the start of every pass that computes gradients
(``PartitionWrites._engine_prologue``). A ``loss.backward()`` pass that never reaches
an output misses that per-tensor division by ``gradient_accumulation_steps``: refused
when it is above 1 and the engine divides (``StepContract.check_pass``).
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

import torch
import torch.nn as nn

from .._common import (RetainError, eager_modules, module_parameters, queue_callback,
                       require_attr)
from .. import _pass_start
from .._kept_hooks import KeptHooks, kept_hooks, tree_signature
from ._engine import check_engine_common, flavour, zero_stage
from ._grads import PartitionSlots
from ._graph import ForwardGraph, ZeroParams, held_node
from ._nested import DeepSpeedSpan
from ._step import StepContract
from ._zero3_gather import RELEASE, Gathered
from ._zero3_reduce import PartitionWrites
from .._lifecycle import BlockBase
from .._loss_grads import GradSlots
from .._nested import Span, kernel_holds
from .._policy import RetainOptions
from .._probe import keep_probe_hooks

FORWARD_OUTSIDE = (
    "no_reshard_between_backwards: this backward reaches the DeepSpeed engine's "
    "parameters without going through a forward run inside the block: the forward "
    "ran before the block was entered (or the loss is computed from the parameters "
    "alone). The block re-arms ZeRO-3 only for its own forwards, so this pass would "
    "give wrong or unreduced gradients. Run the forward inside the block:\n"
    "    with no_reshard_between_backwards(engine):\n        out = engine(x)\n"
    "        engine.backward(loss1, retain_graph=True)\n        engine.backward(loss2)"
)

FORWARD_AFTER_HELD_PASS = (
    "no_reshard_between_backwards(sync_grads='last'): a forward of the DeepSpeed engine "
    "ran after a backward pass of the block whose gradients are still held unreduced; "
    "ZeRO-3 then gives wrong gradients (seen: the embedding's off by several units). "
    "Run every forward before the block's first backward pass, or use "
    "sync_grads='every'."
)


def check_engine(engine: Any) -> None:
    """``ValueError`` for the engine configurations this backend does not handle."""
    stage = zero_stage(engine)
    if stage != 3:
        raise ValueError(
            f"DeepSpeedBlock is the ZeRO-3 block, got stage {stage}: "
            "no_reshard_between_backwards picks DeepSpeedZero12Block for stages 0-2."
        )
    check_engine_common(engine, stage)
    offload = getattr(engine, "zero_offload_param", lambda: None)()
    if offload is not None and str(getattr(offload, "device", "none")).endswith(("cpu", "nvme")):
        raise ValueError(
            "no_reshard_between_backwards does not support ZeRO-3 parameter offload "
            "(offload_param); remove it from the DeepSpeed config."
        )
    if not hasattr(engine.optimizer, "parameter_offload"):
        raise ValueError(
            "no_reshard_between_backwards needs the engine's ZeRO-3 optimizer; pass an "
            "optimizer (or an optimizer config) to deepspeed.initialize."
        )


class DeepSpeedBlock(BlockBase):
    """One ``no_reshard_between_backwards`` block on a ZeRO-3 ``DeepSpeedEngine``."""

    def __init__(self, engine: Any, options: RetainOptions) -> None:
        if not isinstance(options.keep_unsharded, bool):
            raise ValueError(
                f"no_reshard_between_backwards(keep_unsharded={options.keep_unsharded}): a "
                "byte budget is supported on FSDP1 and FSDP2, not on DeepSpeed ZeRO-3. Pass "
                "keep_unsharded=True or False; ZeRO-3's own stage3_max_live_parameters and "
                "stage3_max_reuse_distance bound what it keeps."
            )
        check_engine(engine)
        super().__init__(engine, options)
        self._all_kept = self.policy.keeps_all
        self._flavour = flavour()
        self._optimizer = engine.optimizer
        offload = require_attr(self._optimizer, "parameter_offload", self._flavour)
        self._coordinator = require_attr(offload, "get_param_coordinator", self._flavour)()
        self._root: nn.Module = require_attr(engine, "module", self._flavour)
        self._kept: KeptHooks | None = None
        self._graph = ForwardGraph()  # the nodes of the block's forwards
        self._lookup = ZeroParams(self._root, _INPUTS_REFUSED)  # passes with inputs=
        self._params = module_parameters(self._root)  # the engine module's, walked once
        self._trainable = [p for p in self._params if p.requires_grad]
        self._gathered = Gathered(self._coordinator, self.policy.keeps_all)
        self._writes = PartitionWrites(engine, self.policy, self._graph, self._trainable,
                                       self._flavour)
        # See [Note: who steps and who scales on DeepSpeed] in _step.py.
        self._contract = StepContract(engine, self._flavour)

    # Entering and leaving (see BlockBase) #
    def _root_decided(self) -> bool:
        return True

    def _init_root(self) -> None:
        raise AssertionError("a DeepSpeed engine is set up by deepspeed.initialize")

    def _install(self) -> None:
        flavour = self._flavour
        require_attr(self.model, "_running_engine_backward", flavour)
        self._contract.check_entry()
        self._installed = True
        self._contract.install()
        self._gathered.install(flavour)
        # The engine's own prologue, run by the writes at each pass start; every
        # other call in the block is a forward's output hook (see the note).
        self._writes.install()
        self.model._backward_prologue = self._prologue_from_output_hook
        self._graph.acc_grads.extend(_nodes_from_before(self._params, flavour))
        # See [Note: hooks kept on the model] in fsdp_retain/_kept_hooks.py. The modules
        # ZeRO-3 hooks (pre_bwd_fn) are part of the key.
        signature = tree_signature(self._root)
        hooked = tuple("pre_bwd_fn" in module.__dict__ for module in signature[::2])
        self._kept = kept_hooks(self.model, (signature, hooked), self._keep_hooks)
        self._kept.block = self
        self._watch()

    def _keep_hooks(self, kept: KeptHooks) -> None:
        root, engine = self._root, self.model
        kept.add(root, root.register_forward_hook, attrgetter("_record_nodes"))
        kept.add(engine, engine.register_forward_pre_hook,
                 attrgetter("_refuse_forward_after_held"))
        units = [module for module in root.modules() if "pre_bwd_fn" in module.__dict__]
        guard = attrgetter("_guard_outputs")
        for unit in units:
            kept.add(unit, unit.register_forward_hook, guard)
        keep_probe_hooks(kept, units, eager_modules(root))

    # See [Note: per-loss gradients] in _loss_grads.py and _grads.py.
    def _check_grads(self) -> None:
        if self.model.fp16_enabled():
            raise ValueError(
                "block.grads() on DeepSpeed needs bf16 or fp32 training: with fp16, "
                "ZeRO-3's loss scale would be missing from the gradients it returns. "
                "Use \"bf16\": {\"enabled\": true} in the DeepSpeed config."
            )

    def _make_grad_slots(self) -> GradSlots:
        opt = self._optimizer
        params = [p for group in opt.fp16_groups for p in group]
        return PartitionSlots(self._writes, self._root, params, opt.dp_process_group)

    def _uninstall(self) -> None:
        self._graph.clear()
        if self._kept is not None:
            self._kept.block = None
            self._kept = None
        self._gathered.uninstall()
        self._contract.uninstall()
        self.model.__dict__.pop("_backward_prologue", None)
        self._writes.uninstall()
        self._release_model()

    def _finish(self) -> None:
        self.tracker.warn_if_short()
        self._writes.finish()
        self._gathered.release_all(self._params)
        self._contract.finish(self.tracker.wrote)

    def _abort(self) -> None:
        """Exception exit: no collectives (other ranks may not be here)."""
        self._writes.abort(self._params)
        self._gathered.release_all(self._params)

    def _open_span(self) -> Span:
        release = None if self.policy.keeps_all else RELEASE
        return DeepSpeedSpan(self._optimizer, list(self._params), self.probing,
                             self._coordinator, release)

    # Pass boundaries #
    def _record_nodes(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled() and not self._in_backward():
            # ZeRO-3 swaps only .data: a parameter's node records its full shape.
            self._graph.record(output, self._params, lambda p: p.ds_shape, self._flavour)

    def _guard_outputs(self, module: nn.Module, args: Any, output: Any) -> None:
        """Forward hook on each ZeRO-3 module: see ``backward_after_exit``. On the
        engine's outputs it runs before DeepSpeed's own hooks (registered later)."""
        if torch.is_grad_enabled() and not self._in_backward():
            self._graph.guard(output)

    def _refuse_forward_after_held(self, engine: Any, args: Any) -> None:
        # Also a cached loss's replay inside another model's backward.
        if self._writes.pending and torch.is_grad_enabled() and not self.tracker.in_backward:
            raise RetainError(FORWARD_AFTER_HELD_PASS)

    def on_backward_start(self) -> None:
        """Inside every backward, before its first node runs (see ``_pass_start``).

        That is inside ``loss.backward()``, so after what ``engine.backward`` does
        first (scale the loss, mark an engine backward running), and before
        ZeRO-3's hook on the engine output runs the engine's backward prologue
        (a no-op in the block, see [Note: the engine's backward prologue in the block]).
        """
        run = _pass_start.will_run
        reaches_output = any(map(run, self._graph.outputs))
        inputs = (edge.node for edge in self.probe_targets.edges())
        if not reaches_output and not any(map(run, inputs)):
            if any(map(run, self._graph.acc_grads)):
                raise RetainError(FORWARD_OUTSIDE)
            return  # another model's backward
        if not (self.probing or self.tracker.in_backward) and kernel_holds(self._trainable):
            return  # see [Note: passes a tiled kernel holds] in fsdp_retain/_nested.py
        self._contract.check_pass(reaches_output, self.probing)
        self._on_pass_start()
        queue_callback(self._on_pass_end)

    def _on_pass_start(self) -> None:
        index = self._start_pass()
        if not self.policy.keeps_all:  # per-module fetch and release on every pass
            self._gathered.rearm(self._root, first=index == 1)
        if not self.probing:
            self._writes.pass_start(index, _pass_start.will_run)

    def _prologue_from_output_hook(self) -> None:
        """The engine's ``_backward_prologue`` while the block is installed.

        DeepSpeed calls it from a once-per-forward hook on the engine output; the
        block runs the real one at each pass start instead (a no-op here). A forward
        from before the block still has that hook armed (see the note). A pass the
        block did not start runs inside another model's backward (a cached loss's
        replay from a hook on its loss, see [Note: nested backward passes]): it
        starts here, before any of its gradients.
        """
        # Not a top-level pass: DeepSpeed's hook on its root runs before _pass_start's.
        if self.nested.outside_block_pass and not self.tracker.in_backward:
            self._on_pass_start()
            inside_engine_backward = bool(self.model._running_engine_backward)
            queue_callback(self._on_replay_end if inside_engine_backward else self._on_pass_end)

    def _on_pass_end(self) -> None:
        self._end_pass()

    def _on_replay_end(self) -> None:
        """The end of a pass nested in ``engine.backward`` (a cached loss's replay under
        the Trainer): DeepSpeed runs no epilogue at the end of a pass inside
        ``engine.backward``, only after the whole of it, which would then find every
        replay's gradients in its bucket (ZeRO-3's duplicate-parameter assertion). The
        engine's epilogue reduces each replay, as it does after a ``loss.backward()``."""
        self._end_pass()
        if not self._writes.pending:
            self.model._backward_epilogue()


def _nodes_from_before(params: list[nn.Parameter], flavour: str) -> list[Any]:
    """The ``AccumulateGrad`` nodes that a graph from before the block holds
    (``held_node``: one made now would break the block's first forward)."""
    found = []
    for param in params:
        if param.requires_grad:
            node = held_node(param, getattr(param, "ds_shape", param.shape), flavour)
            if node is not None:
                found.append(node)
    return found


_INPUTS_REFUSED = (
    "loss.backward(inputs=<parameters>) inside no_reshard_between_backwards on a DeepSpeed "
    "ZeRO-3 engine is not supported: ZeRO-3's module hooks expect every module's backward "
    "to run, and a later pass over the same forward fails inside DeepSpeed after "
    "gradients were written. Run the pass without inputs= (FSDP1 and FSDP2 support it). "
    "Nothing was changed."
)
