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
  pass, so every pass re-gathers and frees per module.
- Gradients: ZeRO-3 reduce-scatters each parameter's gradient from its
  ``AccumulateGrad`` hook into a gradient partition, copying over it while
  ``micro_step_id == 0``. A pass after one that reduced runs with
  ``micro_step_id >= 1`` (restored at exit), so it adds. The engine's backward
  prologue runs once per forward (a hook on the forward output); each later
  pass runs it again, so the post-backward epilogue flushes the last bucket
  for ``loss.backward()`` too.
- ``sync_grads="last"``: ``optimizer._coalesce_grad_reduction`` (what
  ``engine.coalesce_grad_reduction()`` sets) keeps the unsharded gradients
  local until the last pass reduces them, or the block exit does.
- Probe passes (see [Note: probe passes] in ``_common.py``): every module
  ZeRO-3 put hooks on is a unit, its inputs are the probe's targets; no
  ``AccumulateGrad`` runs, so no reduce hook fires, and the pass skips the
  engine prologue and the partition bookkeeping above.

Pass boundaries: ``_pass_start`` runs ``on_backward_start`` before the first
node of every backward. A forward hook on the engine's module records the
autograd nodes that tell whether a pass uses the engine: its outputs', the
ZeRO-3 modules' inputs (the probe targets, see [Note: probe passes]) and the
parameters' ``AccumulateGrad`` nodes. If the pass runs one of them it starts
(before ZeRO-3's hooks on the engine output and on the modules) and queues
the pass-end callback. So a pass may start from any tensor of the forward,
e.g. an activation inside the model, not only from the engine's output.
"""

from __future__ import annotations

import itertools
import sys
from typing import Any

import torch
import torch.nn as nn

from . import _pass_start
from ._common import RetainError, grad_tensors, queue_callback, require_attr
from ._lifecycle import BlockBase
from ._policy import RetainOptions

_RELEASE = "_PartitionedParameterCoordinator__release_param"
_COUNTERS = ("applied_pre_backward_ref_cnt", "ds_grads_remaining")


def _flavour() -> str:
    ds = sys.modules.get("deepspeed")
    version = getattr(ds, "__version__", "?")
    return f"DeepSpeed {version} ZeRO-3"


def is_deepspeed_engine(model: object) -> bool:
    """True for a ``DeepSpeedEngine``; False (without importing it) if deepspeed is not loaded."""
    if "deepspeed" not in sys.modules:
        return False
    engine_module = sys.modules.get("deepspeed.runtime.engine")
    cls = getattr(engine_module, "DeepSpeedEngine", None)
    return cls is not None and isinstance(model, cls)


def check_engine(engine: Any) -> None:
    """``ValueError`` for the engine configurations this backend does not handle."""
    stage = int(require_attr(engine, "zero_optimization_stage", _flavour())())
    if stage != 3:
        raise ValueError(
            f"no_reshard_between_backwards supports DeepSpeed ZeRO stage 3, got stage "
            f"{stage}. Stages 0-2 keep full parameters, so several backward passes "
            "over a retained graph run without the block, but fsdp_retain has not "
            "verified their gradients; set zero_optimization.stage to 3 to use it."
        )
    if getattr(engine, "pipeline_parallelism", False):
        raise ValueError(
            "no_reshard_between_backwards does not support DeepSpeed pipeline "
            "parallelism (PipelineEngine); use a plain ZeRO-3 engine."
        )
    active = getattr(engine, "is_deepcompile_active", None)
    if active is not None and active():
        raise ValueError(
            "no_reshard_between_backwards does not support DeepCompile: it replaces "
            "ZeRO-3's hooks. Disable compile.deepcompile in the DeepSpeed config."
        )
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
        self._flavour = _flavour()
        self._optimizer = engine.optimizer
        offload = require_attr(self._optimizer, "parameter_offload", self._flavour)
        self._coordinator = require_attr(offload, "get_param_coordinator", self._flavour)()
        self._root: nn.Module = require_attr(engine, "module", self._flavour)
        self._hooks: list[Any] = []
        # Autograd nodes of the forwards in the block (with the probe targets):
        # the engine module's outputs, and its parameters' AccumulateGrad nodes.
        self._output_nodes: list[Any] = []
        self._acc_grads: list[Any] = []
        self._counters: dict[nn.Module, tuple[int, int]] = {}
        self._reduced = False  # a pass of this block reduce-scattered
        self._bumped_micro_step = False
        self._pending = False  # "last": unreduced gradients held in .grad
        self._saved_coalesce: bool | None = None

    # Entering and leaving (see BlockBase) #
    def _root_decided(self) -> bool:
        return True

    def _init_root(self) -> None:
        raise AssertionError("a DeepSpeed engine is set up by deepspeed.initialize")

    def _install(self) -> None:
        flavour = self._flavour
        require_attr(self.model, "_backward_prologue", flavour)
        require_attr(self._optimizer, "_backward_hook_state", flavour)
        require_attr(self._optimizer, "micro_step_id", flavour)
        self._saved_coalesce = require_attr(self._optimizer, "_coalesce_grad_reduction", flavour)
        release = require_attr(self._coordinator, _RELEASE, flavour)
        self._installed = True
        if self.policy.keeps_all:
            setattr(self._coordinator, _RELEASE, _keep_gathered)
        if self.policy.holds_back:
            self._optimizer._coalesce_grad_reduction = True
        self._release = release
        self.model.step = _step_inside_block
        self._hooks.append(self._root.register_forward_hook(self._record_nodes))
        for module in self._root.modules():
            if "pre_bwd_fn" in module.__dict__:
                self._hooks.append(self.probe_targets.hook_unit(module))
        self._hooks.extend(self.probe_targets.hook_sources(self._root))
        self._watch()

    def _uninstall(self) -> None:
        self._output_nodes.clear()
        self._acc_grads.clear()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._coordinator.__dict__.pop(_RELEASE, None)
        self.model.__dict__.pop("step", None)
        if self._saved_coalesce is not None:
            self._optimizer._coalesce_grad_reduction = self._saved_coalesce
        self._release_model()

    def _finish(self) -> None:
        self.tracker.warn_if_short()
        if self._pending:
            self._flush_gradients()
        self._restore_micro_step()
        self._release_all()

    def _abort(self) -> None:
        """Exception exit: no collectives (other ranks may not be here)."""
        for param in self._root.parameters():
            param.grad = None
        for bucket in getattr(self._optimizer, "ipg_buckets", {}).values():
            bucket.params.clear()
            bucket.elements = 0
        self._optimizer._backward_hook_state.backward_active_depth = 0
        self._pending = False
        self._restore_micro_step()
        self._release_all()

    def _release_all(self) -> None:
        """Frees every gathered parameter locally and resets ZeRO-3's hook counters."""
        self._coordinator.__dict__.pop(_RELEASE, None)
        self._coordinator.release_backward_leftovers()
        for param in self._root.parameters():
            if getattr(param, "ds_persist", False):
                continue
            param.ds_active_sub_modules.clear()
            self._release(param)
        for module in self._counters:
            for name in _COUNTERS:
                setattr(module, name, 0)
        self._counters.clear()

    # Pass boundaries #
    def _record_nodes(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled() or self._in_backward():
            return
        self._output_nodes.extend(t.grad_fn for t in grad_tensors(output) if t.grad_fn is not None)
        if self._acc_grads:
            return  # held here, so every later forward's graph uses the same nodes
        for param in self._root.parameters():
            if param.requires_grad:
                # The node this forward's graph holds (ZeRO-3 swaps only .data).
                self._acc_grads.append(param.expand_as(param).grad_fn.next_functions[0][0])

    def on_backward_start(self) -> None:
        """Inside every backward, before its first node runs (see ``_pass_start``).

        That is inside ``loss.backward()``, so after what ``engine.backward`` does
        first (scale the loss, mark an engine backward running), and before
        ZeRO-3's hook on the engine output runs the engine's backward prologue
        (a forward's first pass; ``_restart_engine_backward`` runs it in later ones).
        """
        run = _pass_start.will_run
        inputs = (edge.node for edge in self.probe_targets.edges.values())
        nodes = itertools.chain(self._output_nodes, inputs, self._acc_grads)
        if not any(map(run, nodes)):
            return  # another model's backward
        self._on_pass_start()
        queue_callback(self._on_pass_end)

    def _on_pass_start(self) -> None:
        index = self._start_pass()
        if not self.policy.keeps_all:
            self._rearm_module_hooks(first=index == 1)
        if self.probing:
            return
        if self.policy.holds_back and self.policy.is_last(index):
            self._optimizer._coalesce_grad_reduction = self._saved_coalesce
        reduces = not self._optimizer._coalesce_grad_reduction
        if self._reduced and reduces:
            self._accumulate_into_partitions()
        if index > 1:
            self._restart_engine_backward()
        self._reduced = self._reduced or reduces
        self._pending = not reduces

    def _on_pass_end(self) -> None:
        self._end_pass()

    # keep_unsharded=False: per-module fetch and release on every pass #
    def _rearm_module_hooks(self, first: bool) -> None:
        if first:
            self._counters = {
                m: tuple(getattr(m, name, 0) for name in _COUNTERS)
                for m in self._root.modules()
                if "pre_bwd_fn" in m.__dict__
            }
            return
        for module, values in self._counters.items():
            for name, value in zip(_COUNTERS, values):
                setattr(module, name, value)

    # Gradients #
    def _accumulate_into_partitions(self) -> None:
        """Makes this pass add to the reduced partitions instead of overwriting them."""
        opt = self._optimizer
        # optimizer.zero_grad() since the last pass clears both: copy, dropping it.
        if opt.micro_step_id == 0 and opt._epilogue_ran_this_backward:
            opt.micro_step_id = 1
            self._bumped_micro_step = True

    def _restore_micro_step(self) -> None:
        # optimizer.zero_grad() in between already set it back to 0.
        if self._bumped_micro_step and self._optimizer.micro_step_id == 1:
            self._optimizer.micro_step_id = 0
        self._bumped_micro_step = False

    def _restart_engine_backward(self) -> None:
        """Runs the engine's once-per-forward backward prologue for this pass too."""
        state = self._optimizer._backward_hook_state
        state.backward_active_depth = 0
        state.backward_seen_this_step = False  # enter_backward then resets its counters
        self.model._backward_prologue()

    def _flush_gradients(self) -> None:
        """Reduce-scatters the held-back gradients, as ``coalesce_grad_reduction`` does."""
        opt = self._optimizer
        opt._coalesce_grad_reduction = self._saved_coalesce
        self._pending = False
        for group in opt.fp16_groups:
            for param in group:
                if param.requires_grad and param.grad is not None:
                    opt.reduce_ready_partitions_and_remove_grads(param)
        opt.independent_gradient_partition_epilogue()


def _step_inside_block(*args: Any, **kwargs: Any) -> None:
    raise RetainError(
        "engine.step() was called inside no_reshard_between_backwards: the block still "
        "holds parameters and gradients for later passes. Call engine.step() after the "
        "block (with accelerate, the last pass must not go through accelerator.backward, "
        "which steps the engine; use engine.backward)."
    )


def _keep_gathered(param: Any, free_data: bool = True) -> None:
    """Stands in for the coordinator's release while ``keep_unsharded=True``."""
