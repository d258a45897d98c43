"""One record per FSDP1 unit, and what the block learns about it from each forward.

Part of the FSDP1 backend with ``_block.py``. A ``Unit`` is what the block
knows about one ``FlatParamHandle``: its FSDP state, whether the budget keeps
it, the autograd nodes of this block's forwards (which tell whether a pass
uses the unit, and how), what FSDP1 drops after a pass and the block puts back,
and the gradients the block holds for it (``_grads.py``).
``ForwardRecorder`` fills the per-forward part from forward hooks.

Several forwards in one block with parameter mixed precision: each forward
casts the flat parameter to the low-precision dtype anew, which gives its
graph a new ``AccumulateGrad`` node, and FSDP1 hooks only the first forward's
node. The recorder hooks every forward's node and runs FSDP's post-backward
hook once per pass, after the last of them that the pass executes
(``counted_post_backward``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from .._common import Liveness, compiling, eager_modules, grad_tensors, loud
from ._compat import (
    HOOK_STATE,
    acc_grad_node,
    frees_after_forward,
    graph_task_id,
    hooked_node,
    is_fsdp1_unit,
    unsharded_bytes,
)
from .._policy import ShardGroup


@dataclasses.dataclass(eq=False)
class Unit:
    """An FSDP1 unit with parameters, as one block sees it."""

    state: Any  # the FullyShardedDataParallel module
    handle: Any  # its FlatParamHandle
    name: str  # for errors
    kept: bool = False  # unsharded between passes (the budget)
    in_span: bool = False  # nested passes run through it: see _fsdp1_nested
    # A forward with grad before the block whose backward has not run: the
    # AccumulateGrad node FSDP1 hooked for it.
    outside: Any = None
    # From the last forward, put back after each pass that frees the unit.
    regather: bool = False
    forward_tensors: list[Any] | None = None  # use_orig_params views
    forward_index: int | None = None  # FSDP's post-forward index (prefetching)
    # Autograd nodes of this block's forwards: the unit's outputs (FSDP's
    # pre-backward hooks are on them), the outputs of the modules inside it,
    # and its AccumulateGrad nodes, first forward first.
    output_nodes: list[Any] = dataclasses.field(default_factory=list)
    inner_nodes: list[Any] = dataclasses.field(default_factory=list)
    acc_grads: list[Any] = dataclasses.field(default_factory=list)
    # [graph task, nodes fired, nodes expected] while counted_post_backward counts.
    count: list[int] | None = None
    # Gradients (see _fsdp1_grads): .grad and _saved_grad_shard before the
    # running pass, whether the pass accumulates into the unit, and what a
    # zero_grad() between passes must reach.
    grads_before: tuple[Any, Any] | None = None
    accumulating: bool = False
    sentinel: Any = None
    # See [Note: inputs that name parameters]: the original parameters the
    # running pass's ``inputs`` named (``None``: all), and those that only
    # passes not naming them reached while their ``.grad`` was ``None``.
    selected: set[int] | None = None
    unnamed_none: set[int] = dataclasses.field(default_factory=set)

    @property
    def flat_param(self) -> Any:
        return self.handle.flat_param

    @property
    def shard_group(self) -> ShardGroup:
        """The strategy and the ranks FSDP1 all-gathers the unit over (``HYBRID_SHARD``:
        its shard group)."""
        handle = self.handle
        return ShardGroup(self.name, handle._sharding_strategy.name, handle.process_group.size())

    def uses(self, run: Callable[[Any], bool]) -> bool:
        """Whether the running pass (``run``: ``_pass_start.will_run``) uses the unit."""
        return self.accumulates(run) or any(map(run, self.inner_nodes)) or self.reaches_outputs(run)

    def accumulates(self, run: Callable[[Any], bool]) -> bool:
        return any(map(run, self.acc_grads))

    def reaches_outputs(self, run: Callable[[Any], bool]) -> bool:
        return any(map(run, self.output_nodes))

    def runs_early(self, run: Callable[[Any], bool]) -> bool:
        """Whether the block does the unit's pre-backward at the pass start."""
        if self.kept:
            # Nothing to gather: prepare every unit the pass accumulates into,
            # so no AccumulateGrad runs before FSDP's hook would have.
            return self.accumulating
        # A first-order pass over the forward reaches a unit's parameters only
        # after its outputs, unless it starts inside the unit.
        return not self.reaches_outputs(run)

    def forget_forward(self) -> None:
        """Drops what the block's forwards recorded (block exit)."""
        self.regather = False
        self.forward_tensors = None
        self.output_nodes.clear()
        self.inner_nodes.clear()
        self.acc_grads.clear()
        self.count = None
        self.unnamed_none.clear()


def make_units(model: nn.Module, states: list[Any]) -> list[Unit]:
    """A ``Unit`` for each FSDP state with a flat parameter, named as in ``model``."""
    names = {
        id(m): n.replace("_fsdp_wrapped_module.", "") or "<root>"
        for n, m in model.named_modules()
    }
    # outside: a forward with grad that ran before the block and whose backward
    # has not run: FSDP1 hooked its AccumulateGrad node and still holds it.
    return [
        Unit(s, s._handle, names.get(id(s), "?"), outside=hooked_node(s._handle))
        for s in states
        if s._handle is not None
    ]


def shard_groups(model: nn.Module) -> list[ShardGroup]:
    """Each unit's ``shard_group`` (for ``RetainOptions.check_reshard_to``), before the
    block and before FSDP1's lazy init."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return [u.shard_group for u in make_units(model, FullyShardedDataParallel.fsdp_modules(model))]


def backward_order(model: nn.Module, units: list[Unit]) -> list[tuple[Unit, int, bool]]:
    """Units with their unsharded bytes and whether FSDP1 frees them after forward,
    the root's first, then the others in reverse module order (the order their
    backward runs; see ``kept_units``)."""
    root = [u for u in units if u.state is model]
    rest = [u for u in units if u.state is not model]
    return [
        (u, unsharded_bytes(u.handle), frees_after_forward(u.state, u.handle))
        for u in root + rest[::-1]
    ]


class ForwardRecorder:
    """Forward hooks that fill each ``Unit``'s per-forward fields."""

    def __init__(self, model: nn.Module, units: list[Unit], post_backward_hook,
                 alive: Liveness) -> None:
        self.model = model
        self.units = units
        self._post_backward_hook = post_backward_hook  # FSDP1's
        self.alive = alive  # shared with the guard hooks on the graph
        self.forward_order: list[Any] = []  # FSDP's handles_post_forward_order
        self._unit_of: dict[int, Unit] = {}  # id(module inside a unit) -> its unit
        self._counted_hooks: list[Any] = []
        # The block opened inside the root's forward (Lightning runs training_step
        # there): its post-forward hooks run only after the block, so each pass start
        # records what they would have (``record_forward``) when a unit ran forward since.
        self.inside_root_forward = False
        self.forwards_unrecorded = False

    def hook_root(self) -> Any:
        return self.model.register_forward_hook(self._after_forward)

    def hook_unit(self, unit: Unit, inner_eager: bool) -> list[Any]:
        """The unit's recording hooks; ``inner_eager``: its inner module is not
        compiled in place (see [Note: the block under torch.compile])."""
        state = unit.state
        # The outputs FSDP's pre-backward hooks are on: what the unit returns
        # (other module hooks may wrap the inner module's).
        hooks = [
            state.register_forward_hook(functools.partial(self._record_outputs, unit)),
            state.register_forward_hook(functools.partial(self._capture_fsdp_node, unit)),
        ]
        # One hook object for all inner modules: dynamo guards on a module's
        # hooks, so per-unit partials would recompile each unit.
        for module in eager_modules(state._fsdp_wrapped_module, stop=is_fsdp1_unit):
            self._unit_of[id(module)] = unit
            hooks.append(module.register_forward_hook(self._record_inner))
        if unit.flat_param.requires_grad and inner_eager:
            # Inside FSDP's forward, after its pre-forward unsharded the parameters.
            capture = functools.partial(self._capture_acc_grad, unit)
            hooks.append(state._fsdp_wrapped_module.register_forward_pre_hook(capture))
        return hooks

    def guard_outputs(self, module: nn.Module, args: Any, output: Any) -> None:
        """Forward hook on each unit's inner module: see ``Liveness``."""
        if compiling() or not torch.is_grad_enabled():
            return
        for t in grad_tensors(output):
            t.register_hook(self.alive.refuse_after_exit)  # lives as long as the graph

    def forget(self) -> None:
        """Drops every forward's record (block exit)."""
        for hook in self._counted_hooks:
            hook.remove()
        self._counted_hooks.clear()
        for unit in self.units:
            unit.forget_forward()

    def open_inside_root_forward(self, root: Unit | None) -> None:
        """At install, inside the root's forward: its parameters are gathered and its
        inner forward already started, so its ``AccumulateGrad`` node is taken now."""
        self.inside_root_forward = True
        if root is not None and root.flat_param.requires_grad:
            self._capture_acc_grad(root, self.model, ())

    @loud
    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if compiling() or not torch.is_grad_enabled():
            return
        self.record_forward()

    def record_forward(self) -> None:
        """Each unit's per-forward fields, as FSDP1 left them after the forward."""
        self.forwards_unrecorded = False
        for unit in self.units:
            handle = unit.handle
            unit.regather = handle._needs_pre_backward_unshard
            tensors = handle.flat_param._tensors if handle._use_orig_params else None
            unit.forward_tensors = None if tensors is None else list(tensors)
            unit.forward_index = handle._post_forward_index
        order: Any = self.model._exec_order_data
        self.forward_order = list(order.handles_post_forward_order)

    def _record_inner(self, module: nn.Module, args: Any, output: Any) -> None:
        if compiling():
            return  # before touching `module`: dynamo would guard on its identity
        unit = self._unit_of.get(id(module))
        if unit is not None:
            _record_nodes(unit.inner_nodes, output)

    def _record_outputs(self, unit: Unit, module: nn.Module, args: Any, output: Any) -> None:
        self.forwards_unrecorded = True
        _record_nodes(unit.output_nodes, output)

    def _capture_acc_grad(self, unit: Unit, module: nn.Module, args: Any) -> None:
        """Remembers the ``AccumulateGrad`` node this forward's graph uses.

        Not the flat parameter's node after the forward: with parameter mixed
        precision the forward ran on low-precision data, and switching
        ``.data`` to another dtype gives the parameter a new node.
        """
        if compiling() or not torch.is_grad_enabled() or graph_task_id() != -1:
            return  # no graph, or an activation-checkpointing recompute
        node = acc_grad_node(unit.flat_param)
        if any(n is node for n in unit.acc_grads):
            return
        unit.acc_grads.append(node)
        if len(unit.acc_grads) > 1:
            self._count_post_backward(unit)

    @staticmethod
    def _capture_fsdp_node(unit: Unit, module: nn.Module, args: Any, output: Any) -> None:
        """The node FSDP1 hooked in this unit's forward, when the unit's inner forward
        ran without grad (reentrant activation checkpointing inside the unit: the
        graph that accumulates into it is only built in each pass's recompute)."""
        if compiling() or not torch.is_grad_enabled() or graph_task_id() != -1:
            return
        if unit.acc_grads:
            return
        node = hooked_node(unit.handle)
        if node is not None:
            unit.acc_grads.append(node)

    def post_backward_fn(self, unit: Unit) -> Callable[..., None]:
        """What the ``AccumulateGrad`` hook of ``unit`` runs: FSDP's post-backward
        hook, counted when several forwards gave the unit several nodes."""
        if len(unit.acc_grads) > 1:
            return functools.partial(self._counted_post_backward, unit)
        return functools.partial(self._post_backward_hook, unit.state, unit.handle)

    def _count_post_backward(self, unit: Unit) -> None:
        """Hooks a later forward's node; from now on every node of ``unit``
        runs ``_counted_post_backward`` instead of FSDP's hook."""
        nodes = unit.acc_grads
        hook = functools.partial(self._counted_post_backward, unit)
        flat_param = unit.flat_param
        if len(nodes) == 2:
            old = getattr(flat_param, HOOK_STATE, None)
            if old is not None:
                old[-1].remove()
            # FSDP's final callback removes this one after each pass; the
            # pass end puts it back.
            setattr(flat_param, HOOK_STATE, (nodes[0], nodes[0].register_hook(hook)))
        self._counted_hooks.append(nodes[-1].register_hook(hook))

    @loud
    def _counted_post_backward(self, unit: Unit, *unused: Any) -> None:
        """FSDP's post-backward hook, once the last node of ``unit`` this pass runs
        has accumulated its gradient (as ``register_multi_grad_hook`` counts)."""
        task = graph_task_id()
        count = unit.count
        if count is None or count[0] != task:
            expected = sum(map(torch._C._will_engine_execute_node, unit.acc_grads))
            count = unit.count = [task, 0, expected]
        count[1] += 1
        if count[1] >= count[2]:
            unit.count = None
            self._post_backward_hook(unit.state, unit.handle, unit.flat_param)


def _record_nodes(nodes: list[Any], output: Any) -> None:
    if not compiling() and torch.is_grad_enabled() and graph_task_id() == -1:
        nodes.extend(t.grad_fn for t in grad_tensors(output) if t.grad_fn is not None)
