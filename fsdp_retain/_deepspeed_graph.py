"""The autograd side of the DeepSpeed ZeRO-3 backend: the parameters'
``AccumulateGrad`` nodes, and the guard left on the graphs.

Part of the DeepSpeed backend with ``_deepspeed.py``, which holds every access
to DeepSpeed itself; this module sees only tensors, parameters and autograd
nodes (autograd-private calls as in ``_pass_start.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge

from ._common import Liveness, RetainError, loud, require_attr

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


@loud
def backward_after_exit(alive: Liveness, grad: torch.Tensor) -> None:
    """Refuses a backward over a module output of the block after the block exited."""
    if alive.exited:
        raise RetainError(AFTER_EXIT)
