"""What every backend shares: the notes on how the block works, and small helpers
(errors, ``loud``, the tensors of a forward's inputs and outputs, which modules
run eagerly under ``torch.compile``).

Nothing here touches private torch or DeepSpeed internals; that lives in the
backends (``_fsdp1*.py``, ``_fsdp2*.py``, ``_deepspeed*.py``) and, for autograd's
engine entry, ``_pass_start.py``. The lifecycle every backend shares is
``_lifecycle.py``; what the options mean per pass, ``_policy.py``.

[Note: why a retained graph needs unsharded storage]
FSDP keeps each parameter sharded and all-gathers the full (unsharded) tensor
just before a unit's forward. The autograd graph built by that forward saves
the *unsharded* tensors (e.g. the weight of a matmul, needed for the input
gradient). FSDP frees their storage after the unit's backward, because it
assumes each graph is walked exactly once:

- FSDP1 reshards in the post-backward hook (``_should_free_in_backward``):
  the flat parameter's storage is resized to 0 while the saved views still
  point at it. Its root final callback also clears
  ``_needs_pre_backward_unshard`` and drops the post-backward hooks, so a
  second backward neither re-gathers (``setStorage ... storage of size 0``)
  nor reduce-scatters (silently missing gradients).
- FSDP2 also resizes the all-gather output to 0 after backward, but its
  pre-backward hook re-gathers on every pass, so a retained graph works at the
  price of one all-gather per unit per extra backward, plus a reduce-scatter
  per unit per backward.
- DeepSpeed ZeRO-3 releases a module's parameters after its backward
  (``release_sub_module`` frees each parameter no submodule still uses) by
  pointing ``param.data`` at an empty tensor; the graph saved the parameter
  itself, so pass 2 sees size 0. Its pre-backward fetch and post-backward
  release are counted once per forward, and its gradient reduction copies
  over the previous pass while ``micro_step_id == 0``; see ``_deepspeed/_block.py``.

FSDP1 and FSDP2 learn that a backward starts, and re-gather a unit, from hooks on unit
outputs. A pass that starts inside a unit, or reaches a unit's parameters
before its outputs (the graph of a ``create_graph=True`` gradient), meets
freed storage, and under FSDP1 also unprepared gradients and a root that does
not know a backward is running.

``no_reshard_between_backwards`` keeps that storage alive between passes
(``keep_unsharded=True``) or makes sure it is re-gathered before each pass
(``keep_unsharded=False``), and decides when gradients are reduced
(``sync_grads``). When the block ends the storage is freed again; the graph
may still hold the tensor objects, but they then own no memory.

[Note: probe passes]
``block.backward(loss, param_grads=False)`` is a backward that exists only for
its hooks on activations. It differentiates ``loss`` with respect to the
activation frontier of the forward, recorded as autograd edges:

- the inputs of the FSDP units that require grad (by a forward pre-hook that
  runs before FSDP's own pre-forward, so FSDP's per-unit backward machinery
  sees the pass), and
- the outputs of every module whose inputs need no gradient but whose outputs
  do: the first activations that depend on parameters only (a frozen
  embedding's next layer, a LoRA adapter beside a frozen base layer, a
  trainable norm on a frozen input).

with ``torch.autograd.grad``. The engine then runs only the nodes on a path
from ``loss`` to those edges: every weight-gradient matmul and every
``AccumulateGrad`` is skipped, so no parameter gradient exists to reduce.
Every tensor hook on a module's input or output, and every full backward hook
on a module, that a plain backward fires, fires with the same gradient
(a tensor captured as an edge still runs its hooks). Hooks on parameters do
not fire, nor hooks on a tensor computed from parameters alone *inside* a
module's forward whose inputs do need gradients (a functional op on two
weights); hook the module's output instead.

FSDP's own backward machinery still runs: pre-backward hooks on unit outputs
(re-gathering with ``keep_unsharded=False``), per-unit post-backward (FSDP2's
autograd function on unit inputs; FSDP1's ``AccumulateGrad`` hook does not
fire) and the root final callback. For the pass the backend turns gradient
reduction off (FSDP2 ``reduce_grads=False``, FSDP1 ``_sync_gradients=False``)
and puts back what FSDP moves aside on the way (FSDP1's pre-backward moves a
reduced ``.grad`` into ``_saved_grad_shard``), so ``.grad`` and the gradients
FSDP holds unreduced (``no_sync()`` micro-batches, ``sync_grads="last"``)
come out exactly as they went in. A probe pass is a backward pass for the
block's bookkeeping: it counts toward ``backwards=N`` and
``backward_passes``.

[Note: the block under torch.compile]
The block's forward hooks record autograd nodes and edges of real tensors.
Where a hook runs inside a region dynamo compiles (a unit compiled in place,
``block.compile(fullgraph=True)``; the modules inside an ``OptimizedModule``),
there are no such tensors, and touching autograd-private state would break the
graph. The block registers no hook inside such a region (``eager_modules``:
dynamo may guard on a module's hook dicts, torch 2.9 does, and the block's
hooks are new in every block, so each step would recompile), and each hook
also returns at once while ``torch.compiler.is_compiling()`` (before touching
its module: dynamo guards on what a hook reads). FSDP's own hooks run outside the
compiled graphs, and so do the block's hooks on the FSDP modules themselves
(FSDP1 units, FSDP2 roots and torchtitan-style wrappers), which is where pass
boundaries, the reduction guards and ``keep_unsharded`` live. What a compiled
region costs: its inner nodes are not recorded, so a probe pass reaches it
from below (the compiled backward runs whole, weight gradients included, but
nothing is accumulated), and with ``keep_unsharded=False`` a pass that starts
inside a compiled unit is not seen in time. Compiled autograd (the backward
traced by dynamo) is refused in ``_pass_start``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.utils.rnn import PackedSequence

_log = logging.getLogger("fsdp_retain")

# Attribute set on the root module while a block is active on it.
ACTIVE_ATTR = "_fsdp_retain_active_block"


class RetainError(RuntimeError):
    """An error the block raises on purpose; its message names the fix."""


def loud(fn):
    """Autograd may swallow or mask errors raised in hooks and callbacks: print an
    unexpected one (with its rank) before it propagates. A ``RetainError`` is
    expected and already explains itself, so it is not printed."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RetainError:
            raise
        except BaseException:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            print(f"[rank {rank}] fsdp_retain internal error:\n{traceback.format_exc()}",
                  flush=True)
            raise

    return wrapper


class Liveness:
    """Whether a block is still open; the only state the graph's guard hooks keep.

    Graphs outlive the block: a backend hooks its modules' forward outputs with
    ``refuse_after_exit``, registered before the wrapper's own backward hooks, so that a
    backward reaching them after the block exited raises ``after_exit`` (the backend's
    message, naming what the pass would break) before the wrapper runs anything."""

    exited = False

    def __init__(self, after_exit: str) -> None:
        self.after_exit = after_exit

    @loud
    def refuse_after_exit(self, grad: torch.Tensor) -> None:
        if self.exited:
            raise RetainError(self.after_exit)


def queue_callback(fn) -> None:
    """Runs ``fn`` when the running backward ends (call only inside a pass)."""
    from torch.autograd import Variable

    Variable._execution_engine.queue_callback(fn)


def grad_tensors(obj: Any, found: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The tensors that require grad in a forward's inputs or outputs, looking
    into the containers FSDP registers its hooks through (dataclasses, packed
    sequences, dicts, lists, tuples, sets).

    A plain function on purpose: FSDP's helper is a closure that refers to
    itself, a reference cycle that keeps the hook it is given (and whatever
    that refers to) alive until the garbage collector runs.
    """
    if found is None:
        found = []
    if isinstance(obj, torch.Tensor):
        if obj.requires_grad:
            found.append(obj)
    elif hasattr(obj, "__dataclass_fields__") and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            grad_tensors(getattr(obj, field.name), found)
    elif isinstance(obj, PackedSequence):
        grad_tensors(obj.data, found)
    elif isinstance(obj, dict):
        for value in obj.values():
            grad_tensors(value, found)
    elif isinstance(obj, (list, tuple, set)):
        for value in obj:
            grad_tensors(value, found)
    return found


def is_compiled_in_place(module: nn.Module) -> bool:
    """``module.compile()``: its own hooks run inside the compiled region."""
    return getattr(module, "_compiled_call_impl", None) is not None


def eager_modules(root: nn.Module, stop=None):
    """``root`` and the modules under it whose hooks run eagerly: not inside a
    region dynamo compiles (a module compiled in place, and everything under it;
    what an ``OptimizedModule`` wraps). ``stop(module)`` true: not descended into.
    See [Note: the block under torch.compile].
    """
    from torch._dynamo.eval_frame import OptimizedModule

    stack = [root]
    while stack:
        module = stack.pop()
        if is_compiled_in_place(module):
            continue
        yield module
        if not isinstance(module, OptimizedModule):
            stack.extend(c for c in module.children() if stop is None or not stop(c))


def has_own_params(module: nn.Module) -> bool:
    """Whether ``module`` registers a parameter itself (not through a submodule)."""
    return any(p is not None for p in module._parameters.values())


def module_parameters(root: nn.Module) -> list[nn.Parameter]:
    """``list(root.parameters())``, in its order, without its generators: a walk some
    backends run at every block entry (a few times faster; the names it calls are
    looked up once)."""
    params: list[nn.Parameter] = []
    seen: set[int] = set()
    visited: set[int] = set()
    stack: list[Any] = [root]
    pop, extend, append = stack.pop, stack.extend, params.append
    see, visit = seen.add, visited.add
    while stack:
        module = pop()
        if module is None or id(module) in visited:
            continue
        visit(id(module))
        for param in module._parameters.values():
            if param is not None and id(param) not in seen:
                see(id(param))
                append(param)
        extend(reversed(module._modules.values()))  # popped first to last: named_modules' pre-order
    return params


# Whether dynamo is tracing the caller: see [Note: the block under torch.compile]. The
# function itself, not a wrapper: module hooks call it at every module call.
compiling: Callable[[], bool] = torch.compiler.is_compiling


def create_graph_needs_keep() -> RetainError:
    """Backward hooks run with grad mode on only under ``create_graph=True``."""
    return RetainError(
        "no_reshard_between_backwards: a backward with create_graph=True (higher-order "
        "gradients, gradient penalties) needs keep_unsharded=True. The gradient graph "
        "it builds uses the unsharded parameters outside FSDP's hooks, so they cannot "
        "be re-gathered per layer in a later backward."
    )


def missing_internal(what: str, flavour: str) -> RuntimeError:
    """Error for a private torch internal that this torch version lacks."""
    return RuntimeError(
        f"fsdp_retain: {flavour} internal {what!r} is missing in torch "
        f"{torch.__version__}. This fsdp_retain release supports the torch versions "
        "listed in its README; pin one of those or report the version."
    )


def require_attrs(obj: object, names: tuple[str, ...], flavour: str) -> None:
    """Checks that ``obj`` has every name (without running properties), failing
    loudly with the first missing one: a block probes what it will touch at
    install, not in the middle of a backward."""
    import inspect

    missing = object()
    for name in names:
        if isinstance(obj, nn.Module) and any(
            name in where for where in (obj._modules, obj._parameters, obj._buffers)
        ):
            continue
        if inspect.getattr_static(obj, name, missing) is missing:
            raise missing_internal(f"{type(obj).__name__}.{name}", flavour)


def require_attr(obj: object, name: str, flavour: str) -> object:
    """``getattr`` that fails loudly, naming the torch version."""
    try:
        return getattr(obj, name)
    except AttributeError:
        raise missing_internal(f"{type(obj).__name__}.{name}", flavour) from None


def warn_once(message: str) -> None:
    """Logs ``message`` once per process (``torch._logging.warning_once``)."""
    torch._logging.warning_once(_log, message)


def first_wrapped_submodule(model: nn.Module, is_wrapped) -> str | None:
    """Name of the first submodule (not ``model``) for which ``is_wrapped`` is true."""
    for name, module in model.named_modules():
        if module is not model and is_wrapped(module):
            return name
    return None
