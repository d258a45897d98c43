"""What the FSDP1 and FSDP2 backends share: options, pass bookkeeping, errors.

Nothing here touches private torch or DeepSpeed internals; that lives in the
backends (``_fsdp1*.py``, ``_fsdp2.py``, ``_deepspeed.py``) and, for autograd's
engine entry, ``_pass_start.py``.

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
  over the previous pass while ``micro_step_id == 0``; see ``_deepspeed.py``.

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
import warnings
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.nn.utils.rnn import PackedSequence

from ._saved_tensors import SavedTensorCheck
from ._step_guard import refuse_step

_SYNC_GRADS = ("every", "last")

# Attribute set on the root module while a block is active on it.
ACTIVE_ATTR = "_fsdp_retain_active_block"


@dataclasses.dataclass(frozen=True)
class RetainOptions:
    """The keyword options of ``no_reshard_between_backwards``, validated."""

    keep_unsharded: bool | int = True
    sync_grads: str = "every"
    backwards: int | None = None
    check_saved_tensors: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.keep_unsharded, int):  # bool is an int
            raise TypeError(
                f"keep_unsharded must be a bool or an int, got {self.keep_unsharded!r}: "
                "pass True to keep parameters unsharded between backward passes, "
                "False to re-gather them per layer, or a per-rank byte budget such as "
                "8 * 2**30 to keep the units that fit"
            )
        if not isinstance(self.keep_unsharded, bool) and self.keep_unsharded < 0:
            raise ValueError(
                f"keep_unsharded as a byte budget must be >= 0, got {self.keep_unsharded}: "
                "pass the bytes of unsharded parameters each rank may hold between "
                "passes (0 keeps nothing, like False)"
            )
        if self.sync_grads not in _SYNC_GRADS:
            raise ValueError(
                f"sync_grads must be one of {_SYNC_GRADS}, got {self.sync_grads!r}: "
                "'every' reduces gradients after each backward (readable .grad "
                "between passes), 'last' reduces them once after the last backward"
            )
        if self.backwards is not None and (
            isinstance(self.backwards, bool)
            or not isinstance(self.backwards, int)
            or self.backwards < 1
        ):
            raise ValueError(
                f"backwards must be a positive int or None, got {self.backwards!r}: "
                "pass the number of backward passes you will run inside the block, "
                "or None if it is not known in advance"
            )
        if not isinstance(self.check_saved_tensors, bool):
            raise TypeError(
                f"check_saved_tensors must be a bool, got {self.check_saved_tensors!r}: "
                "pass True to check that tensors saved for backward are unchanged when "
                "a later pass reads them, or False (the default) to skip the check"
            )


def kept_units(units: list[tuple[Any, int]], keep_unsharded: bool | int) -> set[Any]:
    """The units whose unsharded parameters a block keeps between passes.

    ``units`` are ``(unit, unsharded parameter bytes per rank)`` in backward
    order, the unit whose backward runs first first. ``True`` keeps every unit,
    ``False`` none. A byte budget goes through the units in that order and
    keeps each one whose bytes still fit in what is left: first the units
    nearest the output, whose re-gather could not hide behind compute at the
    start of the next pass; a unit too large for the rest (often the root, with
    the embedding and the output layer) is skipped, not the end of the walk.
    Units that free nothing (0 bytes, e.g. ``NO_SHARD``) are always kept.
    """
    if isinstance(keep_unsharded, bool):
        return {unit for unit, _ in units} if keep_unsharded else set()
    kept, left = set(), keep_unsharded
    for unit, nbytes in units:
        if nbytes <= left:
            kept.add(unit)
            left -= nbytes
    return kept


class PassTracker:
    """Counts backward passes inside one block and checks them against ``backwards``."""

    def __init__(self, backwards: int | None) -> None:
        self.backwards = backwards
        self.started = 0
        self.finished = 0
        self._warned_extra = False

    def begin(self) -> int:
        """Registers the start of a backward pass; returns its 1-based index."""
        self.started += 1
        if (
            self.backwards is not None
            and self.started > self.backwards
            and not self._warned_extra
        ):
            self._warned_extra = True
            warnings.warn(
                f"no_reshard_between_backwards(backwards={self.backwards}) saw backward "
                f"pass {self.started}: parameters were already resharded after pass "
                f"{self.backwards}, so this pass gathers them again (gradients stay "
                "correct, memory and communication do not). Pass the real number of "
                "passes, or backwards=None.",
                stacklevel=2,
            )
        return self.started

    def end(self) -> None:
        self.finished += 1

    @property
    def in_backward(self) -> bool:
        return self.started > self.finished

    def warn_if_short(self) -> None:
        if self.backwards is not None and 0 < self.started < self.backwards:
            warnings.warn(
                f"no_reshard_between_backwards(backwards={self.backwards}) exited after "
                f"{self.started} backward pass(es); parameters were kept until the end "
                "of the block. Pass the real number of passes, or backwards=None.",
                stacklevel=3,
            )



class BlockBase:
    """Lifecycle shared by the backends: install now or at the first forward, then
    finish (clean exit) or abort (exception exit), and always uninstall.

    A backend sets ``self.model``, ``self.options``, ``self.tracker`` and
    implements ``_root_decided``, ``_install_at_first_forward``, ``_install``,
    ``_finish``, ``_abort`` and ``_uninstall`` (which calls ``_release_model``).
    For probe passes (``backward(..., param_grads=False)``) it sets
    ``self._unit_inputs = {}``, calls ``self.capture_unit_inputs(module)`` on
    each FSDP unit module while installing, and implements ``_in_backward``,
    ``_before_probe`` (what must hold before FSDP's first pre-backward hook of
    the pass runs) and ``_end_probe``; inside the pass ``self.probing`` is
    true, so its pass hooks can keep every gradient reduction off.
    """

    model: nn.Module
    options: RetainOptions
    tracker: PassTracker
    # (id(node), output_nr) -> GradientEdge of each FSDP unit input seen in forward.
    _unit_inputs: dict[tuple[int, int], Any]
    _installed: bool = False
    _deferred_hook: Any = None
    # True while a probe pass runs (public: hooks read it, see pass_index).
    probing: bool = False
    _exited: bool = False
    _saved_check: SavedTensorCheck | None = None
    _step_hook: Any = None

    if TYPE_CHECKING:  # implemented by each backend

        def _root_decided(self) -> bool: ...
        def _install_at_first_forward(self, module: nn.Module, args: Any) -> None: ...
        def _install(self) -> None: ...
        def _finish(self) -> None: ...
        def _abort(self) -> None: ...
        def _uninstall(self) -> None: ...

    @property
    def backward_passes(self) -> int:
        """Backward passes seen so far in this block, probe passes included."""
        return self.tracker.started

    @property
    def pass_index(self) -> int:
        """1-based index of the running backward pass (0 before the first).

        For hooks that act in one pass only: autograd captures a module's
        backward hooks at forward, so over a retained graph they fire in every
        pass. Inside a pass this is its index from the moment the pass reaches
        the model; between passes, the index of the last one. ``probing`` is
        true during a probe pass (``backward(..., param_grads=False)``).

        Example::

            def collect(module, grad_input, grad_output):
                if block.probing:  # influence probe only, not the policy loss
                    store(grad_output[0])
        """
        return self.tracker.started

    def backward(
        self,
        loss: torch.Tensor,
        *,
        param_grads: bool = True,
        retain_graph: bool | None = None,
    ) -> None:
        """One backward pass of ``loss`` inside the block.

        ``param_grads=True`` is ``loss.backward(retain_graph=retain_graph)``.
        ``param_grads=False`` is a probe pass: hooks on activations and full
        backward hooks on modules inside FSDP units fire with the gradients a
        plain backward gives them, but no parameter gradient is computed, no
        ``.grad`` changes (nor the gradients FSDP holds unreduced: ``no_sync()``
        micro-batches, passes held back by ``sync_grads="last"``), and nothing
        is reduced. See [Note: probe passes].

        Example::

            with no_reshard_between_backwards(model) as block:
                out = model(batch)
                block.backward(logp_loss(out), param_grads=False, retain_graph=True)
                policy_loss(out).backward()
        """
        if not isinstance(param_grads, bool):
            raise TypeError(
                f"param_grads must be a bool, got {param_grads!r}: True runs a normal "
                "backward, False a probe pass that only feeds gradient hooks"
            )
        if self._exited:
            raise RuntimeError(
                "block.backward() was called after its no_reshard_between_backwards "
                "block exited. Call it inside the `with` statement."
            )
        if param_grads:
            loss.backward(retain_graph=retain_graph)
            return
        _refuse_reentrant_checkpoint(loss)
        edges = list(self._unit_inputs.values())
        if not edges:
            raise ValueError(
                "block.backward(..., param_grads=False) has nothing to differentiate "
                "against: no activation in this block's forward requires grad (the "
                "forward ran under torch.no_grad(), or every parameter is frozen). Run "
                "the forward inside the block with grad enabled, or use "
                "param_grads=True."
            )
        self._before_probe()
        self.probing = True
        try:
            # See [Note: probe passes]. Gradients of the unit inputs are
            # returned, not stored; materialize nothing into .grad.
            torch.autograd.grad(loss, edges, retain_graph=retain_graph, allow_unused=True)
        finally:
            self.probing = False
        # Normally done at the pass end already; not if the loss reached no unit.
        self._end_probe()

    # Probe passes #
    def capture_unit_inputs(self, module: nn.Module) -> object:
        """Forward pre-hook handle that records ``module``'s inputs as probe targets.

        Registered in front of FSDP's own pre-forward, so it sees the inputs
        before FSDP wraps them (FSDP2 routes them through its post-backward
        autograd function; FSDP1 casts them): the probe pass then runs FSDP's
        per-unit post-backward for every unit it walks through.
        """
        return module.register_forward_pre_hook(
            self._capture_inputs, prepend=True, with_kwargs=True
        )

    def capture_sources(self, root: nn.Module) -> list[Any]:
        """Forward hook handles that record, as probe targets, the outputs of each
        module under ``root`` whose inputs need no gradient (see [Note: probe passes])."""
        return [
            module.register_forward_hook(self._capture_sources, with_kwargs=True)
            for module in eager_modules(root)
        ]

    def _capture_sources(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if compiling() or not torch.is_grad_enabled() or self._in_backward():
            return
        if grad_tensors((args, kwargs)):
            return  # reached through its inputs
        self._record_edges(grad_tensors(output))

    def _capture_inputs(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if compiling() or not torch.is_grad_enabled() or self._in_backward():
            return  # no graph, or an activation-checkpointing recompute
        self._record_edges(grad_tensors((args, kwargs)))

    def _record_edges(self, tensors: list[torch.Tensor]) -> None:
        from torch.autograd.graph import get_gradient_edge

        for tensor in tensors:
            # An edge keeps the autograd node, not the activation's memory.
            edge = get_gradient_edge(tensor)
            self._unit_inputs.setdefault((id(edge.node), edge.output_nr), edge)

    def _before_probe(self) -> None:
        """Backend: prepare FSDP before a probe pass starts."""

    def _end_probe(self) -> None:
        """Backend: undo ``_before_probe`` and the pass's flags (idempotent)."""

    def _in_backward(self) -> bool:
        """Backend: whether autograd is running a backward now."""
        raise NotImplementedError

    def enter(self) -> None:
        # See [Note: why an optimizer step inside the block is refused].
        self._step_hook = refuse_step(self.model)
        if self.options.check_saved_tensors:
            self._saved_check = SavedTensorCheck()
            self._saved_check.push()
        setattr(self.model, ACTIVE_ATTR, True)
        try:
            if self._root_decided():
                self._install()
            else:
                # FSDP picks its root at the first forward; install then.
                self._deferred_hook = self.model.register_forward_pre_hook(
                    self._install_at_first_forward, prepend=True
                )
        except BaseException:
            try:
                self._uninstall()
            finally:
                self._pop_guards()
            raise

    def exit(self, exc: BaseException | None) -> None:
        self._exited = True
        self._unit_inputs.clear()
        try:
            if not self._installed:
                return
            if exc is None:
                self._finish()
            else:
                self._abort()
        finally:
            try:
                self._uninstall()
            finally:
                self._pop_guards()

    def _pop_guards(self) -> None:
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        # The graph keeps the hooks it already has; see
        # [Note: why a retained graph can silently read changed saved tensors].
        if self._saved_check is not None:
            self._saved_check.pop()

    def _take_deferred_hook(self) -> None:
        self._deferred_hook.remove()
        self._deferred_hook = None

    def _release_model(self) -> None:
        if self._deferred_hook is not None:
            self._deferred_hook.remove()
            self._deferred_hook = None
        self._installed = False
        if getattr(self.model, ACTIVE_ATTR, False):
            delattr(self.model, ACTIVE_ATTR)

# The node of torch.utils.checkpoint(..., use_reentrant=True), which refuses
# torch.autograd.grad (it runs its own nested backward without `inputs`).
_REENTRANT_CHECKPOINT = "CheckpointFunctionBackward"


def _refuse_reentrant_checkpoint(loss: torch.Tensor) -> None:
    """Raises before a probe pass that would reach a reentrant checkpoint."""
    root = loss.grad_fn
    # Visited nodes are kept alive: ids of freed node wrappers could be reused.
    stack, seen = ([root] if root is not None else []), {}
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        if type(node).__name__ == _REENTRANT_CHECKPOINT:
            raise ValueError(
                "block.backward(..., param_grads=False) reached a reentrant activation "
                "checkpoint (torch.utils.checkpoint with use_reentrant=True), which "
                "cannot run a probe pass: it refuses torch.autograd.grad. Use "
                "non-reentrant checkpointing (checkpoint(..., use_reentrant=False); in "
                "HF transformers model.gradient_checkpointing_enable("
                "gradient_checkpointing_kwargs={'use_reentrant': False})), or run this "
                "pass with param_grads=True. Nothing was changed."
            )
        stack.extend(next_node for next_node, _ in node.next_functions if next_node is not None)


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


def compiling() -> bool:
    """Whether dynamo is tracing the caller: see [Note: the block under torch.compile]."""
    return torch.compiler.is_compiling()


def create_graph_needs_keep() -> RuntimeError:
    """Backward hooks run with grad mode on only under ``create_graph=True``."""
    return RuntimeError(
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


def require_attr(obj: object, name: str, flavour: str) -> object:
    """``getattr`` that fails loudly, naming the torch version."""
    try:
        return getattr(obj, name)
    except AttributeError:
        raise missing_internal(f"{type(obj).__name__}.{name}", flavour) from None


_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, stacklevel=3)


def first_wrapped_submodule(model: nn.Module, is_wrapped) -> str | None:
    """Name of the first submodule (not ``model``) for which ``is_wrapped`` is true."""
    for name, module in model.named_modules():
        if module is not model and is_wrapped(module):
            return name
    return None
