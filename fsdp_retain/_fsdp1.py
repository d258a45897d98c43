"""FSDP1 (``FullyShardedDataParallel``) backend. All private FSDP1 access lives here.

See [Note: why a retained graph needs unsharded storage] in ``_common.py``.

What the block does to FSDP1, per ``FlatParamHandle`` (one per unit):

- Every reshard goes through ``_should_free``, the block's version of FSDP's
  ``_should_free_in_backward``: with ``keep_unsharded=True`` no unsharded flat
  parameter is freed (neither after forward nor after backward) until the
  last known pass or the block exit, so the forward's all-gather serves every
  backward. With ``keep_unsharded=False`` every pass frees, as FSDP does.
- After each pass (FSDP's root final callback has run) the block undoes what
  that callback assumes about "the" backward: it re-registers the post-backward
  hook on each ``AccumulateGrad`` (so later passes reduce gradients), and for
  units whose storage was freed it sets ``_needs_pre_backward_unshard`` again,
  puts back the forward's views ``FlatParameter._tensors`` that
  ``use_orig_params=True`` re-points in the pre-backward unshard, and the
  forward order FSDP uses for backward prefetching.
- ``sync_grads="last"`` runs the passes under ``_sync_gradients=False``, FSDP1's
  ``no_sync()`` state: unsharded gradients accumulate locally and are reduced
  by the last known pass, or at block exit by FSDP's own post-backward hook
  and final callback. Between passes ``.grad`` holds these local gradients, as
  in ``no_sync()``; a ``zero_grad()`` between passes is applied to them and to
  the gradients FSDP holds aside from before the block (``_record_sentinels``).
- ``create_graph=True`` backwards need ``keep_unsharded=True`` (refused
  otherwise); FSDP1's hooks work under it as long as nothing is re-gathered.
- Probe passes (see [Note: probe passes] in ``_common.py``) run under
  ``_sync_gradients=False``. The post-backward hooks on ``AccumulateGrad`` do
  not fire, so a gradient hook on each unit's input reshards the unit when
  its backward is done (``keep_unsharded=False``, or the last known pass),
  and what FSDP's pre-backward moved aside (a reduced ``.grad`` into
  ``_saved_grad_shard``) is put back when the pass ends.

Pass boundaries: a gradient hook on the root's forward outputs, registered
after FSDP's own pre-backward hook, starts a pass and queues a callback that
the autograd engine runs after FSDP's root final callback.

Graphs outlive the block: every unit's forward outputs also get a guard hook,
registered before FSDP's pre-backward hook, that stays on the graph and
raises a clear error if a backward reaches it after the block has exited
(the storage it needs is freed and FSDP's reduction hooks are gone).

Several forwards in one block with parameter mixed precision: each forward
casts the flat parameter to the low-precision dtype anew, which gives its
graph a new ``AccumulateGrad`` node, and FSDP1 hooks only the first forward's
node. The block hooks every forward's node and runs FSDP's post-backward hook
once per pass, after the last of them that the pass executes
(``_counted_post_backward``).
"""

from __future__ import annotations

import dataclasses
import functools
import traceback
import types
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ._common import (
    BlockBase,
    ACTIVE_ATTR,
    PassTracker,
    RetainOptions,
    create_graph_needs_keep,
    grad_tensors,
    missing_internal,
    require_attr,
    warn_once,
)

_FLAVOUR = "FSDP1"
# Where FSDP1 keeps a flat parameter's (AccumulateGrad, hook handle).
_HOOK_STATE = "_post_backward_hook_state"
# Names of torch.distributed.fsdp internals the block calls.
_RUNTIME_FUNCTIONS = (
    "_lazy_init",
    "_post_backward_hook",
    "_post_backward_final_callback",
    "_post_backward_reshard",
    "_reshard",
)


@functools.cache
def _internals() -> types.SimpleNamespace:
    """The private FSDP1 pieces the block uses, or an error naming the torch version."""
    try:
        from torch.distributed.fsdp import _runtime_utils
        from torch.distributed.fsdp._common_utils import (
            HandleTrainingState,
            TrainingState,
        )
    except ImportError as exc:
        raise missing_internal(str(exc), _FLAVOUR) from None
    found = {
        name: require_attr(_runtime_utils, name, _FLAVOUR) for name in _RUNTIME_FUNCTIONS
    }
    return types.SimpleNamespace(
        TrainingState=TrainingState,
        HandleTrainingState=HandleTrainingState,
        **{name.lstrip("_"): fn for name, fn in found.items()},
    )


def fsdp1_handles(model: nn.Module) -> list[Any]:
    """The ``FlatParamHandle`` of every FSDP1 unit under ``model`` that has parameters."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    handles = []
    for module in FullyShardedDataParallel.fsdp_modules(model):
        handle = require_attr(module, "_handle", _FLAVOUR)
        if handle is not None:
            handles.append(handle)
    return handles


def unsharded_storage_bytes(model: nn.Module) -> int:
    """Bytes held by the unsharded flat parameters of ``model`` (0 when all are freed)."""
    total = 0
    for handle in fsdp1_handles(model):
        if handle.uses_sharded_strategy:
            padded = require_attr(handle.flat_param, "_full_param_padded", _FLAVOUR)
            total += padded.untyped_storage().nbytes()
    return total


_STORAGES = ("_full_param_padded", "_mp_shard", "_full_prec_full_param_padded")


def fsdp1_snapshot(model: nn.Module) -> dict[str, Any]:
    """FSDP1 state the block may touch, for tests: flags, hooks, storage, gradients.

    Two snapshots taken between steps (outside any forward and backward) are
    equal when the block left nothing behind. Gradients appear only as "none
    or reduced", so a pass that was reduced before an exception does not count.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.modules import module as module_globals

    snap: dict[str, Any] = {
        "global_hooks": tuple(
            len(getattr(module_globals, name, ()))
            for name in (
                "_global_forward_pre_hooks",
                "_global_forward_hooks",
                "_global_backward_hooks",
                "_global_backward_pre_hooks",
            )
        ),
        "active": ACTIVE_ATTR in model.__dict__,
    }
    for name, module in model.named_modules():
        snap[f"{name}:hooks"] = (
            len(module._forward_pre_hooks),
            len(module._forward_hooks),
            len(module._backward_pre_hooks),
            len(module._backward_hooks),
        )
        if not isinstance(module, FullyShardedDataParallel):
            continue
        snap[f"{name}:state"] = (
            str(module.training_state),
            module._sync_gradients,
            module._is_root,
            getattr(module, "_post_backward_callback_queued", None),
            ACTIVE_ATTR in module.__dict__,
        )
        if module._is_root:
            order = module._exec_order_data
            snap[f"{name}:exec_order"] = len(order.handles_post_forward_order)
        handle = module._handle
        if handle is None:
            continue
        flat_param = handle.flat_param
        grad = flat_param.grad
        tensors = flat_param._tensors if handle._use_orig_params else None
        snap[f"{name}:handle"] = (
            str(handle._training_state),
            handle._needs_pre_backward_unshard,
            handle._ran_pre_backward_hook,
            handle._prefetched,
            handle._post_forward_index,
            tuple(sorted(k for k in ("reshard", "pre_unshard") if k in handle.__dict__)),
        )
        snap[f"{name}:flat_param"] = (
            tuple(flat_param.shape),
            flat_param.dtype,
            hasattr(flat_param, _HOOK_STATE),
            hasattr(flat_param, "_saved_grad_shard"),
            len(flat_param._backward_hooks or {}),
            len(getattr(flat_param, "_post_accumulate_grad_hooks", None) or {}),
            grad is None or grad.shape == flat_param.shape,
            None if tensors is None else tuple(t is None for t in tensors),
            tuple(
                getattr(flat_param, attr).untyped_storage().nbytes()
                for attr in _STORAGES
                if hasattr(flat_param, attr)
            ),
        )
    return snap


def _queue_callback(fn) -> None:
    from torch.autograd import Variable

    Variable._execution_engine.queue_callback(fn)


def _graph_task_id() -> int:
    """The running backward's id, -1 outside backward (as FSDP2 asks)."""
    get_id = getattr(torch._C, "_current_graph_task_id", None)
    return -1 if get_id is None else get_id()


def _acc_grad_node(flat_param: torch.Tensor) -> Any:
    """The ``AccumulateGrad`` node a graph built now would use, as FSDP1 finds it."""
    with torch.enable_grad():
        return flat_param.expand_as(flat_param).grad_fn.next_functions[0][0]


def _loud(fn):
    """Autograd may swallow errors raised in hooks and callbacks: print them first."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except BaseException:
            rank = dist.get_rank() if dist.is_initialized() else 0
            print(f"[rank {rank}] fsdp_retain FSDP1 error:\n{traceback.format_exc()}")
            raise

    return wrapper


@dataclasses.dataclass
class _Sentinel:
    """The ``.grad`` tensors a unit showed at the end of a pass (see ``_record_sentinels``)."""

    flat_grad: torch.Tensor | None
    version: int
    param_grads: tuple[torch.Tensor | None, ...]
    param_versions: tuple[int, ...]

    def changed_in_place(self) -> bool:
        # FSDP's unsharded gradient views (``no_sync``) do not share the flat
        # gradient's version counter, so look at both.
        return _version(self.flat_grad) != self.version or any(
            _version(g) != v for g, v in zip(self.param_grads, self.param_versions)
        )


_MISSING = object()


@_loud
def _unit_input_grad(block_ref: Any, state: Any, grad: torch.Tensor) -> None:
    # A weak reference: the hook stays on the graph, the block must not.
    block = block_ref()
    if block is not None and block.probing:
        block._probe_unit_done(state)


def _version(t: torch.Tensor | None) -> int:
    return -1 if t is None else t._version


class _Liveness:
    """Whether a block is still open; the only state the graph's guard hooks keep."""

    exited = False


_AFTER_EXIT = (
    "no_reshard_between_backwards: this backward runs over a graph whose forward ran "
    "inside a no_reshard_between_backwards block that has already exited. When the "
    "block ended, FSDP1 freed the unsharded parameters this graph saved and dropped "
    "its gradient-reduction hooks, so the pass would fail (setStorage ... storage of "
    "size 0) or leave gradients unreduced. Move this backward inside the block, "
    "before the `with` statement ends (or run a new forward for it)."
)


@_loud
def _backward_after_exit(alive: _Liveness, grad: torch.Tensor) -> None:
    # Runs before FSDP's pre-backward hook on the same tensor, so raising here
    # leaves FSDP untouched.
    if alive.exited:
        raise RuntimeError(_AFTER_EXIT)


def _multi_forward_unsupported() -> RuntimeError:
    return RuntimeError(
        "no_reshard_between_backwards: a second forward inside one block with FSDP1 "
        "parameter mixed precision needs torch._C._will_engine_execute_node and "
        f"torch._C._current_graph_task_id, which torch {torch.__version__} lacks. Run "
        "one forward per block (concatenate the inputs into one batch) or turn off "
        "MixedPrecision(param_dtype=...)."
    )


class FSDP1Block(BlockBase):
    """One ``no_reshard_between_backwards`` block on an FSDP1 root."""

    def __init__(self, model: nn.Module, options: RetainOptions) -> None:
        self.model = model
        self.options = options
        self.tracker = PassTracker(options.backwards)
        self._fsdp = _internals()
        self._phase = self._fsdp.HandleTrainingState
        if require_attr(model, "_is_root", _FLAVOUR) is False:
            raise ValueError(_non_root_message(model))
        if require_attr(model, "cpu_offload", _FLAVOUR).offload_params:
            raise ValueError(
                "no_reshard_between_backwards does not support FSDP1 with "
                "CPUOffload(offload_params=True): its gradients live in a CPU copy "
                "that FSDP1 only supports for one backward per iteration. Turn "
                "parameter offloading off for this model."
            )
        self._hooks: list[Any] = []
        self._states: list[Any] = []
        self._handles: list[tuple[Any, Any]] = []  # (state, handle)
        self._saved_sync: list[tuple[Any, bool]] = []
        self._freeing = False  # final pass started or block exiting
        self._pass_open = False
        # Captured after each forward, replayed before passes that re-gather.
        self._regather: set[Any] = set()
        self._forward_tensors: dict[Any, list[Any]] = {}
        self._forward_order: list[Any] = []
        self._forward_indices: dict[Any, int | None] = {}
        # The AccumulateGrad nodes of this block's forwards, first one first
        # (several only with parameter mixed precision), the hooks on the later
        # ones, and per handle [graph task, nodes fired, nodes expected].
        self._acc_grads: dict[Any, list[Any]] = {}
        self._counted_hooks: list[Any] = []
        self._counts: dict[Any, list[int]] = {}
        self._alive = _Liveness()  # shared with the guard hooks on the graph
        self._sentinels: dict[Any, _Sentinel] = {}
        self._unit_inputs = {}
        # Probe pass: each state's _sync_gradients and each handle's
        # (.grad, _saved_grad_shard) before it.
        self._probe_sync: list[tuple[Any, bool]] = []
        self._probe_grads: dict[Any, tuple[Any, Any]] = {}
        self._state_of: dict[Any, Any] = {}

    # Entering and leaving (see BlockBase) #
    def _root_decided(self) -> bool:
        return self.model._is_root is not None

    def _install_at_first_forward(self, module: nn.Module, args: Any) -> None:
        self._take_deferred_hook()
        if self.model._is_root is False:
            raise ValueError(_non_root_message(self.model))
        self._fsdp.lazy_init(self.model, self.model)
        self._install()
        self._capture_inputs(module, args, {})  # the new hook runs from the next forward

    def _install(self) -> None:
        self._states = list(require_attr(self.model, "_all_fsdp_states", _FLAVOUR))
        for state in self._states:
            handle = require_attr(state, "_handle", _FLAVOUR)
            if handle is not None:
                self._handles.append((state, handle))
        self._saved_sync = [
            (s, require_attr(s, "_sync_gradients", _FLAVOUR)) for s in self._states
        ]
        self._installed = True
        for _, handle in self._handles:
            original = require_attr(handle, "reshard", _FLAVOUR)
            handle.reshard = functools.partial(self._reshard, handle, original)
            if self.options.sync_grads == "last":
                original = require_attr(handle, "pre_unshard", _FLAVOUR)
                handle.pre_unshard = functools.partial(self._pre_unshard, handle, original)
        self._hooks.append(self.model.register_forward_hook(self._after_forward))
        for state in self._states:
            self._hooks.append(self.capture_unit_inputs(state))
            if state._handle is not None and state._handle.uses_sharded_strategy:
                hook = functools.partial(self._hook_unit_inputs, state)
                self._hooks.append(state.register_forward_pre_hook(hook, with_kwargs=True))
            # Inside FSDP's forward: before its post-forward registers the
            # pre-backward hooks, after its pre-forward unsharded the parameters.
            inner = require_attr(state, "_fsdp_wrapped_module", _FLAVOUR)
            self._hooks.append(inner.register_forward_hook(self._guard_outputs))
            handle = state._handle
            if handle is not None and handle.flat_param.requires_grad:
                capture = functools.partial(self._capture_acc_grad, state, handle)
                self._hooks.append(inner.register_forward_pre_hook(capture))
        if self.options.sync_grads == "last":
            for state in self._states:
                state._sync_gradients = False

    def _uninstall(self) -> None:
        self._alive.exited = True
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for _, handle in self._handles:
            handle.__dict__.pop("reshard", None)
            handle.__dict__.pop("pre_unshard", None)
        self._restore_sync()
        self._handles.clear()
        self._release_model()

    def _restore_sync(self) -> None:
        for state, value in self._saved_sync:
            state._sync_gradients = value

    def _finish(self) -> None:
        """Clean exit: reduce what is still unreduced, reshard everything."""
        self._freeing = True
        self.tracker.warn_if_short()
        self._check_sentinels()
        self._restore_sync()
        if self._needs_flush():
            self._flush_gradients()
        self._reshard_all()
        self._reset_iteration_state()

    def _abort(self) -> None:
        """Exception exit: no collectives (other ranks may not be here)."""
        self._freeing = True
        pending_local = self.options.sync_grads == "last" or self.tracker.in_backward
        self._restore_sync()
        self._reset_iteration_state()
        self._reshard_all()
        for _, handle in self._handles:
            self._drop_unreduced(handle, pending_local)

    # The keep/free decision #
    def _should_free(self, handle: Any, fsdp_free: bool) -> bool:
        """Whether a reshard of ``handle`` frees its unsharded flat parameter.

        ``fsdp_free`` is FSDP's own answer (``_post_forward_reshard``,
        ``_should_free_in_backward``). See [Note: why a retained graph needs
        unsharded storage].
        """
        if not handle.uses_sharded_strategy:
            return False
        phase = handle._training_state
        if phase == self._phase.FORWARD:  # post-forward reshard
            return fsdp_free and not self.options.keep_unsharded
        if phase in (self._phase.BACKWARD_PRE, self._phase.BACKWARD_POST):
            if self.options.keep_unsharded:
                return self._freeing
            # Free even where FSDP's no_sync() heuristic keeps SHARD_GRAD_OP
            # unsharded: keep_unsharded=False promises no memory between passes.
            return True
        return fsdp_free  # summon_full_params and the like

    def _reshard(self, handle: Any, original, free_unsharded_flat_param: bool) -> None:
        original(self._should_free(handle, free_unsharded_flat_param))

    # Forward and pass boundaries #
    @_loud
    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        self._regather = {h for _, h in self._handles if h._needs_pre_backward_unshard}
        self._forward_tensors = {
            h: list(h.flat_param._tensors)
            for _, h in self._handles
            if h._use_orig_params and h.flat_param._tensors is not None
        }
        order = require_attr(self.model, "_exec_order_data", _FLAVOUR)
        self._forward_order = list(order.handles_post_forward_order)
        self._forward_indices = {h: h._post_forward_index for _, h in self._handles}
        for t in grad_tensors(output):
            self._hooks.append(t.register_hook(self._pass_start_hook))

    def _guard_outputs(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        guard = functools.partial(_backward_after_exit, self._alive)
        for t in grad_tensors(output):
            t.register_hook(guard)  # lives as long as the graph

    def _capture_acc_grad(self, state: Any, handle: Any, module: nn.Module, args: Any) -> None:
        """Remembers the ``AccumulateGrad`` node this forward's graph uses.

        Not the flat parameter's node after the forward: with parameter mixed
        precision the forward ran on low-precision data, and switching
        ``.data`` to another dtype gives the parameter a new node.
        """
        if not torch.is_grad_enabled() or _graph_task_id() != -1:
            return  # no graph, or an activation-checkpointing recompute
        node = _acc_grad_node(handle.flat_param)
        nodes = self._acc_grads.setdefault(handle, [])
        if any(n is node for n in nodes):
            return
        nodes.append(node)
        if len(nodes) > 1:
            self._count_post_backward(state, handle)

    def _count_post_backward(self, state: Any, handle: Any) -> None:
        """Hooks a later forward's node; from now on every node of ``handle``
        runs ``_counted_post_backward`` instead of FSDP's hook."""
        if not all(
            hasattr(torch._C, name)
            for name in ("_will_engine_execute_node", "_current_graph_task_id")
        ):
            raise _multi_forward_unsupported()
        nodes = self._acc_grads[handle]
        hook = functools.partial(self._counted_post_backward, state, handle)
        flat_param = handle.flat_param
        if len(nodes) == 2:
            old = getattr(flat_param, _HOOK_STATE, None)
            if old is not None:
                old[-1].remove()
            # FSDP's final callback removes this one after each pass; the
            # pass end puts it back.
            setattr(flat_param, _HOOK_STATE, (nodes[0], nodes[0].register_hook(hook)))
        self._counted_hooks.append(nodes[-1].register_hook(hook))

    @_loud
    def _counted_post_backward(self, state: Any, handle: Any, *unused: Any) -> None:
        """FSDP's post-backward hook, once the last node of ``handle`` this pass runs
        has accumulated its gradient (as ``register_multi_grad_hook`` counts)."""
        task = _graph_task_id()
        count = self._counts.get(handle)
        if count is None or count[0] != task:
            expected = sum(map(torch._C._will_engine_execute_node, self._acc_grads[handle]))
            count = self._counts[handle] = [task, 0, expected]
        count[1] += 1
        if count[1] >= count[2]:
            del self._counts[handle]
            self._fsdp.post_backward_hook(state, handle, handle.flat_param)

    def _pass_start_hook(self, grad: torch.Tensor) -> None:
        if not self._pass_open:
            self._on_pass_start()

    @_loud
    def _on_pass_start(self) -> None:
        # FSDP's root pre-backward hook ran just before (registered first) and
        # queued its final callback; ours runs after it.
        if torch.is_grad_enabled() and not self.options.keep_unsharded:
            raise create_graph_needs_keep()
        self._pass_open = True
        _queue_callback(self._on_pass_end)
        index = self.tracker.begin()
        self._check_sentinels()  # units whose pre-backward has not run yet
        if self.options.backwards is not None and index >= self.options.backwards:
            self._freeing = True
            if not self.probing:
                self._restore_sync()

    @_loud
    def _on_pass_end(self) -> None:
        self._pass_open = False
        self.tracker.end()
        self._end_probe()
        fsdp = self._fsdp
        for state, handle in self._handles:
            flat_param = handle.flat_param
            nodes = self._acc_grads.get(handle)
            if nodes and not hasattr(flat_param, _HOOK_STATE):
                # FSDP's final callback removed it; later passes must reduce too.
                if len(nodes) == 1:
                    fn = functools.partial(fsdp.post_backward_hook, state, handle)
                else:
                    fn = functools.partial(self._counted_post_backward, state, handle)
                setattr(flat_param, _HOOK_STATE, (nodes[0], nodes[0].register_hook(fn)))
            if handle in self._regather:
                # The pre-backward unshard all-gathers only if the storage was
                # freed; it also shows the unsharded views that activation
                # checkpointing recomputes with.
                handle._needs_pre_backward_unshard = True
                tensors = self._forward_tensors.get(handle)
                if tensors is not None:
                    # use_orig_params=True re-points these views in the
                    # pre-backward unshard; FSDP dropped them after backward.
                    flat_param._tensors[:] = tensors
        # The forward order drives FSDP's backward prefetching.
        self.model._exec_order_data.handles_post_forward_order[:] = self._forward_order
        for _, handle in self._handles:
            handle._post_forward_index = self._forward_indices.get(handle)
        self._record_sentinels()

    # Probe passes #
    def _in_backward(self) -> bool:
        return _graph_task_id() != -1

    def _hook_unit_inputs(self, state: Any, module: nn.Module, args: Any, kwargs: Any) -> None:
        """Hooks the unit's inputs: their gradient is complete once the unit's
        backward is done, which in a probe pass is when it can be resharded."""
        if not torch.is_grad_enabled() or self._in_backward():
            return
        hook = functools.partial(_unit_input_grad, weakref.ref(self), state)
        for tensor in grad_tensors((args, kwargs)):
            tensor.register_hook(hook)  # lives as long as the graph

    def _probe_unit_done(self, state: Any) -> None:
        """What FSDP's post-backward hook would reshard, without reducing."""
        handle = state._handle
        if (self.options.keep_unsharded and not self._freeing) or handle.needs_unshard():
            return
        handle._training_state = self._phase.BACKWARD_POST
        self._fsdp.post_backward_reshard(state, handle)

    def _before_probe(self) -> None:
        # Apply a zero_grad() since the last pass first (sync_grads="last"), so
        # that the snapshot below is what the next normal pass must see.
        self._check_sentinels()
        self._probe_sync = [(s, s._sync_gradients) for s in self._states]
        for state in self._states:
            state._sync_gradients = False
        self._state_of = {handle: state for state, handle in self._handles}
        self._probe_grads = {
            handle: (
                handle.flat_param.grad,
                handle.flat_param.__dict__.get("_saved_grad_shard", _MISSING),
            )
            for _, handle in self._handles
        }

    def _end_probe(self) -> None:
        """Undoes what FSDP's pre-backward did to the gradients in a probe pass."""
        for state, value in self._probe_sync:
            state._sync_gradients = value
        self._probe_sync = []
        for handle, (grad, saved) in self._probe_grads.items():
            flat_param = handle.flat_param
            if handle._use_orig_params and not handle.uses_sharded_strategy:
                # NO_SHARD: the catch-all reshard takes the unit for resharded
                # (pytorch/pytorch#83956), so put back the parameter views that
                # the post-backward hook would have.
                state = self._state_of[handle]
                self._fsdp.reshard(state, handle, False)
                if flat_param.grad is not None:
                    handle._use_sharded_grad_views()
            now = flat_param.__dict__.get("_saved_grad_shard", _MISSING)
            if flat_param.grad is grad and now is saved:
                continue
            # prepare_gradient_for_backward() moved a reduced .grad aside.
            flat_param.grad = grad
            if saved is _MISSING:
                flat_param.__dict__.pop("_saved_grad_shard", None)
            else:
                flat_param._saved_grad_shard = saved
            if handle._use_orig_params:
                handle._use_sharded_grad_views()
        self._probe_grads = {}

    # Exit helpers #
    def _reshard_all(self) -> None:
        """Frees every unit's unsharded flat parameter; communicates nothing."""
        idle = self._phase.IDLE
        for state, handle in self._handles:
            handle._training_state = idle
            if handle.uses_sharded_strategy and not handle.needs_unshard():
                self._fsdp.reshard(state, handle, True)

    def _reset_iteration_state(self) -> None:
        """Leaves FSDP as its root final callback does after a backward."""
        for state in self._states:
            state.training_state = self._fsdp.TrainingState.IDLE
        self.model._post_backward_callback_queued = False
        self.model._exec_order_data.handles_post_forward_order.clear()
        for _, handle in self._handles:
            flat_param = handle.flat_param
            hook_state = getattr(flat_param, _HOOK_STATE, None)
            if hook_state is not None:
                hook_state[-1].remove()
                delattr(flat_param, _HOOK_STATE)
            handle._training_state = self._phase.IDLE
            handle._needs_pre_backward_unshard = False
            handle._ran_pre_backward_hook = False
            handle._prefetched = False
            handle._post_forward_index = None
            if handle._use_orig_params and flat_param._tensors is not None:
                # The forward's views, as FSDP drops them after a unit's backward
                # (also for units an exception kept from running backward).
                flat_param._tensors[:] = [None] * len(flat_param._tensors)
        for hook in self._counted_hooks:
            hook.remove()
        self._counted_hooks.clear()
        self._counts.clear()
        self._forward_tensors.clear()
        self._acc_grads.clear()
        self._regather.clear()
        self._sentinels.clear()

    def _drop_unreduced(self, handle: Any, pending_local: bool) -> None:
        flat_param = handle.flat_param
        grad = flat_param.grad
        if handle.uses_sharded_strategy:
            if grad is not None and grad.shape != flat_param._sharded_size:
                grad = None
            saved = flat_param.__dict__.pop("_saved_grad_shard", None)
            if grad is None:
                grad = saved
        elif pending_local:
            grad = None  # NO_SHARD: reduced and local gradients share one tensor
        flat_param.grad = grad
        if handle._use_orig_params:
            handle._use_sharded_grad_views()

    # sync_grads="last" #
    def _needs_flush(self) -> bool:
        if self.options.sync_grads != "last" or not all(s for _, s in self._saved_sync):
            return False  # nothing held back, or the user is inside FSDP's no_sync()
        return any(self._has_unreduced(h) for _, h in self._handles)

    @staticmethod
    def _has_unreduced(handle: Any) -> bool:
        flat_param = handle.flat_param
        return flat_param.grad is not None and getattr(
            flat_param, "_post_backward_called", False
        )

    def _flush_gradients(self) -> None:
        """Reduces the held-back gradients with FSDP's own post-backward path."""
        fsdp = self._fsdp
        for state in self._states:
            state.training_state = fsdp.TrainingState.FORWARD_BACKWARD
        for state, handle in self._handles:
            flat_param = handle.flat_param
            if self._has_unreduced(handle):
                handle._training_state = self._phase.BACKWARD_PRE
                fsdp.post_backward_hook(state, handle, flat_param)
            elif not hasattr(flat_param, "_saved_grad_shard"):
                # Nothing to hand to .grad (e.g. dropped by zero_grad()).
                flat_param._post_backward_called = False
        fsdp.post_backward_final_callback(self.model, self.model)

    def _record_sentinels(self) -> None:
        """Remembers the ``.grad`` each unit shows, to apply a ``zero_grad()`` later.

        With ``sync_grads="last"`` the gradients of earlier passes are local
        unsharded tensors in ``.grad`` (as in ``no_sync()``), while gradients
        from before the block sit aside in ``_saved_grad_shard``. FSDP alone
        would keep those, and with ``use_orig_params=True`` it zeroes a
        cleared parameter's gradient at its *sharded* offset in the unsharded
        gradient (``_writeback_orig_params``), i.e. the wrong elements.
        """
        self._sentinels.clear()
        if self.options.sync_grads != "last" or self._freeing:
            return
        for _, handle in self._handles:
            flat_param = handle.flat_param
            params = tuple(flat_param._params or ()) if handle._use_orig_params else ()
            grads = tuple(p.grad for p in params)
            if flat_param.grad is None and all(g is None for g in grads):
                continue
            self._sentinels[handle] = _Sentinel(
                flat_param.grad,
                _version(flat_param.grad),
                grads,
                tuple(_version(g) for g in grads),
            )

    def _check_sentinels(self) -> None:
        for handle in list(self._sentinels):
            self._check_sentinel(handle)

    def _pre_unshard(self, handle: Any, original) -> bool:
        # Before FSDP's gradient writeback in the pre-backward unshard.
        if handle._training_state == self._phase.BACKWARD_PRE:
            self._check_sentinel(handle)
        return original()

    def _check_sentinel(self, handle: Any) -> None:
        sentinel = self._sentinels.pop(handle, None)
        if sentinel is None:
            return
        flat_param = handle.flat_param
        if not handle._use_orig_params:
            grad = flat_param.grad
            if not hasattr(flat_param, "_saved_grad_shard"):
                return
            if grad is not sentinel.flat_grad:
                del flat_param._saved_grad_shard  # set to None or replaced
            elif sentinel.changed_in_place():
                if not grad.any():
                    del flat_param._saved_grad_shard  # zeroed in place
                else:
                    _warn_in_place()
            return
        params = flat_param._params
        if all(p.grad is None for p in params):
            flat_param.grad = None
            flat_param.__dict__.pop("_saved_grad_shard", None)
            return
        cleared = [
            i
            for i, (param, old) in enumerate(zip(params, sentinel.param_grads))
            if old is not None and param.grad is None
        ]
        if cleared:
            for i in cleared:
                sentinel.param_grads[i].zero_()  # a view into the flat gradient
            # Show them again, so FSDP's writeback has nothing to "fix".
            handle._use_unsharded_grad_views()
        if not hasattr(flat_param, "_saved_grad_shard"):
            return
        if sentinel.changed_in_place():
            zeroed = {
                i
                for i, g in enumerate(sentinel.param_grads)
                if g is not None and not g.any()
            }
            cleared = sorted(set(cleared) | zeroed)
        self._zero_saved_shard(handle, cleared)

    @staticmethod
    def _zero_saved_shard(handle: Any, indices: list[int]) -> None:
        flat_param = handle.flat_param
        saved = flat_param._saved_grad_shard
        for i in indices:
            info = flat_param._shard_param_infos[i]
            if info.in_shard:
                offset = info.offset_in_shard
                saved[offset : offset + info.numel_in_shard].zero_()


def _warn_in_place() -> None:
    warn_once(
        "fsdp1-inplace-grad",
        "fsdp_retain: with sync_grads='last', FSDP1 keeps gradients from before the "
        "block apart from .grad (in _saved_grad_shard); an in-place change of .grad "
        "between passes reaches them only where it zeroes a whole parameter.",
    )


def _non_root_message(model: nn.Module) -> str:
    return (
        f"no_reshard_between_backwards got a non-root FSDP1 unit "
        f"({type(model).__name__}): another FullyShardedDataParallel module ran "
        "forward first and became the root. Pass that outermost "
        "FullyShardedDataParallel module, whose forward runs the others."
    )
