"""Backward passes run inside a backward pass of the block (nested passes).

[Note: nested backward passes]
Some code runs backward passes from inside a running one. A tiled MLP (Liger-Kernel's
``LigerTiledMLPFunction``, DeepSpeed's and axolotl's ``TiledMLP``) is a custom
``autograd.Function`` that runs its MLP over sequence tiles under ``no_grad`` in
forward and, in its ``backward``, recomputes each tile with grad enabled and calls
``torch.autograd.backward`` per tile. A cached (GradCache) loss replays its
mini-batches from a hook on the loss, one forward and one backward each. Reentrant
activation checkpointing does the same once per checkpointed region.

FSDP and ZeRO-3 expect each unit's backward once per pass. FSDP2 takes a unit's
forward after its pre-backward for an activation-checkpointing recomputation (no
hooks), and runs its post-backward (the reduction) once per pass: the gradients of a
second tile through a unit would stay unreduced and land in a later pass, or nowhere.
FSDP1 reduces and frees in each tile's backward (the next tile of a unit whose forward
tiles computes with freed storage); ZeRO-3 queues a parameter for reduction once per
tile and fails its bucket check.

So the block groups the nested passes that one node of one of its passes runs (the
node ``torch._C._current_autograd_node()`` names when the first starts) into a
**span**. When a span opens the backend holds the reductions of its units and keeps
them gathered (``BlockBase._open_span``); the nested passes then accumulate into the
unsharded gradients, as tiles of one pass should. The span closes when the node is done
(a post hook on it; a nested pass from another node, or the end of the pass before
FSDP's own end-of-pass work, ``end_pass``, close one whose hook did not run). Then each unit whose backward ran reduces, once, what
the span accumulated, as the policy says for the pass (reduce, or hold back for
``sync_grads="last"``), and is resharded or kept as between passes; a unit still
inside its own backward in the outer pass reduces when that backward ends (its own
post-backward, or ``Span.end_of_pass``). In a probe pass (``param_grads=False``) the
block writes no parameter gradient: what the nested passes accumulated is dropped, and
what the units held before the span is put back.

Nested passes inside a pass that is not the block's (a hook on a loss whose graph
never reaches the model, as a cached loss) are FSDP's own passes: the block sees
them as passes of its own (``_pass_start`` and the backend's pass start).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch


class Span:
    """What the backend does for the nested passes of one outer node; this default
    does nothing (a backend whose units need nothing for them)."""

    def close(self) -> None:
        """The outer pass moves on: reduce once what the span accumulated."""

    def end_of_pass(self) -> None:
        """The outer pass ends (before the backend's own end of pass): what ``close``
        left to it."""

    def abort(self) -> None:
        """An exception: undo ``open`` without collectives."""


class GradStashSpan(Span):
    """The span of a backend whose parameters hold their own ``.grad`` and whose
    reductions the block already holds for the whole pass (DDP, ZeRO stages 0-2).

    [Note: nested passes on replicated gradients]
    There the nested passes only accumulate into ``.grad``, and the end of the outer
    pass reduces it once with the rest of the pass, as the policy says: a span of a pass
    that computes gradients does nothing. A probe pass (``param_grads=False``) writes no
    parameter gradient, but its tiles' passes are plain ``torch.autograd.backward`` calls
    that accumulate into ``.grad`` (what the passes before it left there), and a later
    reduction would fold them into the step. So in a probe pass the span sets aside what
    the parameters hold when it opens (the tiles then write fresh tensors, never in place
    into a held one, which may be a view of a bucket), and at the close, or on an
    exception, drops what the tiles wrote and puts it back.
    """

    def __init__(self, params: list[Any], probing: bool) -> None:
        self._params = params
        self._stash = take_grads(params) if probing else None

    def close(self) -> None:
        stash, self._stash = self._stash, None
        if stash is not None:
            put_grads(self._params, stash)

    def abort(self) -> None:
        self.close()


def kernel_holds(params: list[Any]) -> bool:
    """Whether a pass that starts now is a shard of a tiled kernel that is not the last:
    some parameter's ``ds_grad_is_ready`` is false.

    [Note: passes a tiled kernel holds]
    DeepSpeed's tiled kernels (``TiledMLP``, ``SequenceTiledCompute``,
    ``TiledFusedLogitsLoss`` in ``deepspeed.runtime.sequence_parallel.ulysses_sp``) run a
    backward per shard and mark their ``compute_params`` with ``ds_grad_is_ready =
    False`` for every shard but the last: the shards add up to one gradient, which
    ZeRO's hooks reduce only once the last shard ran. Inside a backward those shard
    passes are nested passes (above). ``TiledFusedLogitsLoss`` runs them inside the
    *forward*: each is a pass of its own, which the block would reduce after every one
    with ``sync_grads="every"``: on ZeRO-1/2 the flush then read the held, never-reduced
    gradient into the step (silently wrong), on DDP it all-reduced once per shard. So a
    pass that starts outside the block's passes while a managed parameter's flag is
    false is no pass of the block: what it accumulates waits in ``.grad`` for the pass
    that completes the kernel (its last shard, flag true), which reduces it with its
    own, as the policy says. Backends whose reduction the block holds for the whole pass
    read this (DDP, ZeRO stages 0-2).
    """
    return any(getattr(p, "ds_grad_is_ready", True) is False for p in params)


def take_grads(params: list[Any]) -> list[tuple[Any, Any]]:
    """Sets aside the ``.grad`` of ``params`` (for ``put_grads``)."""
    stash = [(p, p.grad) for p in params if p.grad is not None]
    for param, _ in stash:
        param.grad = None
    return stash


def put_grads(touched: list[Any], stash: list[tuple[Any, Any]]) -> None:
    """Drops the ``.grad`` of ``touched`` and puts back what ``take_grads`` set aside."""
    for param in touched:
        param.grad = None
    for param, grad in stash:
        param.grad = grad


class NestedPasses:
    """The open span of one block, and how deep the nested passes run."""

    def __init__(self, open_span: Any) -> None:
        # () -> Span, the block's bound method: weakly, the block is in no reference cycle.
        self._open_span = weakref.WeakMethod(open_span)
        self._span: Span | None = None
        self._node: Any = None
        self._node_hook: Any = None
        self._closed: list[Span] = []  # closed in the running pass
        self._counted: list[bool] = []  # per running nested pass: inside a block pass?

    @property
    def depth(self) -> int:
        return sum(self._counted)

    @property
    def outside_block_pass(self) -> bool:
        """A nested pass runs, and no pass of the block around it."""
        return bool(self._counted) and not self._counted[-1]

    def enter(self, in_block_pass: bool) -> None:
        """A nested pass starts (``_pass_start``); ``in_block_pass``: a pass of the
        block runs around it."""
        if in_block_pass:
            node = torch._C._current_autograd_node()
            if self._span is not None and self._node is not node:
                self.close()  # the outer pass moved on to another node (unless nested)
            opener = self._open_span()
            if self._span is None and opener is not None:
                self._span = opener()
                self._node = node
                if node is not None:  # closes when the node is done
                    self._node_hook = node.register_hook(_closer(self))
        self._counted.append(in_block_pass)

    def leave(self) -> None:
        if self._counted:
            self._counted.pop()

    def close(self) -> None:
        """Closes the open span, unless a nested pass still runs (idempotent)."""
        if self._span is None or self.depth:
            return
        span, self._span, self._node = self._span, None, None
        self._remove_hook()
        self._closed.append(span)
        span.close()

    def end_pass(self) -> None:
        """At the end of the outer pass, before the backend's (``BlockBase._start_pass``
        queues it)."""
        self.close()
        closed, self._closed = self._closed, []
        for span in closed:
            span.end_of_pass()

    def abort(self) -> None:
        span, self._span, self._node = self._span, None, None
        self._remove_hook()
        self._counted.clear()
        self._closed.clear()
        if span is not None:
            span.abort()

    def _remove_hook(self) -> None:
        if self._node_hook is not None:
            self._node_hook.remove()  # torch copies a node's hooks before calling them
            self._node_hook = None


def _closer(nested: NestedPasses) -> Any:
    """A post hook for the span's node: the node is done, and its nested passes with it.
    Weakly: the graph may outlive the block."""
    ref = weakref.ref(nested)

    def hook(grad_inputs: Any, grad_outputs: Any) -> None:
        alive = ref()
        if alive is not None:
            alive.close()

    return hook
