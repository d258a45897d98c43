"""Steps that call FSDP2's own methods: the recipe without the library, and
gradient accumulation with the user's ``set_reshard_after_backward(False)``.

Only FSDP2's public ``FSDPModule`` methods. The report wraps the model with
``fully_shard``'s defaults (the root keeps its parameters after forward, the
layers reshard; every unit reshards after backward, gradient sync on); each
step sets what it needs and puts those defaults back in ``finally``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._hooks import StepHooks


def fsdp2_units(model) -> list[Any]:
    """Every ``FSDPModule`` of ``model``; ``ValueError`` if it is not FSDP2."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):  # also refuses a DeepSpeed engine
        raise ValueError(
            f"this mode calls FSDP2's own methods and got {type(model).__name__}: run it with "
            "--backend fsdp2 (a model wrapped with fully_shard)"
        )
    root: Any = model  # an nn.Module (FSDPModule is a mixin)
    return [m for m in root.modules() if isinstance(m, FSDPModule)]


def _restore_defaults(model) -> None:
    """``fully_shard``'s defaults as the report wraps: the root keeps its parameters after
    forward (FSDP2 sets that for the root), the others reshard."""
    model.set_reshard_after_forward(True)
    model.set_reshard_after_forward(False, recurse=False)
    model.set_reshard_after_backward(True)
    model.set_requires_gradient_sync(True)


def recipe_step(model, forward: Callable[[], Any], losses: Callable[[Any], list],
                hooks: StepHooks, *, sync_last: bool) -> None:
    """pytorch #172543: no resharding after forward nor backward, both backwards,
    ``reshard()`` of every unit after the last; ``sync_last``: gradient sync off for
    backward 1 (the unsharded gradients wait for the last backward)."""
    units = fsdp2_units(model)
    try:
        model.set_reshard_after_forward(False)
        model.set_reshard_after_backward(False)
        with hooks.segment():
            out = forward()
            first, last = losses(out)
            hooks.mark("backward1_start")
            if sync_last:
                model.set_requires_gradient_sync(False)
            first.backward(retain_graph=True)
            hooks.mark("backward1_end")
            if sync_last:
                model.set_requires_gradient_sync(True)
            last.backward()
            del out, first, last
        for unit in units:
            unit.reshard()
    finally:
        _restore_defaults(model)


def accumulate_step(model, run_micro_batch: Callable[[], None], *, user_gathered: bool,
                    micro_batches: int = 2) -> None:
    """Gradient accumulation: gradient sync off but for the last micro-batch;
    ``user_gathered``: the user's ``set_reshard_after_backward(False)`` on every unit
    (parameters stay gathered across micro-batches) and ``reshard()`` of every unit
    after the last."""
    units = fsdp2_units(model)
    try:
        if user_gathered:
            model.set_reshard_after_backward(False)
        for index in range(micro_batches):
            model.set_requires_gradient_sync(index == micro_batches - 1)
            run_micro_batch()
        if user_gathered:
            for unit in units:
                unit.reshard()
    finally:
        _restore_defaults(model)
