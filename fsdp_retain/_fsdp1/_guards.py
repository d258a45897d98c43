"""Invariant checks of the FSDP1 backend (private FSDP1 access).

Part of the FSDP1 backend with ``_block.py``. The block trusts that it saw
every forward whose graph it is asked to backpropagate, and that FSDP1's
post-backward hook runs for every unit a pass accumulates into. These checks
turn a state that would otherwise give a silently wrong gradient into a
``RuntimeError`` that names the block and the fix.

[Note: what the FSDP1 guards check]
- A pass over a graph whose forward ran before the block (``out = model(x)``
  above the ``with``) is refused at its start, before any node runs: the
  block recorded nothing of that forward, so it cannot keep or re-arm what
  FSDP1 frees and unhooks after the first pass (``forward_outside_block``).
- Every unit whose flat parameter's ``AccumulateGrad`` ran in a pass must also
  have run FSDP1's post-backward hook (which reduces, or keeps the gradient
  for ``no_sync()``) before FSDP1's final callback finalizes the pass. A
  post-accumulate-grad hook on each flat parameter sees every accumulation,
  in nested (reentrant-checkpointing) backwards too, and clears
  ``_post_backward_called``; FSDP1's hook sets it again right after
  (``PostBackwardCheck``). Checked before FSDP1's final callback where the
  block queues it; where FSDP1's root pre-backward hook queued it first (a
  backward started at the root's output), after it, where FSDP1 left that
  flag only for units it did not reduce.
- After a pass that reduced a sharded unit, its ``.grad`` is the shard or
  ``None`` (``check_sharded_grads``): an unsharded ``.grad`` there means the
  reduction was skipped. (For ``NO_SHARD`` the reduced and unreduced
  gradients look alike; that case relies on the first check.)

FSDP1's post-backward hook may run more than once for one unit in a pass
(reentrant checkpointing of several regions that share a flat parameter):
each run reduces that region's part and adds it to the saved shard, which is
right, so it is not refused.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from .._common import RetainError, loud

if TYPE_CHECKING:
    from ._units import Unit

FORWARD_OUTSIDE = (
    "no_reshard_between_backwards: this backward runs over a graph whose forward ran "
    "before the block was entered (FSDP1 unit(s): {units}). The block keeps and re-arms "
    "only what its own forwards set up, so a second pass over this graph would give "
    "wrong or unreduced gradients. Nothing was changed. Run the forward inside the "
    "block:\n    with no_reshard_between_backwards(model):\n        out = model(x)\n"
    "        loss1.backward(retain_graph=True)\n        loss2.backward()"
)

NOT_REDUCED = (
    "no_reshard_between_backwards: in this backward FSDP1 accumulated a gradient into "
    "unit(s) {units} without running FSDP1's post-backward hook (its reduction), so "
    "the gradient would be left unreduced and silently wrong. This happens when the "
    "graph was built outside the block's forward (a forward before the `with`), or when "
    "a recomputed forward used a parameter node FSDP1 did not hook (parameter mixed "
    "precision with reentrant activation checkpointing). Run the forward inside the "
    "block; with reentrant checkpointing under parameter mixed precision use "
    "non-reentrant checkpointing (use_reentrant=False)."
)

NOT_SHARDED = (
    "no_reshard_between_backwards: after this backward FSDP1 unit(s) {units} hold an "
    "unsharded .grad where a reduced shard was expected; the optimizer would apply a "
    "wrong gradient. Please report this with the model's FSDP configuration; as a "
    "workaround run each backward after its own forward."
)


AFTER_EXIT = (
    "no_reshard_between_backwards: this backward runs over a graph whose forward ran "
    "inside a no_reshard_between_backwards block that has already exited. When the "
    "block ended, FSDP1 freed the unsharded parameters this graph saved and dropped "
    "its gradient-reduction hooks, so the pass would fail (setStorage ... storage of "
    "size 0) or leave gradients unreduced. Move this backward inside the block, "
    "before the `with` statement ends (or run a new forward for it)."
)

GRADS_OF_GRADS = (
    "no_reshard_between_backwards: this backward has create_graph=True and accumulates "
    "into FSDP1 parameters' .grad, which FSDP1 cannot reduce (\"FSDP does not support "
    "gradients of gradients\"). Nothing was changed. Build the inner gradient with "
    "torch.autograd.grad(..., create_graph=True) and backpropagate the outer loss "
    "with a plain .backward() in a later pass of the same block."
)


def check_not_outside(units: list[Unit], run) -> None:
    """Refuses a pass over a forward that ran before the block, before any node runs."""
    outside = [
        u
        for u in units
        if u.outside is not None
        and run(u.outside)
        and not u.reaches_outputs(run)
        and not any(map(run, u.inner_nodes))
    ]
    if outside:
        raise refuse(FORWARD_OUTSIDE, outside)


def unit_names(units: Iterable[Unit]) -> str:
    names = sorted(u.name for u in units)
    return ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")


def refuse(template: str, units: Iterable[Unit]) -> RetainError:
    """One of this module's errors, naming the units."""
    return RetainError(template.format(units=unit_names(units)))


class PostBackwardCheck:
    """Sees each accumulation into a flat parameter; checks FSDP1 reduced it."""

    def __init__(self) -> None:
        self.accumulated: set[Unit] = set()

    def install(self, units: list[Unit]) -> list[Any]:
        hooks = []
        ref = weakref.ref(self)
        for unit in units:
            flat_param = unit.flat_param
            if flat_param.requires_grad:
                hooks.append(
                    flat_param.register_post_accumulate_grad_hook(_Accumulated(ref, unit))
                )
        return hooks

    def begin_pass(self) -> None:
        self.accumulated = set()

    def unreduced(self) -> list[Unit]:
        """Units that accumulated in this pass but FSDP1's post-backward did not see."""
        return [
            u for u in self.accumulated if not getattr(u.flat_param, "_post_backward_called", True)
        ]

    @loud
    def check(self) -> None:
        """Queued before FSDP1 finalizes a pass: raises where a unit accumulated but
        FSDP1's post-backward hook did not run."""
        unreduced = self.unreduced()
        if unreduced:
            raise refuse(NOT_REDUCED, unreduced)

    def check_at_pass_end(self) -> list[Unit]:
        """After FSDP1 finalized the pass, before the block restores ``_sync_gradients``:
        the units the pass reduced; raises where one accumulated unreduced."""
        reduced = [u for u in self.accumulated if u.state._sync_gradients]
        # FSDP's finalize cleared _post_backward_called only where it reduced.
        unreduced = [u for u in self.unreduced() if u not in reduced]
        if unreduced:
            raise refuse(NOT_REDUCED, unreduced)
        return reduced


class _Accumulated:
    # A weak reference: the hook lives on the parameter, the block must not.
    def __init__(self, ref, unit) -> None:
        self.ref = ref
        self.unit = unit

    def __call__(self, param: torch.Tensor) -> None:
        check = self.ref()
        if check is None:
            return
        check.accumulated.add(self.unit)
        # FSDP1's post-backward hook on this AccumulateGrad node runs right
        # after this one and sets it again.
        param._post_backward_called = False


def check_sharded_grads(units: list[Unit]) -> None:
    """Each reduced sharded unit's ``.grad`` is its shard (or ``None``)."""
    bad = [
        u
        for u in units
        if u.handle.uses_sharded_strategy
        and u.flat_param.grad is not None
        and u.flat_param.grad.shape != u.flat_param._sharded_size
    ]
    if bad:
        raise refuse(NOT_SHARDED, bad)
