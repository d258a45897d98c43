"""Probe passes: the activation frontier they differentiate against.

See [Note: probe passes] in ``_common.py``. ``ProbeTargets`` records, during
the block's forwards, the autograd edges a probe pass runs
``torch.autograd.grad`` against; ``refuse_reentrant_checkpoint`` raises before
a probe pass that could not run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from operator import attrgetter
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from ._common import compiling, eager_modules, grad_tensors

if TYPE_CHECKING:
    from ._kept_hooks import KeptHooks


_grad_enabled = torch.is_grad_enabled
_Tensor = torch.Tensor
_FunctionBase = torch._C._FunctionBase


class ProbeTargets:
    """The probe pass's targets, recorded during the block's forwards: ``edges()``.

    A hook runs at every module call, so it only appends ``(node, output_nr)`` (an
    edge keeps the autograd node, not the activation's memory); ``edges()`` makes the
    ``GradientEdge``s, one per edge, when a pass needs them."""

    def __init__(self, in_backward: Callable[[], bool]) -> None:
        self._found: list[tuple] = []  # as recorded, repeats included
        self._edges: dict[tuple[int, int], GradientEdge] = {}  # (id(node), output_nr)
        self._in_backward = in_backward

    def edges(self) -> list[GradientEdge]:
        """Every edge recorded since ``clear()``, once each."""
        found, edges = self._found, self._edges
        for item in found:
            key = (id(item[0]), item[1])
            if key not in edges:
                edges[key] = item if type(item) is GradientEdge else GradientEdge(*item)
        found.clear()
        return list(edges.values())

    def clear(self) -> None:
        self._found.clear()
        self._edges.clear()

    def hook_unit(self, module: nn.Module) -> Any:
        """Forward pre-hook handle that records ``module``'s inputs as probe targets.

        Registered in front of FSDP's own pre-forward, so it sees the inputs
        before FSDP wraps them (FSDP2 routes them through its post-backward
        autograd function; FSDP1 casts them): the probe pass then runs FSDP's
        per-unit post-backward for every unit it walks through.
        """
        return hook_unit(module, self.record_inputs)

    def hook_sources(self, root: nn.Module) -> list[Any]:
        """Forward hook handles that record, as probe targets, the outputs of each
        module under ``root`` whose inputs need no gradient (see [Note: probe passes])."""
        return [hook_source(module, self._record_sources) for module in eager_modules(root)]

    def record_inputs(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        # Runs at every call of a unit: the names it calls are module globals.
        if not _grad_enabled() or compiling() or self._in_backward():
            return  # no graph, or an activation-checkpointing recompute
        if not kwargs and len(args) == 1 and type(args[0]) is _Tensor:
            # The common call, one plain tensor: no walk of the containers.
            tensor = args[0]
            if tensor.requires_grad:
                node = tensor.grad_fn
                if node is not None and not isinstance(node, _FunctionBase):
                    self._found.append((node, tensor.output_nr))
                else:
                    self._record([tensor])
            return
        self._record(grad_tensors((args, kwargs)))

    def _record_sources(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        # Runs at every module call; most calls' inputs need grad: that check first.
        if compiling() or _needs_grad(args, kwargs):
            return  # traced by dynamo, or reached through its inputs
        if not _grad_enabled() or self._in_backward():
            return
        self._record(grad_tensors(output))

    def _record(self, tensors: list[torch.Tensor]) -> None:
        found = self._found
        for tensor in tensors:
            node = tensor.grad_fn
            if node is None or isinstance(node, _FunctionBase):
                # A leaf (its AccumulateGrad node), or a Python function's node, which
                # the edge holds through an ownership token (get_gradient_edge).
                found.append(get_gradient_edge(tensor))
            else:
                found.append((node, tensor.output_nr))


def _needs_grad(args: tuple, kwargs: dict) -> bool:
    """Whether a module call's inputs require grad; the common call, one plain tensor,
    without the walk of the containers (these hooks run at every module call)."""
    if not kwargs and len(args) == 1 and type(args[0]) is _Tensor:
        return args[0].requires_grad
    return bool(grad_tensors((args, kwargs)))


def hook_unit(module: nn.Module, hook: Callable[..., Any]) -> Any:
    """``ProbeTargets.hook_unit`` with the hook given (one that calls a block's
    ``record_inputs``: see [Note: hooks kept on the model] in ``_kept_hooks.py``)."""
    return module.register_forward_pre_hook(hook, prepend=True, with_kwargs=True)


def hook_source(module: nn.Module, hook: Callable[..., Any]) -> Any:
    """One of ``ProbeTargets.hook_sources``' hooks, with the hook given."""
    return module.register_forward_hook(hook, with_kwargs=True)


def keep_probe_hooks(kept: KeptHooks, units: Iterable[nn.Module],
                     sources: Iterable[nn.Module]) -> None:
    """``hook_unit`` on each of ``units`` and ``hook_source`` on each of ``sources``,
    kept on the model and calling the running block's ``probe_targets`` (see [Note:
    hooks kept on the model] in ``_kept_hooks.py``)."""
    record_inputs = attrgetter("probe_targets.record_inputs")
    for unit in units:
        kept.add(unit, functools.partial(hook_unit, unit), record_inputs)
    record_sources = attrgetter("probe_targets._record_sources")
    for module in sources:
        kept.add(module, functools.partial(hook_source, module), record_sources)


# The node of torch.utils.checkpoint(..., use_reentrant=True), which refuses
# torch.autograd.grad (it runs its own nested backward without `inputs`).
_REENTRANT_CHECKPOINT = "CheckpointFunctionBackward"


def refuse_reentrant_checkpoint(loss: torch.Tensor) -> None:
    """Raises before a probe pass that would reach a reentrant checkpoint."""
    if reaches_reentrant_checkpoint([loss.grad_fn]):
        raise ValueError(
            "block.backward(..., param_grads=False) reached a reentrant activation "
            "checkpoint (torch.utils.checkpoint with use_reentrant=True), which "
            "cannot run a probe pass: it refuses torch.autograd.grad. Use "
            "non-reentrant checkpointing (checkpoint(..., use_reentrant=False); in "
            "HF transformers model.gradient_checkpointing_enable("
            "gradient_checkpointing_kwargs={'use_reentrant': False})), or run this "
            "pass with param_grads=True. Nothing was changed."
        )


def reaches_reentrant_checkpoint(roots: list) -> bool:
    """Whether the graph below the autograd nodes ``roots`` has a reentrant checkpoint."""
    # Visited nodes are kept alive: ids of freed node wrappers could be reused.
    stack, seen = [r for r in roots if r is not None], {}
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        if type(node).__name__ == _REENTRANT_CHECKPOINT:
            return True
        stack.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
    return False
