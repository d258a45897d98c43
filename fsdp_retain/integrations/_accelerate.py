"""What the Trainer integration needs of accelerate's private behaviour, in one place.

[Note: DeepSpeed's step under the Trainer]
Under DeepSpeed, ``Accelerator.backward`` calls ``DeepSpeedEngineWrapper.backward``, which
runs ``engine.backward(loss)`` and, at a gradient-accumulation boundary
(``accelerator.sync_gradients``), ``engine.step()`` right after it (accelerate 1.15). Inside
``no_reshard_between_backwards`` that step would run between two passes, or before the
block reduced the pass it follows: the block refuses it (``RetainError: engine.step() was
called inside ...``). So while the Trainer's step runs in the block, the wrapper's
``backward`` only marks the boundary and runs ``engine.backward``; the engine steps once,
after the block exited, when a backward of the step ran at the boundary. The engine's
boundary is also set before the block is entered, from ``accelerator.sync_gradients``
(the Trainer sets it per micro-batch): the ZeRO stage 0-2 block reads it at entry.

The engine's ``backward`` divides the loss by ``gradient_accumulation_steps`` unless told
``scale_wrt_gas=False``. The Trainer's own ``training_step`` tells it (it divided the loss
by ``current_gradient_accumulation_steps`` already, as on every other backend), an
overriding ``training_step`` written for DDP or FSDP does not: in the block the wrapper
passes ``scale_wrt_gas=False`` unless the caller says otherwise, so that the same
``training_step`` is right on every backend.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

_WRAPPER = "deepspeed_engine_wrapped"
_FLAVOUR = "accelerate's DeepSpeed wrapper"


def _require(obj: Any, name: str) -> Any:
    if not hasattr(obj, name):
        from importlib.metadata import version

        raise RuntimeError(
            f"fsdp_retain's Trainer integration needs {type(obj).__name__}.{name} "
            f"({_FLAVOUR}), which accelerate {version('accelerate')} does not have: "
            "please report it with your accelerate version."
        )
    return getattr(obj, name)


def is_deepspeed(accelerator: Any) -> bool:
    """Whether the accelerator set up DeepSpeed (its engine steps in ``backward``)."""
    return str(getattr(accelerator, "distributed_type", "")).endswith("DEEPSPEED")


@contextlib.contextmanager
def engine_steps_after(accelerator: Any) -> Iterator[None]:
    """Around the block: DeepSpeed's ``engine.step()`` after it, not inside it; see
    [Note: DeepSpeed's step under the Trainer]. Nothing on other backends."""
    if not is_deepspeed(accelerator):
        yield
        return
    wrapper = _require(accelerator, _WRAPPER)
    engine = _require(wrapper, "engine")
    _require(wrapper, "backward")
    boundary = bool(accelerator.sync_gradients)
    engine.set_gradient_accumulation_boundary(is_boundary=boundary)
    stepped = [False]

    def backward(loss: Any, sync_gradients: bool = True, **kwargs: Any) -> None:
        engine.set_gradient_accumulation_boundary(is_boundary=sync_gradients)
        kwargs.setdefault("scale_wrt_gas", False)  # the Trainer family's losses are divided
        engine.backward(loss, **kwargs)
        stepped[0] = stepped[0] or sync_gradients

    own = wrapper.__dict__.get("backward")
    wrapper.backward = backward
    try:
        yield
    finally:
        if own is None:
            del wrapper.backward  # the class's own again
        else:
            wrapper.backward = own
    if stepped[0]:
        engine.step()
