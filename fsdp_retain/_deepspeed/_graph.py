"""The autograd side of the DeepSpeed ZeRO-3 backend: the parameters'
``AccumulateGrad`` nodes, the nodes of the block's forwards (``ForwardGraph``), the
guard left on the graphs, and the graph's leaf for a parameter named in ``inputs``.

Part of the DeepSpeed backend with ``_block.py``, which holds every access
to DeepSpeed itself; this module sees only tensors, parameters and autograd
nodes (autograd-private calls as in ``_pass_start.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge

from .._common import Liveness, RetainError, grad_tensors, require_attr
from .._inputs import ParamLookup

AFTER_EXIT = (
    "no_reshard_between_backwards: this backward runs over a graph whose forward ran "
    "inside a no_reshard_between_backwards block on a DeepSpeed engine that has already "
    "exited. When the block ended, ZeRO-3 released the parameters this graph saved, so "
    "the pass would fail (The size of tensor a (0) must match ...). Move this backward "
    "inside the block, before the `with` statement ends (or run a new forward for it)."
)


def held_node(param: torch.nn.Parameter, shape: tuple[int, ...], flavour: str) -> Any:
    """The ``AccumulateGrad`` node a graph holds for ``param``, or None.

    A parameter's node lives as long as a graph holds it, and records the
    parameter's shape when it is made. ZeRO-3 keeps a released parameter's
    ``.data`` empty, so a node made while it is released has shape 0: no graph
    holds it (its module ran without grad, e.g. under reentrant activation
    checkpointing, or not at all). Kept alive by the block it would be the node
    of the parameter's next use (the checkpoint's recompute) and fail there
    (``invalid gradient ... expected shape compatible with [0]``), so it is dropped.
    """
    node = get_gradient_edge(param).node
    metadata: Any = require_attr(node, "_input_metadata", flavour)
    return node if tuple(metadata[0].shape) == tuple(shape) else None


class ForwardGraph:
    """The autograd nodes of the block's forwards: the engine module's outputs, and its
    parameters' ``AccumulateGrad`` nodes (``acc_grads`` starts with those a graph from
    before the block holds)."""

    def __init__(self) -> None:
        self.alive = Liveness(AFTER_EXIT)  # shared with the guard hooks on the outputs' graphs
        self.outputs: list[Any] = []
        self.acc_grads: list[Any] = []
        self.param_nodes: list[tuple[torch.nn.Parameter, Any]] = []  # None: see held_node
        self._recorded = False

    def record(self, output: Any, params: list[torch.nn.Parameter],
               shape: Callable[[torch.nn.Parameter], Any], flavour: str) -> None:
        """A forward's ``output``; at the first one the node a graph holds for each
        trainable one of ``params`` (``held_node``, with its full ``shape``). Held
        here, every later forward's graph uses the same nodes."""
        self.outputs.extend(t.grad_fn for t in grad_tensors(output) if t.grad_fn is not None)
        if self._recorded:
            return
        self._recorded = True
        for param in params:
            if not param.requires_grad:
                continue
            node = held_node(param, shape(param), flavour)
            if node is not None:
                self.acc_grads.append(node)
            self.param_nodes.append((param, node))

    def guard(self, output: Any) -> None:
        """See ``Liveness``."""
        for tensor in grad_tensors(output):
            tensor.register_hook(self.alive.refuse_after_exit)  # lives as long as the graph

    def unreached(self, run: Callable[[Any], bool],
                  trainable: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
        """The parameters a pass (``run``: ``_pass_start.will_run``) does not
        accumulate into, or whose node is unknown (``held_node``): all of
        ``trainable`` for a pass inside the first forward, before ``record`` (the
        per-shard passes of DeepSpeed's ``TiledFusedLogitsLoss``)."""
        if not self._recorded:
            return list(trainable)
        return [param for param, node in self.param_nodes if node is None or not run(node)]

    def clear(self) -> None:
        self.alive.exited = True
        self.outputs.clear()
        self.acc_grads.clear()
        self.param_nodes.clear()


class ZeroParams(ParamLookup):
    """ZeRO-3 gathers into the parameter itself: it is the graph's leaf. See
    [Note: inputs that name parameters] in ``_inputs.py``."""

    def __init__(self, root: torch.nn.Module, refusal: str) -> None:
        self._root = root
        self._ids: set[int] | None = None
        self._refusal = refusal

    def graph_inputs(self, tensor: torch.Tensor) -> list[Any] | None:
        if self._ids is None:
            self._ids = {id(p) for p in self._root.parameters()}
        return [tensor] if id(tensor) in self._ids else None

    def select(self, named: list[torch.Tensor]) -> list[Any]:
        raise RetainError(self._refusal)
