"""Seeing every backward pass start, also passes that FSDP's own hooks never see.

FSDP learns that a backward starts from hooks on unit outputs. A pass may
start anywhere in the forward (an activation inside a unit, a non-root unit's
output, the graph of a ``create_graph=True`` gradient) and reach a unit's
parameters without passing one of those outputs first, or reach no root
output at all. The block must then do FSDP's pre-backward work itself, before
the first node of the pass runs.

While a block is installed, torch.autograd's engine entry
(``torch.autograd._engine_run_backward``, which ``Tensor.backward``,
``torch.autograd.backward`` and ``torch.autograd.grad`` all call) is wrapped:
each watcher's ``map_inputs()`` sees the pass's ``inputs`` (see [Note: inputs
that name parameters] in ``_inputs.py``) and its ``before_backward()`` runs
before the engine starts, a pre-hook on the autograd node of every root tensor
runs the watchers' ``on_backward_start()`` inside the pass, where callbacks can
be queued and :func:`will_run` answers, before any node computes, and
``after_backward()`` runs when the engine returns (also on an error). A backward
started inside a running one (reentrant activation checkpointing, a tiled MLP, a
cached loss) runs between the watchers' ``before_nested()`` and ``after_nested()``,
with ``on_nested_start()`` inside it, where :func:`will_run` answers for it.

This is autograd-private access shared by every backend; FSDP and DeepSpeed
internals stay in their backend modules. The wrapper is process-global (so is
the engine entry); it is installed while at least one block watches, and put
back only if nobody wrapped the entry after it (``unwatch``).
"""

from __future__ import annotations

import sys

import torch
import torch.autograd

from ._common import RetainError, missing_internal

_ENTRY = "_engine_run_backward"
# Positions in ``_engine_run_backward(outputs, *args)``, as Tensor.backward,
# torch.autograd.backward and torch.autograd.grad call it (torch 2.9-2.15).
_INPUTS_ARG = 3
_watchers: list = []
_original = None
_roots_running: list[set[int]] = []  # ids of the root nodes of each running pass


def will_run(node) -> bool:
    """Whether the running backward executes ``node`` (call only inside a pass)."""
    if _roots_running and id(node) in _roots_running[-1]:
        # The engine does not list the root of a single-root backward among
        # the nodes it will execute; it runs first.
        return True
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:
        return True  # a leaf that autograd.grad captures: the pass reaches it


_NODES_ATTR = "_fsdp_retain_param_nodes"


class ParamNodes:
    """A model's parameters and their ``AccumulateGrad`` nodes, held on the wrapper a
    block is given (``param_nodes``): looked up once, not at every block. The node
    autograd uses for a leaf lives as long as someone holds it, so every forward's
    graph reuses these; a copy of the wrapper (``copy.deepcopy``) starts without them."""

    __slots__ = ("params", "nodes")

    def __init__(self, params: list | None = None) -> None:
        self.params = list(params or [])
        self.nodes = _lookup(self.params)

    def any_run(self) -> bool:
        """Whether the running backward executes one of the nodes (call only inside a
        pass). Where none seems to, they are looked up again first: a parameter whose
        storage was swapped (``set_``) has a new node."""
        if any(map(will_run, self.nodes)):
            return True
        if _tracing():
            return False  # a backward compile traces (fake tensors): no parameter of ours
        fresh = _lookup(self.params)
        if all(a is b for a, b in zip(fresh, self.nodes)):
            return False
        self.nodes = fresh
        return any(map(will_run, fresh))

    def __deepcopy__(self, memo: dict) -> ParamNodes:
        return ParamNodes()

    def __reduce__(self) -> tuple:
        return (ParamNodes, ())


def param_nodes(owner, params: list) -> ParamNodes:
    """``owner``'s ``ParamNodes`` for ``params``, built again when the list changed."""
    held = owner.__dict__.get(_NODES_ATTR)
    if (isinstance(held, ParamNodes) and len(held.params) == len(params)
            and all(a is b for a, b in zip(held.params, params))):
        return held
    held = ParamNodes(params)
    owner.__dict__[_NODES_ATTR] = held
    return held


def _tracing() -> bool:
    """Whether a fake or proxy dispatch mode is on: AOTAutograd tracing a joint graph
    runs ``torch.autograd.grad`` (so the watchers) on fake tensors."""
    keys = torch._C._TorchDispatchModeKey
    return any(torch._C._get_dispatch_mode(key) is not None for key in (keys.FAKE, keys.PROXY))


def _lookup(params: list) -> list:
    if not params:
        return []  # the empty record a block holds before install and after exit
    with torch.enable_grad():
        return [p.view_as(p).grad_fn.next_functions[0][0] for p in params]


def in_backward() -> bool:
    return _graph_task_id() != -1


# Looked up once (module hooks call in_backward at every module call); watch() says
# loudly where this torch lacks it, before a block runs.
_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)


def watch(watcher) -> None:
    """Starts calling ``watcher.before_backward()`` / ``on_backward_start()``."""
    global _original
    if not _watchers:
        for name in ("_will_engine_execute_node", "_current_graph_task_id"):
            if not hasattr(torch._C, name):
                raise missing_internal(f"torch._C.{name}", "autograd")
        entry = getattr(torch.autograd, _ENTRY, None)
        if entry is None:
            raise missing_internal(f"torch.autograd.{_ENTRY}", "autograd")
        if not _wraps_ours(entry):
            _original = entry
            setattr(torch.autograd, _ENTRY, _run_backward)
    _watchers.append(watcher)


def unwatch(watcher) -> None:
    """Stops calling ``watcher``; the last one out puts the engine entry back.

    Only if it is still ours: an entry someone wrapped around ours since (a
    profiler, another library) stays, and ours inside it passes every call
    through until a block watches again.
    """
    global _original
    if watcher in _watchers:
        _watchers.remove(watcher)
    if not _watchers and _original is not None:
        if getattr(torch.autograd, _ENTRY, None) is _run_backward:
            setattr(torch.autograd, _ENTRY, _original)
            _original = None


def _wraps_ours(entry) -> bool:
    """Whether ``entry`` is ours or wraps it (``functools.wraps`` chains)."""
    seen = set()
    while entry is not None and id(entry) not in seen:
        if entry is _run_backward:
            return True
        seen.add(id(entry))
        entry = getattr(entry, "__wrapped__", None)
    return False


def _refuse_compiled_autograd() -> None:
    """Compiled autograd traces the backward into a graph: the block's node hooks and
    engine callbacks, which FSDP's own backward also relies on, do not run as they
    do in eager (seen: FSDP2 wrong gradients without the block, errors with it)."""
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    if module is not None and getattr(module, "compiled_autograd_enabled", False):
        raise RetainError(
            "no_reshard_between_backwards does not support compiled autograd: this "
            "backward runs under torch._dynamo.compiled_autograd. Run the backward "
            "passes inside the block without it (torch._dynamo.config.compiled_autograd"
            " = False, or outside compiled_autograd._enable(...)); torch.compile of "
            "the forward (per block or whole model) is supported."
        )


def _roots(outputs) -> list:
    nodes, seen = [], set()
    for item in outputs if isinstance(outputs, (tuple, list)) else (outputs,):
        node = item.grad_fn if isinstance(item, torch.Tensor) else getattr(item, "node", None)
        if node is not None and id(node) not in seen:
            seen.add(id(node))
            nodes.append(node)
    return nodes


def _map_inputs(watchers: list, roots: list, args: tuple, kwargs: dict,
                nested: bool = False) -> tuple[tuple, dict]:
    """Lets each watcher map the ``inputs`` of the pass (``()``: every leaf); ``nested``:
    a backward run from inside another one's node (a custom Function's backward, as
    torchjd's autogram does), which may not name managed parameters."""
    in_args = len(args) > _INPUTS_ARG
    inputs = args[_INPUTS_ARG] if in_args else kwargs.get("inputs")
    if not inputs:
        return args, kwargs
    accumulate = bool(kwargs.get("accumulate_grad", True))
    mapped = tuple(inputs)
    for watcher in watchers:
        mapped = watcher.map_inputs(mapped, accumulate, roots, nested)
    if in_args:
        return args[:_INPUTS_ARG] + (mapped,) + args[_INPUTS_ARG + 1 :], kwargs
    return args, {**kwargs, "inputs": mapped}


def _run_backward(outputs, *args, **kwargs):
    original = _original
    if not _watchers:
        return original(outputs, *args, **kwargs)
    if in_backward():
        # See [Note: nested backward passes] in _nested.py.
        watchers = list(_watchers)
        roots = _roots(outputs)
        args, kwargs = _map_inputs(watchers, roots, args, kwargs, nested=True)
        entered = []
        try:
            for watcher in watchers:
                watcher.before_nested()
                entered.append(watcher)
            return _run_seen(original, outputs, args, kwargs, roots,
                             [watcher.on_nested_start for watcher in watchers])
        finally:
            for watcher in entered:
                watcher.after_nested()
    _refuse_compiled_autograd()
    watchers = list(_watchers)
    roots = _roots(outputs)
    args, kwargs = _map_inputs(watchers, roots, args, kwargs)
    try:
        for watcher in watchers:
            watcher.before_backward()
        return _run_seen(original, outputs, args, kwargs, roots,
                         [watcher.on_backward_start for watcher in watchers])
    finally:
        for watcher in watchers:
            watcher.after_backward()


def _run_seen(original, outputs, args: tuple, kwargs: dict, roots: list, calls: list):
    """Runs the backward; ``calls`` run inside it, before its first node."""
    started = []

    def start(grad_outputs):
        if not started:
            started.append(True)
            for call in calls:
                call()

    handles = [node.register_prehook(start) for node in roots]
    _roots_running.append({id(node) for node in roots})
    try:
        return original(outputs, *args, **kwargs)
    finally:
        _roots_running.pop()
        for handle in handles:
            handle.remove()
