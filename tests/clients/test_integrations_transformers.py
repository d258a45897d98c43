"""``fsdp_retain.integrations.transformers`` without ranks: where the block goes around a
Trainer's ``training_step``, where the options come from, and DeepSpeed's step after the
block (a stand-in Trainer, accelerator and engine; the block stands in too, recording the
step it owes as the DeepSpeed blocks do at a clean exit. The real Trainers run in
``tests/docs/test_examples.py``, ``tests/deepspeed/test_deepspeed.py`` (the seams grid of
``tests/deepspeed/cases_deepspeed_seams.py`` among them) and
``tests/clients/test_sentence_transformers.py``)."""

from __future__ import annotations

import contextlib
import types

import pytest

from fsdp_retain._deepspeed._step import StepContract
from fsdp_retain.integrations import accelerate as integration
from fsdp_retain.integrations.transformers import RetainTrainerMixin, retaining_trainer


class Engine:  # what the integration and the step contract read of a DeepSpeedEngine
    micro_steps = 0
    _is_gradient_accumulation_boundary = None

    def __init__(self, log: list) -> None:
        self.log = log

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self._is_gradient_accumulation_boundary = is_boundary
        self.log.append(("boundary", is_boundary))

    def is_gradient_accumulation_boundary(self) -> bool:
        return bool(self._is_gradient_accumulation_boundary)

    def backward(self, loss, **kwargs) -> None:
        self.log.append(("backward", loss, kwargs))

    def step(self) -> None:
        self.micro_steps += 1
        self.log.append(("step",))


class EngineWrapper:  # accelerate's DeepSpeedEngineWrapper: its backward steps
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def backward(self, loss, sync_gradients=True, **kwargs) -> None:
        self.engine.backward(loss, **kwargs)
        if sync_gradients:
            self.engine.step()


class Accelerator:
    def __init__(self, log: list, deepspeed: bool, sync: bool = True) -> None:
        self.distributed_type = "DistributedType.DEEPSPEED" if deepspeed else "MULTI_CPU"
        self.sync_gradients = sync
        self.log = log
        if deepspeed:
            self.deepspeed_engine_wrapped = EngineWrapper(Engine(log))

    def backward(self, loss, **kwargs) -> None:
        if hasattr(self, "deepspeed_engine_wrapped"):
            self.deepspeed_engine_wrapped.backward(loss, sync_gradients=self.sync_gradients,
                                                   **kwargs)
        else:
            self.log.append(("backward", loss, kwargs))


class Trainer:  # what the mixin needs of transformers.Trainer
    def __init__(self, args=None, deepspeed: bool = False, sync: bool = True) -> None:
        self.args = args
        self.log: list = []
        self.accelerator = Accelerator(self.log, deepspeed, sync)

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.accelerator.backward(inputs)
        return inputs


@pytest.fixture
def blocks(monkeypatch):
    """Stands in for no_reshard_between_backwards: records entries, options and exits; on
    an engine, a clean exit records the step it owes (the block wrote gradients)."""
    seen: list = []

    @contextlib.contextmanager
    def block(model, **options):
        seen.append(("enter", model, options))
        try:
            yield types.SimpleNamespace(model=model)
            if isinstance(model, Engine):
                StepContract(model, "stand-in").finish(wrote=True)
        finally:
            seen.append(("exit", model))

    monkeypatch.setattr(integration, "no_reshard_between_backwards", block)
    return seen


def test_the_trainers_step_runs_in_one_block(blocks):
    trainer = retaining_trainer(Trainer)(retain_options={"sync_grads": "last"})
    assert trainer.training_step("model", "loss") == "loss"
    assert blocks == [("enter", "model", {"sync_grads": "last"}), ("exit", "model")]
    assert trainer.log == [("backward", "loss", {})]
    assert trainer.retain_block is None


def test_an_overriding_training_step_is_wrapped_once(blocks):
    """A subclass's own training_step runs in the block; its super() call does not open a
    second one; ``self.retain_block`` is the block inside it."""
    inside = []

    class TwoLoss(RetainTrainerMixin, Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            inside.append(self.retain_block.model)
            self.accelerator.backward("first")
            return super().training_step(model, inputs, num_items_in_batch)

    trainer = TwoLoss()
    trainer.training_step("model", "second")
    assert inside == ["model"]
    assert [e[0] for e in blocks] == ["enter", "exit"]
    assert [e[1] for e in trainer.log] == ["first", "second"]


def test_options_from_the_training_arguments(blocks):
    args = types.SimpleNamespace(retain_options={"keep_unsharded": False})
    retaining_trainer(Trainer)(args=args).training_step("model", "loss")
    assert blocks[0] == ("enter", "model", {"keep_unsharded": False})


@pytest.mark.parametrize("kwargs, needle", [
    (dict(retain_options={"sync": "last"}), "does not take: use ["),
    (dict(retain_options={"sync_grads": "sometimes"}), "sync_grads must be one of"),
    (dict(retain_options={}, args=types.SimpleNamespace(retain_options={})), "in one place"),
])
def test_bad_options_are_refused_at_construction(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace("[", r"\[")):
        retaining_trainer(Trainer)(**kwargs)


@pytest.mark.parametrize("sync", [True, False], ids=["boundary", "accumulating"])
def test_deepspeed_steps_after_the_block(blocks, sync):
    """accelerate's DeepSpeed backward steps the engine right after engine.backward; in
    the block (whose entry marks the boundary) it only runs engine.backward
    (scale_wrt_gas=False: the Trainer family divides the loss), and the engine steps after
    the block exits, at the boundary only."""
    class TwoLoss(RetainTrainerMixin, Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            self.log.append(("pass 1",))
            self.accelerator.backward("first", retain_graph=True)
            self.log.append(("pass 2",))
            self.accelerator.backward("second")
            self.log.append(("block ends",))

    trainer = TwoLoss(deepspeed=True, sync=sync)
    wrapper = trainer.accelerator.deepspeed_engine_wrapped
    blocks.append("log")  # to see the block's exit against the engine's calls
    trainer.log = blocks
    wrapper.engine.log = blocks
    trainer.accelerator.log = blocks
    trainer.training_step(wrapper.engine, None)
    kinds = [e if isinstance(e, str) else e[0] for e in blocks]
    steps = ["step"] if sync else []
    assert kinds == ["log", "boundary", "enter", "pass 1", "backward", "pass 2",
                     "backward", "block ends", "exit", *steps], kinds
    backwards = [e for e in blocks if not isinstance(e, str) and e[0] == "backward"]
    assert backwards == [("backward", "first", {"retain_graph": True, "scale_wrt_gas": False}),
                         ("backward", "second", {"scale_wrt_gas": False})]
    assert "backward" not in vars(wrapper)  # the class's own again


def test_deepspeed_exception_steps_nothing(blocks):
    class Failing(RetainTrainerMixin, Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            self.accelerator.backward("first")
            raise RuntimeError("boom")

    trainer = Failing(deepspeed=True)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.training_step(trainer.accelerator.deepspeed_engine_wrapped.engine, None)
    assert ("step",) not in trainer.log
    assert "backward" not in vars(trainer.accelerator.deepspeed_engine_wrapped)
    assert trainer.retain_block is None


def test_accelerate_block_entered_before_its_boundary_is_refused(blocks):
    """fsdp_retain.integrations.accelerate.retaining reads the boundary at its entry: entered
    before accelerator.accumulate decided it, the first backward is refused, before the
    engine's backward runs."""
    accelerator = Accelerator([], deepspeed=True, sync=False)
    engine = accelerator.deepspeed_engine_wrapped.engine
    with pytest.raises(integration.RetainError, match="inside `with accelerator.accumulate"):
        with integration.retaining(accelerator, engine):
            accelerator.sync_gradients = True  # accumulate() entered inside the block
            accelerator.backward("loss")
    assert not [e for e in accelerator.log if e[0] in ("backward", "step")], accelerator.log


def test_accelerate_names_the_engine_to_pass(blocks):
    accelerator = Accelerator([], deepspeed=True)
    with pytest.raises(ValueError, match="pass what accelerator.prepare returned"):
        with integration.retaining(accelerator, "the unwrapped module"):
            pass
    assert blocks == []
