"""The transformers ``Trainer`` family with ``no_reshard_between_backwards`` around each
training step: ``Trainer``, sentence-transformers' ``SentenceTransformerTrainer``, TRL's
trainers, on every backend the Trainer sets up (DDP, FSDP1, FSDP2, DeepSpeed ZeRO-0..3).

[Note: the Trainer integration]
``RetainTrainerMixin`` puts the block around the Trainer's ``training_step`` (the
forward, ``compute_loss`` and ``accelerator.backward`` of one micro-batch), with the model
the Trainer hands to it: the DDP wrapper, the FSDP root, or the DeepSpeed engine. A
subclass that defines its own ``training_step`` (two losses, a probe pass) gets it wrapped
the same way (``__init_subclass__``); inside it, ``self.retain_block`` is the block (for
``block.backward(loss, param_grads=False)``, ``block.grads``). A ``training_step`` that
calls ``super().training_step`` runs in the one block of the step. The Trainer's own
gradient accumulation, clipping and mixed precision are left as it configures them: its
``no_sync`` for the micro-batches that do not sync is what the block reads there. Under
DeepSpeed the engine steps after the block, at the accumulation boundary, whatever made
the gradients, and nothing in the block divides a loss again: the Trainer divided it
(see [Note: accelerate's DeepSpeed wrapper in the block] in ``accelerate.py`` and
[Note: who steps and who scales on DeepSpeed] in ``_deepspeed/_step.py``).

The block's options come from one place: ``retain_options=`` (a dict of
``no_reshard_between_backwards``'s keyword arguments) passed to the Trainer, or a
``retain_options`` field of the training arguments; not both.

Example::

    from fsdp_retain.integrations.transformers import RetainTrainerMixin

    class Trainer(RetainTrainerMixin, SentenceTransformerTrainer):
        pass

    trainer = Trainer(model=model, args=args, train_dataset=data, loss=cached_loss,
                      retain_options={"sync_grads": "last"})
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

from .._api import RetainBlock
from .._deepspeed._step import Seam
from .._policy import RetainOptions
from .accelerate import _retaining

__all__ = ["RetainTrainerMixin", "retaining_trainer"]

TRAINER = Seam(
    "the Trainer (RetainTrainerMixin)", divided=True, steps_after=True,
    fix="RetainTrainerMixin steps the engine after training_step, at the accumulation "
        "boundary: leave engine.step() out of training_step.",
)

_BOTH = (
    "retain_options was given both to the Trainer ({direct}) and in its training arguments "
    "({from_args}): pass it in one place."
)


class RetainTrainerMixin:
    """Mix in before the Trainer class: every ``training_step`` runs in one
    ``no_reshard_between_backwards`` block; see [Note: the Trainer integration]."""

    retain_block: RetainBlock | None = None  # the block of the running training_step

    def __init__(self, *args: Any, retain_options: dict[str, Any] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from_args = getattr(getattr(self, "args", None), "retain_options", None)
        if retain_options is not None and from_args is not None:
            raise ValueError(_BOTH.format(direct=retain_options, from_args=from_args))
        options = dict(retain_options or from_args or {})
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(RetainOptions)})
        if unknown:
            raise ValueError(
                f"retain_options has {unknown}, which no_reshard_between_backwards does not "
                f"take: use {[f.name for f in dataclasses.fields(RetainOptions)]}."
            )
        RetainOptions(**options)  # a mistake fails here, naming the fix, not at step 1
        self.retain_options = options
        self.retain_block = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("training_step")
        if own is not None and not getattr(own, "_in_retain_block", False):
            cls.training_step = _in_block(own)  # type: ignore[method-assign]

    @contextlib.contextmanager
    def retaining(self, model: Any) -> Iterator[RetainBlock]:
        """The block of the running training step, entered here if none runs yet."""
        if self.retain_block is not None:
            yield self.retain_block
            return
        accelerator = self.accelerator  # type: ignore[attr-defined]
        with _retaining(accelerator, model, TRAINER, self.retain_options) as block:
            self.retain_block = block
            try:
                yield block
            finally:
                self.retain_block = None

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        with self.retaining(model):
            return super().training_step(model, inputs, num_items_in_batch)  # type: ignore[misc]

    training_step._in_retain_block = True  # type: ignore[attr-defined]


def _in_block(step: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(step)
    def training_step(self: RetainTrainerMixin, model: Any, *args: Any, **kwargs: Any) -> Any:
        with self.retaining(model):
            return step(self, model, *args, **kwargs)

    training_step._in_retain_block = True  # type: ignore[attr-defined]
    return training_step


def retaining_trainer(trainer_class: type) -> type:
    """``trainer_class`` with ``RetainTrainerMixin`` mixed in, for one-line use.

    Example::

        trainer = retaining_trainer(Trainer)(model=model, args=args, train_dataset=data)
    """
    return type(f"Retaining{trainer_class.__name__}", (RetainTrainerMixin, trainer_class), {})
