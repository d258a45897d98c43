"""accelerate's own training loop with ``no_reshard_between_backwards``, on every backend
``accelerator.prepare`` sets up: DDP, FSDP1, FSDP2 and DeepSpeed ZeRO-0..3.

[Note: accelerate's DeepSpeed wrapper in the block]
On FSDP and DDP ``retaining(accelerator, model)`` is the block over ``model`` and nothing
more. On DeepSpeed ``accelerator.backward`` calls ``DeepSpeedEngineWrapper.backward``,
which sets the engine's accumulation boundary from ``accelerator.sync_gradients``, runs
``engine.backward(loss)`` and, at the boundary, ``engine.step()`` (accelerate 1.15).
Inside a block that step would land between two passes, or before the block reduced the
pass it follows: the block refuses it. So while the block runs the wrapper's ``backward``
sets the boundary and runs ``engine.backward`` only, and the engine steps once, after the
block, where [Note: who steps and who scales on DeepSpeed] (``_deepspeed/_step.py``) says
a step is owed: at the accumulation boundary, when any gradient was written since the
last step, whatever wrote it (``accelerator.backward``, ``loss.backward()``,
``block.backward``, ``block.grads`` with ``apply_grads``). The boundary is also set at the
block's entry (the ZeRO-0..2 block reads it there): open the block inside
``accelerator.accumulate(model)``, which decides it per micro-batch. accelerate divides
nothing on DeepSpeed; the engine divides every pass by its accumulation steps. The
transformers Trainer family divides each loss itself and uses the same wrapper
(``fsdp_retain.integrations.transformers``, through ``_retaining`` with its seam).

Clipping under DeepSpeed is the engine's, in its step, from the DeepSpeed config's
``gradient_clipping``: ``accelerator.clip_grad_norm_`` clips nothing there (it returns
the engine's last gradient norm), with or without the block.

Example::

    from fsdp_retain.integrations.accelerate import retaining

    for x, y in loader:
        with accelerator.accumulate(model):
            with retaining(accelerator, model) as block:
                out = model(x)
                accelerator.backward(task_loss(out, y), retain_graph=True)
                accelerator.backward(aux_loss(out))
            optimizer.step()  # DeepSpeed: a no-op, the engine stepped after the block
            optimizer.zero_grad()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from .._api import RetainBlock, no_reshard_between_backwards
from .._common import RetainError
from .._deepspeed._step import Seam, driven_by, take_owed_step

__all__ = ["retaining"]

_WRAPPER = "deepspeed_engine_wrapped"
_FLAVOUR = "accelerate's DeepSpeed wrapper"

ACCELERATE = Seam(
    "accelerate's Accelerator", divided=False, steps_after=True,
    fix="fsdp_retain.integrations.accelerate.retaining(accelerator, model) steps the engine "
        "after the block at the accumulation boundary: leave engine.step() out (accelerate's "
        "optimizer.step() is a no-op under DeepSpeed).",
)

OUTSIDE_ACCUMULATE = (
    "fsdp_retain.integrations.accelerate.retaining(accelerator, model) was entered before "
    "accelerator.accumulate(model) decided this micro-batch's boundary (sync_gradients was "
    "{entry} at the block's entry, {now} at this backward): open it inside "
    "`with accelerator.accumulate(model):`."
)


def retaining(accelerator: Any, model: Any,
              **options: Any) -> contextlib.AbstractContextManager[RetainBlock]:
    """``no_reshard_between_backwards(model, **options)`` for accelerate's own loop:
    ``model`` is what ``accelerator.prepare`` returned; on DeepSpeed,
    ``accelerator.backward`` inside does not step the engine, which steps once after
    the block at the accumulation boundary. See [Note: accelerate's DeepSpeed wrapper in
    the block].

    Example::

        with accelerator.accumulate(model):
            with retaining(accelerator, model) as block:
                out = model(x)
                block.backward(probe_loss(out), param_grads=False, retain_graph=True)
                accelerator.backward(loss(out))
    """
    return _retaining(accelerator, model, ACCELERATE, options)


def is_deepspeed(accelerator: Any) -> bool:
    """Whether the accelerator set up DeepSpeed (its wrapper steps in ``backward``)."""
    return str(getattr(accelerator, "distributed_type", "")).endswith("DEEPSPEED")


@contextlib.contextmanager
def _retaining(accelerator: Any, model: Any, seam: Seam,
               options: dict[str, Any]) -> Iterator[RetainBlock]:
    """The block over ``model`` under ``seam``; on DeepSpeed, the wrapper's ``backward``
    without its step while the block runs, and the owed step after it."""
    if not is_deepspeed(accelerator):
        with no_reshard_between_backwards(model, **options) as block:
            yield block
        return
    wrapper = _require(accelerator, _WRAPPER)
    engine = _require(wrapper, "engine")
    _require(wrapper, "backward")
    if model is not engine:
        raise ValueError(
            f"{seam.who} set up DeepSpeed, and the block got {type(model).__name__}: pass "
            "what accelerator.prepare returned, the DeepSpeedEngine (accelerator."
            "deepspeed_engine_wrapped.engine), not accelerator.unwrap_model(model)."
        )
    boundary = bool(accelerator.sync_gradients)
    engine.set_gradient_accumulation_boundary(is_boundary=boundary)

    def backward(loss: Any, sync_gradients: bool = True, **kwargs: Any) -> None:
        if bool(sync_gradients) != boundary:
            raise RetainError(OUTSIDE_ACCUMULATE.format(entry=boundary, now=sync_gradients))
        if seam.divided:  # the framework divided the loss already (the Trainer family)
            kwargs.setdefault("scale_wrt_gas", False)
        engine.backward(loss, **kwargs)

    own = wrapper.__dict__.get("backward")
    wrapper.backward = backward
    try:
        with driven_by(engine, seam), no_reshard_between_backwards(model, **options) as block:
            yield block
    finally:
        if own is None:
            del wrapper.backward  # the class's own again
        else:
            wrapper.backward = own
    take_owed_step(engine)


def _require(obj: Any, name: str) -> Any:
    if not hasattr(obj, name):
        from importlib.metadata import version

        raise RuntimeError(
            f"fsdp_retain's accelerate integration needs {type(obj).__name__}.{name} "
            f"({_FLAVOUR}), which accelerate {version('accelerate')} does not have: "
            "please report it with your accelerate version."
        )
    return getattr(obj, name)
