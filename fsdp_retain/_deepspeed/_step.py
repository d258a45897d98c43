"""Who steps a DeepSpeed engine and who divides by the accumulation steps: one contract
for every way into it, which both DeepSpeed blocks and every integration call.

[Note: who steps and who scales on DeepSpeed]
DeepSpeed's own rules: ``engine.backward(loss)`` divides the loss by
``gradient_accumulation_steps`` (``scale_wrt_gas=False``: it does not), and so does a
torch-style ``loss.backward()`` over the engine's output (a hook on each output tensor
divides its gradient, ``_backward_prologue_per_tensor``). ``engine.step()`` steps the
optimizer at the accumulation boundary and counts every call (``micro_steps``); the
boundary comes from that count, or from ``set_gradient_accumulation_boundary`` where
the caller sets it. The frameworks around an engine:

=========================  ====================================  ==========================
framework                  who divides by the accumulation       who calls ``engine.step()``
=========================  ====================================  ==========================
a plain loop               the engine                            the caller, every micro-batch
accelerate's own loop      the engine (``accelerator.backward``  accelerate's wrapper, in
                           divides nothing on DeepSpeed)         ``backward`` at the boundary
the Trainer family         the Trainer (its ``training_step``    accelerate's wrapper, in
                           divides by ``current_gradient_        ``backward`` at the boundary
                           accumulation_steps``, then passes
                           ``scale_wrt_gas=False``)
Lightning, manual          the engine (``manual_backward`` is    the caller (``opt.step()``
optimization               ``engine.backward``)                  is ``engine.step()``)
=========================  ====================================  ==========================

In a block the rules are the framework's, whatever makes the gradient (``Seam``, set by
an integration around its blocks; ``PLAIN`` otherwise):

- **Scale.** Every entry divides a loss as the framework's own backward does. Where the
  engine divides (``divided`` false): ``engine.backward(loss)``, ``accelerator.backward``,
  ``loss.backward()``, ``block.backward(loss)`` and ``block.grads(loss)`` all give the
  gradient of ``loss / gradient_accumulation_steps``; a pass that never reaches the
  engine's output, where that division happens, is refused at accumulation > 1
  (``UNSCALED``) unless ``engine.backward`` divided its loss. Where the framework divided
  already (``divided``: the Trainer family) none divides again: the output hooks' division
  is off in the block (``_per_tensor``) and accelerate's ``backward`` passes
  ``scale_wrt_gas=False``; an ``engine.backward(loss)`` that leaves ``scale_wrt_gas`` at
  DeepSpeed's default is refused at accumulation > 1 before its pass (``AMBIGUOUS``). An
  explicit ``scale_wrt_gas`` is always taken as given.
- **Step.** Nothing steps inside a block (``engine.step()`` is refused there). A block
  at the accumulation boundary owes the engine a step when gradients were written since
  its last step (by a pass that computes parameter gradients, or ``apply_grads``): an
  integration whose framework steps (``steps_after``) takes it right after the block
  (``take_owed_step``); elsewhere the caller does, after the ``with`` statement. If the
  engine has not stepped when the next block on it starts, that block refuses
  (``STEP_OWED``, naming the fix), before any gradient. Off the boundary, where the
  engine counts micro-batches by its ``step()`` calls (the caller did not set the
  boundary), a block that wrote gradients and was followed by no step moves the boundary
  (DeepSpeed's own loop steps every micro-batch): the next block warns, since two blocks
  for one micro-batch followed by one step are DeepSpeed's rules too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

from .._common import RetainError, require_attr

UNSCALED = (
    "no_reshard_between_backwards: this loss.backward() never reaches the DeepSpeed "
    "engine's output (it starts at a tensor inside the model), where DeepSpeed divides "
    "the gradient by gradient_accumulation_steps ({gas}); its gradients would be {gas}x "
    "too large. Use engine.backward(loss), which scales the loss itself, or start the "
    "pass from the engine's output."
)

AMBIGUOUS = (
    "no_reshard_between_backwards under {who}: engine.backward(loss) with "
    "gradient_accumulation_steps {gas} would divide the loss by {gas}, and {who} divides "
    "each loss itself (by current_gradient_accumulation_steps), so the gradient would be "
    "divided twice. Use self.accelerator.backward(loss) (or self.retain_block.backward(loss)), "
    "or say which you mean: engine.backward(loss, scale_wrt_gas=False). Nothing was computed."
)

STEP_OWED = (
    "no_reshard_between_backwards: the DeepSpeed engine did not step after the previous "
    "block, which ended at the accumulation boundary with gradients written since the "
    "last step: DeepSpeed steps the optimizer there, and this block's gradients would add "
    "to that step's. {fix} Nothing was computed in this block."
)

STEP_MISSED = (
    "no_reshard_between_backwards: the DeepSpeed engine did not step after the previous "
    "block, which wrote gradients off the accumulation boundary; DeepSpeed counts "
    "micro-batches by engine.step() calls, so its boundary moves by one micro-batch. "
    "{fix} (Two blocks for one micro-batch followed by one step are fine: then ignore this.)"
)

STEP_INSIDE = (
    "engine.step() was called inside no_reshard_between_backwards: the block still "
    "holds parameters and gradients for later passes. {fix}"
)


@dataclasses.dataclass(frozen=True)
class Seam:
    """How the framework around a block drives the engine; see [Note: who steps and
    who scales on DeepSpeed]."""

    who: str  # the object the user holds, for messages
    divided: bool  # the framework divided each loss by its accumulation steps itself
    steps_after: bool  # its integration steps the engine right after the block
    fix: str  # how to step under this framework


PLAIN = Seam(
    "a DeepSpeed engine", divided=False, steps_after=False,
    fix="Call engine.step() after the `with` statement, once per micro-batch as "
        "DeepSpeed's loop does (under Lightning: opt.step() after the block). With "
        "accelerate, whose accelerator.backward steps the engine at the accumulation "
        "boundary, open the block with fsdp_retain.integrations.accelerate."
        "retaining(accelerator, model) instead: it steps the engine after the block.",
)


@dataclasses.dataclass
class _EngineRecord:
    """What the contract knows of one engine across its blocks."""

    seam: Seam = PLAIN
    wrote: bool = False  # a block wrote gradients since the engine last stepped
    micro_steps: int = 0  # engine.micro_steps when the last block exited
    owed: bool = False  # the last block, at the boundary, left a step owed
    missed: bool = False  # the last block, off the boundary, wrote and counts on a step


_RECORDS: weakref.WeakKeyDictionary[Any, _EngineRecord] = weakref.WeakKeyDictionary()


def _record(engine: Any) -> _EngineRecord:
    record = _RECORDS.get(engine)
    if record is None:
        record = _RECORDS[engine] = _EngineRecord()
    return record


@contextlib.contextmanager
def driven_by(engine: Any, seam: Seam) -> Iterator[None]:
    """The blocks on ``engine`` entered inside run under ``seam`` (an integration's)."""
    record = _record(engine)
    saved, record.seam = record.seam, seam
    try:
        yield
    finally:
        record.seam = saved


def take_owed_step(engine: Any) -> bool:
    """After a block, for an integration whose framework steps (``Seam.steps_after``):
    ``engine.step()`` where the block left one owed. Returns whether it stepped."""
    record = _record(engine)
    if not record.owed or int(engine.micro_steps) != record.micro_steps:
        return False
    engine.step()
    record.owed, record.wrote, record.micro_steps = False, False, int(engine.micro_steps)
    return True


class StepContract:
    """One block's side of the contract: checked at entry, the engine's ``step``,
    ``backward`` and output-hook division shadowed while installed, the step owed
    recorded at a clean exit."""

    def __init__(self, engine: Any, flavour: str) -> None:
        self.engine = engine
        self.flavour = flavour
        self.record = _record(engine)
        self.seam = self.record.seam
        self.wrote = False  # a pass or apply_grads of this block wrote gradients
        self._own_backward: Any = None
        self._own_per_tensor: Any = None

    def check_entry(self) -> None:
        """Refuses a block that starts while the previous one's step is owed."""
        record = self.record
        if int(self.engine.micro_steps) != record.micro_steps:  # it stepped since
            record.owed = record.missed = record.wrote = False
        if record.owed:
            raise RetainError(STEP_OWED.format(fix=self.seam.fix))
        if record.missed:
            record.missed = False
            warnings.warn(STEP_MISSED.format(fix=self.seam.fix), stacklevel=4)

    def install(self) -> None:
        engine = self.engine
        self._own_backward = require_attr(engine, "backward", self.flavour)
        self._own_per_tensor = require_attr(engine, "_backward_prologue_per_tensor",
                                            self.flavour)
        engine.step = self._step_inside
        engine.backward = self._backward
        engine._backward_prologue_per_tensor = self._per_tensor

    def uninstall(self) -> None:
        for name in ("step", "backward", "_backward_prologue_per_tensor"):
            self.engine.__dict__.pop(name, None)

    def _step_inside(self, *args: Any, **kwargs: Any) -> None:
        raise RetainError(STEP_INSIDE.format(fix=self.seam.fix))

    def _backward(self, loss: Any, *args: Any, **kwargs: Any) -> Any:
        explicit = len(args) >= 2 or "scale_wrt_gas" in kwargs
        if self.seam.divided and not explicit and self.gas() > 1:
            raise RetainError(AMBIGUOUS.format(who=self.seam.who, gas=self.gas()))
        return self._own_backward(loss, *args, **kwargs)

    def _per_tensor(self, grad: Any) -> Any:
        """The output hooks' division by the accumulation steps, as the seam says."""
        return grad if self.seam.divided else self._own_per_tensor(grad)

    def gas(self) -> int:
        return int(self.engine.gradient_accumulation_steps())

    def check_pass(self, reaches_output: bool, probing: bool) -> None:
        """Before a pass's first node: refuses one the engine would not divide."""
        if probing or self.seam.divided or self.engine._running_engine_backward:
            return
        gas = self.gas()
        if gas > 1 and not reaches_output:
            raise RetainError(UNSCALED.format(gas=gas))

    def finish(self, wrote: bool) -> None:
        """A clean exit: records the step the engine owes now, if any."""
        record, engine = self.record, self.engine
        record.wrote = record.wrote or wrote
        record.micro_steps = int(engine.micro_steps)
        if engine.is_gradient_accumulation_boundary():
            record.owed = record.wrote
        else:
            record.missed = wrote and self._counts_boundary()

    def _counts_boundary(self) -> bool:
        """Whether the engine finds the boundary by counting ``step()`` calls (not set
        by the caller, managed accumulation): a missed step moves it."""
        managed = getattr(self.engine, "managed_gradient_accumulation", lambda: True)()
        return bool(managed) and getattr(
            self.engine, "_is_gradient_accumulation_boundary", None) is None
