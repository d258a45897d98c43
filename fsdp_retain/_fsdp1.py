"""FSDP1 (``FullyShardedDataParallel``) backend. All private FSDP1 access lives here,
in ``_fsdp1_grads.py`` (what the block does to the gradients FSDP1 holds) and in
``_fsdp1_inspect.py`` (readers for tests and the report).

See [Note: why a retained graph needs unsharded storage] in ``_common.py``.

What the block does to FSDP1, per ``FlatParamHandle`` (one per unit):

- Every reshard goes through ``_should_free``, the block's version of FSDP's
  ``_should_free_in_backward``: with ``keep_unsharded=True`` no unsharded flat
  parameter is freed (neither after forward nor after backward) until the
  last known pass or the block exit, so the forward's all-gather serves every
  backward. With ``keep_unsharded=False`` every pass frees, as FSDP does. A
  byte budget (``keep_unsharded=<int>``) keeps the handles ``kept_units`` in
  ``_common.py`` picks and frees the others per pass (FSDP1's backward
  prefetch re-gathers them ahead, from the forward order the pass end replays).
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

Pass boundaries: ``_pass_start`` runs ``on_backward_start`` before the first
node of every backward. If the pass reaches this model, the block queues
FSDP's root final callback (unless FSDP's root pre-backward hook already did)
and then its own, which the engine runs after FSDP's. A pass may start from
any tensor of the forward, so FSDP's pre-backward hooks on unit outputs may
run late (a ``create_graph=True`` gradient graph reaches parameters first) or
never (an activation inside a unit). The block therefore does a unit's
pre-backward work itself at the pass start (``_pre_backward``): with
``keep_unsharded=True`` for every unit whose gradients the pass accumulates;
with ``False`` for units the pass uses but whose outputs it never reaches
(all-gathering them then). Units whose pre-backward ran but that accumulate
nothing in the pass (``autograd.grad``, probe passes) get back the gradients
FSDP's pre-backward moved aside, which its final callback would drop. With
``backwards=N`` and ``sync_grads="last"``, units the last pass does not reach
are reduced at the block exit.

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

import functools
import traceback
import types
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from . import _pass_start
from ._common import (
    BlockBase,
    PassTracker,
    RetainOptions,
    compiling,
    create_graph_needs_keep,
    eager_modules,
    grad_tensors,
    is_compiled_in_place,
    kept_units,
    missing_internal,
    require_attr,
)
from ._fsdp1_grads import GradBookkeeping
from ._fsdp1_guards import (
    FORWARD_OUTSIDE,
    NOT_REDUCED,
    PostBackwardCheck,
    check_sharded_grads,
    unit_names,
)
from ._fsdp1_inspect import HOOK_STATE as _HOOK_STATE

_FLAVOUR = "FSDP1"
# Names of torch.distributed.fsdp internals the block calls.
_RUNTIME_FUNCTIONS = (
    "_lazy_init",
    "_post_backward_hook",
    "_post_backward_final_callback",
    "_post_backward_reshard",
    "_prefetch_handle",
    "_PrefetchMode",
    "_register_post_backward_final_callback",
    "_reset_flat_param_grad_info_if_needed",
    "_reshard",
    "_unshard",
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


def _queue_callback(fn) -> None:
    from torch.autograd import Variable

    Variable._execution_engine.queue_callback(fn)


def _graph_task_id() -> int:
    """The running backward's id, -1 outside backward (``_pass_start`` checked it exists)."""
    return torch._C._current_graph_task_id()


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


@_loud
def _unit_input_grad(block_ref: Any, state: Any, grad: torch.Tensor) -> None:
    # A weak reference: the hook stays on the graph, the block must not.
    block = block_ref()
    if block is not None and block.probing:
        block._probe_unit_done(state)


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


_GRADS_OF_GRADS = (
    "no_reshard_between_backwards: this backward has create_graph=True and accumulates "
    "into FSDP1 parameters' .grad, which FSDP1 cannot reduce (\"FSDP does not support "
    "gradients of gradients\"). Nothing was changed. Build the inner gradient with "
    "torch.autograd.grad(..., create_graph=True) and backpropagate the outer loss "
    "with a plain .backward() in a later pass of the same block."
)


class FSDP1Block(GradBookkeeping, BlockBase):
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
        self._sentinels: dict[Any, Any] = {}  # see _fsdp1_grads
        self._unit_inputs = {}
        # Probe pass: each state's _sync_gradients and each handle's
        # (.grad, _saved_grad_shard) before it.
        self._probe_sync: list[tuple[Any, bool]] = []
        # Each handle's (.grad, _saved_grad_shard) before the running pass, and
        # the handles whose AccumulateGrad it runs.
        self._grads_before: dict[Any, tuple[Any, Any]] = {}
        self._had_sentinels = False
        self._accumulating: set[Any] = set()
        self._state_of: dict[Any, Any] = {}
        # The autograd nodes of each unit's forward outputs, and of the outputs
        # of the modules inside it (a pass that runs one of them uses the unit).
        self._output_nodes: dict[Any, list[Any]] = {}
        self._inner_nodes: dict[Any, list[Any]] = {}
        self._unit_of: dict[int, Any] = {}  # id(module inside a unit) -> its handle
        self._watching = False
        # See [Note: what the FSDP1 guards check] in _fsdp1_guards.py.
        self._post_backward = PostBackwardCheck()
        self._outside: dict[Any, Any] = {}  # handle -> node of a forward before the block
        self._names: dict[Any, str] = {}
        self._kept: set[Any] = set()  # handles kept unsharded between passes
        self._all_kept = False

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
        self._state_of = {handle: state for state, handle in self._handles}
        units = {id(state) for state in self._state_of.values()}
        self._names = {  # for errors
            module._handle: name.replace("_fsdp_wrapped_module.", "") or "<root>"
            for name, module in self.model.named_modules()
            if id(module) in units
        }
        # A forward with grad that ran before the block and whose backward has
        # not run: FSDP1 hooked its AccumulateGrad node and still holds it.
        self._outside = {
            h: node for _, h in self._handles if (node := _hooked_node(h)) is not None
        }
        self._hooks.extend(self._post_backward.install(h for _, h in self._handles))
        self._kept = kept_units(self._backward_order(), self.options.keep_unsharded)
        self._all_kept = len(self._kept) == len(self._handles)
        self._installed = True
        _pass_start.watch(self)
        self._watching = True
        for _, handle in self._handles:
            original = require_attr(handle, "reshard", _FLAVOUR)
            handle.reshard = functools.partial(self._reshard, handle, original)
            if self.options.sync_grads == "last":
                original = require_attr(handle, "pre_unshard", _FLAVOUR)
                handle.pre_unshard = functools.partial(self._pre_unshard, handle, original)
        self._hooks.append(self.model.register_forward_hook(self._after_forward))
        self._hooks.extend(self.capture_sources(self.model))
        for state in self._states:
            self._hooks.append(self.capture_unit_inputs(state))
            if state._handle is not None and state._handle.uses_sharded_strategy:
                hook = functools.partial(self._hook_unit_inputs, state)
                self._hooks.append(state.register_forward_pre_hook(hook, with_kwargs=True))
            # Inside FSDP's forward: before its post-forward registers the
            # pre-backward hooks, after its pre-forward unsharded the parameters.
            inner = require_attr(state, "_fsdp_wrapped_module", _FLAVOUR)
            # No hook inside a compiled region: see [Note: the block under torch.compile].
            inner_eager = not is_compiled_in_place(inner)
            if inner_eager:
                self._hooks.append(inner.register_forward_hook(self._guard_outputs))
            if state._handle is not None:
                # The outputs FSDP's pre-backward hooks are on: what the unit
                # returns (other module hooks may wrap the inner module's).
                record = functools.partial(self._record_nodes, self._output_nodes, state._handle)
                self._hooks.append(state.register_forward_hook(record))
                capture = functools.partial(self._capture_fsdp_node, state._handle)
                self._hooks.append(state.register_forward_hook(capture))
                # One hook object for all inner modules: dynamo guards on a
                # module's hooks, so per-unit partials would recompile each unit.
                for module in eager_modules(inner, stop=_is_fsdp1_unit):
                    self._unit_of[id(module)] = state._handle
                    self._hooks.append(module.register_forward_hook(self._record_inner))
            handle = state._handle
            if handle is not None and handle.flat_param.requires_grad and inner_eager:
                capture = functools.partial(self._capture_acc_grad, state, handle)
                self._hooks.append(inner.register_forward_pre_hook(capture))
        if self.options.sync_grads == "last":
            for state in self._states:
                state._sync_gradients = False

    def _backward_order(self) -> list[tuple[Any, int]]:
        """Handles with their unsharded bytes, the root's first, then the others in
        reverse module order (the order their backward runs; see ``kept_units``)."""
        handles = [h for _, h in self._handles]
        root = [h for s, h in self._handles if s is self.model]
        rest = [h for h in handles if h not in root]
        return [
            (h, _unsharded_bytes(h) if h.uses_sharded_strategy else 0)
            for h in root + rest[::-1]
        ]

    def _uninstall(self) -> None:
        self._alive.exited = True
        if self._watching:
            _pass_start.unwatch(self)
            self._watching = False
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
            return fsdp_free and handle not in self._kept
        # _pass_open: also FSDP's catch-all reshard of units the pass never reached.
        if phase in (self._phase.BACKWARD_PRE, self._phase.BACKWARD_POST) or self._pass_open:
            if handle in self._kept:
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
        if compiling() or not torch.is_grad_enabled():
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

    def _guard_outputs(self, module: nn.Module, args: Any, output: Any) -> None:
        if compiling() or not torch.is_grad_enabled():
            return
        guard = functools.partial(_backward_after_exit, self._alive)
        for t in grad_tensors(output):
            t.register_hook(guard)  # lives as long as the graph

    def _record_inner(self, module: nn.Module, args: Any, output: Any) -> None:
        if compiling():
            return  # before touching `module`: dynamo would guard on its identity
        handle = self._unit_of.get(id(module))
        if handle is not None:
            self._record_nodes(self._inner_nodes, handle, module, args, output)

    @staticmethod
    def _record_nodes(where: dict, handle: Any, module: nn.Module, args: Any, output: Any) -> None:
        if not compiling() and torch.is_grad_enabled() and _graph_task_id() == -1:
            nodes = where.setdefault(handle, [])
            nodes.extend(t.grad_fn for t in grad_tensors(output) if t.grad_fn is not None)

    def _capture_acc_grad(self, state: Any, handle: Any, module: nn.Module, args: Any) -> None:
        """Remembers the ``AccumulateGrad`` node this forward's graph uses.

        Not the flat parameter's node after the forward: with parameter mixed
        precision the forward ran on low-precision data, and switching
        ``.data`` to another dtype gives the parameter a new node.
        """
        if compiling() or not torch.is_grad_enabled() or _graph_task_id() != -1:
            return  # no graph, or an activation-checkpointing recompute
        node = _acc_grad_node(handle.flat_param)
        nodes = self._acc_grads.setdefault(handle, [])
        if any(n is node for n in nodes):
            return
        nodes.append(node)
        if len(nodes) > 1:
            self._count_post_backward(state, handle)

    def _capture_fsdp_node(self, handle: Any, module: nn.Module, args: Any, output: Any) -> None:
        """The node FSDP1 hooked in this unit's forward, when the unit's inner forward
        ran without grad (reentrant activation checkpointing inside the unit: the
        graph that accumulates into it is only built in each pass's recompute)."""
        if compiling() or not torch.is_grad_enabled() or _graph_task_id() != -1:
            return
        if self._acc_grads.get(handle):
            return
        node = _hooked_node(handle)
        if node is not None:
            self._acc_grads[handle] = [node]

    def _count_post_backward(self, state: Any, handle: Any) -> None:
        """Hooks a later forward's node; from now on every node of ``handle``
        runs ``_counted_post_backward`` instead of FSDP's hook."""
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

    # Called by _pass_start around every backward while installed #
    def before_backward(self) -> None:
        """Outside the engine, before any hook of the pass has moved a gradient."""
        if self._exited or self._pass_open:
            return
        self._had_sentinels = bool(self._sentinels)
        self._check_sentinels()  # a zero_grad() since the last pass
        self._snapshot_grads()
        self._post_backward.begin_pass()

    @_loud
    def on_backward_start(self) -> None:
        """Inside the pass, before its first node runs."""
        if self._exited or self._pass_open:
            return
        run = _pass_start.will_run
        self._check_not_outside(run)
        uses = {
            handle
            for _, handle in self._handles
            if any(map(run, self._acc_grads.get(handle, ())))
            or any(map(run, self._inner_nodes.get(handle, ())))
            or any(map(run, self._output_nodes.get(handle, ())))
        }
        if not uses:  # another model's backward
            self._grads_before = {}
            if self._had_sentinels:
                self._record_sentinels()  # still watch for a zero_grad() before our next pass
            return
        self._accumulating = {
            h for h in uses if any(map(run, self._acc_grads.get(h, ())))
        }
        if torch.is_grad_enabled() and self._accumulating and not self.probing:
            raise RuntimeError(_GRADS_OF_GRADS)
        self._on_pass_start()
        for state, handle in self._handles:
            if handle in uses and not handle._ran_pre_backward_hook and self._runs_early(handle):
                self._pre_backward(state, handle)
        if self._freeing and self.options.sync_grads == "last" and not self.probing:
            # The last pass reduces what it accumulates into; the rest at exit.
            for state, handle in self._handles:
                if handle not in self._accumulating:
                    state._sync_gradients = False

    def _check_not_outside(self, run) -> None:
        """Refuses a pass over a forward that ran before the block, before any node runs."""
        outside = [
            h
            for h, node in self._outside.items()
            if run(node)
            and not any(map(run, self._output_nodes.get(h, ())))
            and not any(map(run, self._inner_nodes.get(h, ())))
        ]
        if outside:
            raise RuntimeError(FORWARD_OUTSIDE.format(units=self._unit_names(outside)))

    def _unit_names(self, handles) -> str:
        return unit_names(handles, lambda h: self._names.get(h, "?"))

    def _runs_early(self, handle: Any) -> bool:
        """Whether the block must do ``handle``'s pre-backward at the pass start."""
        if handle in self._kept:
            # Nothing to gather: prepare every unit the pass accumulates into,
            # so no AccumulateGrad runs before FSDP's hook would have.
            return handle in self._accumulating
        # A first-order pass over the forward reaches a unit's parameters only
        # after its outputs, unless it starts inside the unit.
        return not any(map(_pass_start.will_run, self._output_nodes.get(handle, ())))

    def _pre_backward(self, state: Any, handle: Any) -> None:
        """FSDP1's per-unit pre-backward hook, for a pass that reaches the unit's
        parameters before (or without) its outputs."""
        fsdp = self._fsdp
        state.training_state = fsdp.TrainingState.FORWARD_BACKWARD
        handle._training_state = self._phase.BACKWARD_PRE
        if handle._needs_pre_backward_unshard:
            if not handle._prefetched:
                fsdp.unshard(state, handle, state._unshard_stream, state._pre_unshard_stream)
            state._device_handle.current_stream().wait_stream(state._unshard_stream)
        handle._needs_pre_backward_unshard = False
        # FSDP's hook, which now returns early, would prefetch the unit next in
        # backward order here (a re-gathered unit after a kept one).
        fsdp.prefetch_handle(state, handle, fsdp.PrefetchMode.BACKWARD)
        handle.prepare_gradient_for_backward()
        handle._ran_pre_backward_hook = True

    @_loud
    def _on_pass_start(self) -> None:
        if torch.is_grad_enabled() and not self._all_kept:
            raise create_graph_needs_keep()
        self._pass_open = True
        model = self.model
        if not model._post_backward_callback_queued:
            # Checked before FSDP finalizes the pass (when FSDP's root
            # pre-backward hook queued its callback first, only after).
            _queue_callback(self._check_post_backward)
            # What FSDP's root pre-backward hook does first, for a pass that
            # does not start at (or never reaches) the root's outputs.
            self._fsdp.register_post_backward_final_callback(model, model)
            self._fsdp.reset_flat_param_grad_info_if_needed([h for _, h in self._handles])
        _queue_callback(self._on_pass_end)
        index = self.tracker.begin()
        self._check_sentinels()  # units whose pre-backward has not run yet
        if self.options.backwards is not None and index >= self.options.backwards:
            self._freeing = True
            if not self.probing:
                self._restore_sync()

    @_loud
    def _check_post_backward(self) -> None:
        unreduced = self._post_backward.unreduced()
        if unreduced:
            raise RuntimeError(NOT_REDUCED.format(units=self._unit_names(unreduced)))

    @_loud
    def _on_pass_end(self) -> None:
        self._pass_open = False
        self.tracker.end()
        # Which units this pass reduced: decided before the pass end restores
        # _sync_gradients (the last pass of sync_grads="last" reduces).
        accumulated = self._post_backward.accumulated
        reduced = [h for h in accumulated if self._state_of[h]._sync_gradients]
        # FSDP's finalize cleared _post_backward_called only where it reduced.
        unreduced = [h for h in self._post_backward.unreduced() if h not in reduced]
        if unreduced:
            raise RuntimeError(NOT_REDUCED.format(units=self._unit_names(unreduced)))
        self._end_probe()
        if self.options.sync_grads == "last" and self._freeing:
            self._restore_sync()
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
        check_sharded_grads(reduced, lambda h: self._names.get(h, "?"))

    # Probe passes #
    def _in_backward(self) -> bool:
        return _pass_start.in_backward()

    def _hook_unit_inputs(self, state: Any, module: nn.Module, args: Any, kwargs: Any) -> None:
        """Hooks the unit's inputs: their gradient is complete once the unit's
        backward is done, which in a probe pass is when it can be resharded."""
        if compiling() or not torch.is_grad_enabled() or self._in_backward():
            return
        hook = functools.partial(_unit_input_grad, weakref.ref(self), state)
        for tensor in grad_tensors((args, kwargs)):
            tensor.register_hook(hook)  # lives as long as the graph

    def _probe_unit_done(self, state: Any) -> None:
        """What FSDP's post-backward hook would reshard, without reducing."""
        handle = state._handle
        if (handle in self._kept and not self._freeing) or handle.needs_unshard():
            return
        handle._training_state = self._phase.BACKWARD_POST
        self._fsdp.post_backward_reshard(state, handle)

    def _before_probe(self) -> None:
        self._probe_sync = [(s, s._sync_gradients) for s in self._states]
        for state in self._states:
            state._sync_gradients = False

    def _end_probe(self) -> None:
        for state, value in self._probe_sync:
            state._sync_gradients = value
        self._probe_sync = []
        self._restore_grads()


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
        self._output_nodes.clear()
        self._inner_nodes.clear()
        self._forward_tensors.clear()
        self._acc_grads.clear()
        self._regather.clear()
        self._sentinels.clear()











def _unsharded_bytes(handle: Any) -> int:
    padded = require_attr(handle.flat_param, "_full_param_padded", _FLAVOUR)
    return padded.numel() * padded.element_size()


def _hooked_node(handle: Any) -> Any:
    """The ``AccumulateGrad`` node FSDP1's post-backward hook is on, if any.

    A flat parameter that needs no gradient has a reshard-only hook instead,
    stored as a 1-tuple.
    """
    hook_state = getattr(handle.flat_param, _HOOK_STATE, None)
    return hook_state[0] if hook_state is not None and len(hook_state) == 2 else None


def _is_fsdp1_unit(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return isinstance(module, FullyShardedDataParallel)


def _non_root_message(model: nn.Module) -> str:
    return (
        f"no_reshard_between_backwards got a non-root FSDP1 unit "
        f"({type(model).__name__}): another FullyShardedDataParallel module ran "
        "forward first and became the root. Pass that outermost "
        "FullyShardedDataParallel module, whose forward runs the others."
    )
