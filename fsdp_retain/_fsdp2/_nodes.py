"""Which FSDP2 states a backward pass uses, from the autograd nodes of the forwards.

Part of the FSDP2 backend with ``_block.py`` (private FSDP2 access). For each
state, forward hooks on its modules record the autograd nodes of its outputs
(where FSDP2's pre-backward hooks are) and of its inputs plus the
``AccumulateGrad`` nodes of its unsharded parameters; a pass that runs one of
them uses the state (``_pass_start.will_run`` answers inside a pass).
``ParamLeaves`` answers what stands for a parameter in the graph, for passes with
``inputs``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from .. import _pass_start
from .._common import compiling, grad_tensors, require_attr
from ._compat import FLAVOUR, forward_running, local_storage, param_groups
from .._inputs import ParamLookup


_NODE_ATTR = "_fsdp_retain_accumulate_node"


class _CachedNode:
    """An unsharded parameter and its AccumulateGrad node, kept on the FSDPParam across
    blocks: the node autograd uses for a leaf lives as long as someone holds it, so
    every forward's graph reuses this one and a block need not look it up per
    parameter (an ``expand_as`` each) at every forward. Held by the FSDPParam, not a
    global table, so it goes with the model; a copy of the model looks it up again."""

    __slots__ = ("param", "node")

    def __init__(self, param: Any = None, node: Any = None) -> None:
        self.param, self.node = param, node

    def __deepcopy__(self, memo: dict) -> _CachedNode:
        return _CachedNode()

    def __reduce__(self) -> tuple:
        return (_CachedNode, ())


def _accumulate_node(fsdp_param: Any, param: torch.Tensor) -> Any:
    cached = getattr(fsdp_param, _NODE_ATTR, None)
    if cached is not None and cached.param is param:
        return cached.node  # a new unsharded parameter object is looked up again
    with torch.enable_grad():
        node = param.expand_as(param).grad_fn.next_functions[0][0]
    setattr(fsdp_param, _NODE_ATTR, _CachedNode(param, node))
    return node


class ForwardNodes:
    """The recorded nodes, per FSDP2 state."""

    def __init__(self) -> None:
        self._outputs: dict[Any, list[Any]] = {}
        self._used: dict[Any, list[Any]] = {}

    def hook(self, state: Any, module: nn.Module) -> list[Any]:
        """Hooks ``module`` of ``state``; returns the handles. Registered after
        FSDP2's own hooks: they see unsharded parameters, wrapped inputs and outputs."""
        return [
            module.register_forward_pre_hook(
                functools.partial(self._record_inputs, state), with_kwargs=True
            ),
            module.register_forward_hook(functools.partial(self._record_outputs, state)),
        ]

    def uses(self, state: Any, run: Callable[[Any], bool]) -> bool:
        return any(map(run, self._used.get(state, ()))) or self.reaches_outputs(state, run)

    def reaches_outputs(self, state: Any, run: Callable[[Any], bool]) -> bool:
        return any(map(run, self._outputs.get(state, ())))

    def clear(self) -> None:
        self._outputs.clear()
        self._used.clear()

    def _record_inputs(self, state: Any, module: nn.Module, args: Any, kwargs: Any) -> None:
        if compiling() or not torch.is_grad_enabled() or _pass_start.in_backward():
            return
        from torch.autograd.graph import get_gradient_edge

        nodes = self._used.setdefault(state, [])
        nodes.extend(get_gradient_edge(t).node for t in grad_tensors((args, kwargs)))

    def _record_outputs(self, state: Any, module: nn.Module, args: Any, output: Any) -> None:
        # Also runs for the root's first forward, whose pre-hooks were already
        # being called when the block installed its own.
        if compiling() or not torch.is_grad_enabled() or _pass_start.in_backward():
            return
        nodes = self._outputs.setdefault(state, [])
        nodes.extend(t.grad_fn for t in grad_tensors(output) if t.grad_fn is not None)
        self.record_params(state)

    def record_running_root(self, root_state: Any) -> None:
        """At install inside the root's forward (Lightning's ``training_step``): the
        root's output hook runs after the block and the passes start inside it."""
        if forward_running(root_state):
            self.record_params(root_state)

    def record_params(self, state: Any) -> None:
        """The ``AccumulateGrad`` nodes of ``state``'s unsharded parameters: after its
        forward, or at install inside the root's forward (Lightning runs
        ``training_step`` there), whose outputs no pass reaches."""
        used = self._used.setdefault(state, [])
        for group in param_groups(state):
            for fsdp_param in group.fsdp_params:
                param = require_attr(fsdp_param, "unsharded_param", FLAVOUR)
                if param.requires_grad and local_storage(param).nbytes() > 0:
                    # The AccumulateGrad node this forward's graph uses. Units
                    # resharded after forward are found by their inputs instead.
                    used.append(_accumulate_node(fsdp_param, param))


class ParamLeaves(ParamLookup):
    """What stands for an FSDP2 parameter in the graph: its unsharded parameter, the
    leaf FSDP2 keeps across reshards (see [Note: inputs that name parameters])."""

    def __init__(self, groups: list[Any]) -> None:
        self._groups = groups  # the block's list, filled at install
        self._leaves: dict[int, Any] | None = None  # built at the first pass with inputs

    def graph_inputs(self, tensor: torch.Tensor) -> list[Any] | None:
        if self._leaves is None:
            self._leaves = {}
            for fsdp_param in self._params():
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None:
                    self._leaves[id(fsdp_param.sharded_param)] = unsharded
                    self._leaves[id(unsharded)] = unsharded
        leaf = self._leaves.get(id(tensor))
        return None if leaf is None else [leaf]

    def storages(self) -> set[int]:
        ptrs = set()
        for fsdp_param in self._params():
            ptrs.add(local_storage(fsdp_param.sharded_param).data_ptr())
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                ptrs.add(local_storage(unsharded).data_ptr())
        ptrs.discard(0)
        return ptrs

    def _params(self) -> list[Any]:
        return [fp for group in self._groups for fp in group.fsdp_params]
