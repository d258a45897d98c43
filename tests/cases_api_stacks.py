"""Refusals that name the fix in the user's stack (CPU, gloo, world size 2).

The block refuses a model that is not an FSDP root; the fix depends on who built it
(``fsdp_retain/_stack.py``):

- accelerate on a machine without an accelerator falls back to independent processes
  (``Accelerator()``) or DDP (``cpu=True``): the error says what accelerate set up and
  how to get FSDP (an FSDP config or plugin), not "wrap the model with fully_shard".
- accelerate with FSDP1 (set up on CPU through ``examples/accelerate_cpu_fsdp.py``) and
  ``accelerator.unwrap_model(model)`` or a module with no unit passed: "pass what
  accelerator.prepare returned", no Lightning advice.
- transformers' ``Trainer`` falling back to DDP (``use_cpu=True``): the Trainer's FSDP
  arguments; with FSDP1 and ``self.accelerator.unwrap_model(model)`` passed from
  ``training_step``: "the model your training_step receives".
- Lightning's DDP over a LightningModule, a LightningModule with no FSDP unit, and one
  holding a sharded ``self.net`` beside parameters of its own: the Lightning strategy or
  object to pass, no accelerate.
- No stack: the generic advice, naming no stack.

Every case resets accelerate's process-wide state and the environment it changed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from fsdp_retain import no_reshard_between_backwards
from tests.harness import ROOT, Registry

registry = Registry()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None):
        for block in self.blocks:
            x = block(x)
        out = self.head(x)
        return out if y is None else {"loss": (out - y).pow(2).mean(), "out": out}


@contextlib.contextmanager
def _accelerate_state():
    """accelerate's shared state and the environment, as they were before the case."""
    from accelerate.state import AcceleratorState, GradientState

    env = dict(os.environ)
    try:
        yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        os.environ.clear()
        os.environ.update(env)


def _refusal(model: nn.Module) -> str:
    with pytest.raises(ValueError) as info:
        with no_reshard_between_backwards(model):
            pass
    return str(info.value)


def _cpu_state_as_accelerator() -> None:
    path = ROOT / "examples" / "accelerate_cpu_fsdp.py"
    spec = importlib.util.spec_from_file_location("accelerate_cpu_fsdp", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.cpu_state_as_accelerator()


def _fsdp1_plugin():
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(
        fsdp_version=1, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Block"], use_orig_params=True,
        sync_module_states=False, state_dict_type="FULL_STATE_DICT",
    )


@registry.case()
def accelerate_no_accelerator_names_the_fallback() -> None:
    """Accelerator() without an accelerator: DistributedType.NO, the model left as it is."""
    from accelerate import Accelerator

    with _accelerate_state():
        accelerator = Accelerator()
        message = _refusal(accelerator.prepare(Net()))
    assert ("not wrapped by FSDP. The Accelerator set up NO with 1 process on cpu, "
            "not FSDP.") in message
    assert "It selects FSDP only on accelerator backends" in message
    assert "examples/accelerate_cpu_fsdp.py" in message
    assert "accelerate launch --config_file <a config with distributed_type: FSDP>" in message
    assert "then pass what accelerator.prepare returned" in message
    assert "Trainer" not in message and "Lightning" not in message, message


@registry.case()
def accelerate_use_cpu_ddp_names_the_fallback() -> None:
    """Accelerator(cpu=True): MULTI_CPU, accelerate wraps the model in DDP."""
    from accelerate import Accelerator

    with _accelerate_state():
        accelerator = Accelerator(cpu=True)
        model = accelerator.prepare(Net())
        assert isinstance(model, nn.parallel.DistributedDataParallel)
        message = _refusal(model)
    assert "got a DistributedDataParallel model" in message
    ws = dist.get_world_size()
    assert f"The Accelerator set up MULTI_CPU with {ws} processes on cpu" in message, message
    assert ", not FSDP." in message and "Set up FSDP: accelerate launch" in message
    assert "Wrap the model with fully_shard" not in message


@registry.case()
def accelerate_fsdp1_unwrapped_names_prepare() -> None:
    """accelerate FSDP1 (CPU shim), accelerator.unwrap_model(model) passed: the module
    inside the root wrapper; a module with no unit; the prepared model works."""
    from accelerate import Accelerator

    with _accelerate_state():
        _cpu_state_as_accelerator()
        accelerator = Accelerator(fsdp_plugin=_fsdp1_plugin())
        model = accelerator.prepare(Net())
        message = _refusal(accelerator.unwrap_model(model))
        plain = _refusal(Net())  # e.g. the model before prepare, with no unit inside
        with no_reshard_between_backwards(model):
            out = model(torch.randn(4, 8))
            out.pow(2).mean().backward(retain_graph=True)
            out.mean().backward()
    assert "contains FSDP unit 'blocks.0' and 2 outermost FSDP units" in message, message
    assert ("Pass what accelerator.prepare returned, not accelerator.unwrap_model(model) "
            "nor the model before prepare: that is the FSDP root.") in message, message
    assert "Lightning" not in message and "Trainer" not in message, message
    ws = dist.get_world_size()
    assert (f"not wrapped by FSDP. The Accelerator set up FSDP with {ws} processes on cpu; "
            "pass what accelerator.prepare returned") in plain, plain


class _Refusing:
    """A transformers Trainer whose training_step opens the block on ``pick(self, model)``."""

    @staticmethod
    def trainer(pick, **arguments):
        from transformers import Trainer, TrainingArguments

        class BlockTrainer(Trainer):
            def training_step(self, model, inputs, num_items_in_batch=None):
                inputs = self._prepare_inputs(inputs)
                with no_reshard_between_backwards(pick(self, model)):
                    loss = model(**inputs)["loss"]
                    self.accelerator.backward(loss, retain_graph=True)
                    self.accelerator.backward(loss)
                return loss.detach()

        data = [{"x": torch.randn(8), "y": torch.randn(1)} for _ in range(8)]
        output_dir = tempfile.mkdtemp(prefix="fsdp_retain_trainer_")
        args = TrainingArguments(
            output_dir=output_dir, max_steps=1, per_device_train_batch_size=2,
            report_to="none", save_strategy="no", disable_tqdm=True,
            dataloader_pin_memory=False, **arguments,
        )
        return BlockTrainer(model=Net(), args=args, train_dataset=data)


@registry.case()
def hf_trainer_ddp_fallback_names_fsdp_arguments() -> None:
    """Trainer(use_cpu=True) with FSDP asked for: accelerate falls back to DDP."""
    with _accelerate_state():
        fsdp = {"fsdp": True, "fsdp_config": {"transformer_layer_cls_to_wrap": ["Block"]}}
        trainer = _Refusing.trainer(lambda self, model: model, use_cpu=True, **fsdp)
        with pytest.raises(ValueError) as info:
            trainer.train()
    message = str(info.value)
    assert "got a DistributedDataParallel model" in message
    assert "The Trainer's Accelerator set up MULTI_CPU" in message, message
    assert 'Set up FSDP: TrainingArguments(fsdp=True, fsdp_config={"version": 2' in message
    assert "then pass the model your training_step receives" in message
    assert "Wrap the model with fully_shard" not in message


@registry.case()
def hf_trainer_fsdp1_unwrapped_names_training_step_model() -> None:
    """Trainer with FSDP1 (CPU shim), self.accelerator.unwrap_model(model) passed."""
    with _accelerate_state():
        _cpu_state_as_accelerator()
        fsdp = {"fsdp": True, "fsdp_config": {
            "version": 1, "transformer_layer_cls_to_wrap": ["Block"],
            "sync_module_states": False}}
        trainer = _Refusing.trainer(
            lambda self, model: self.accelerator.unwrap_model(model),
            accelerator_config={"use_configured_state": True}, **fsdp)
        with pytest.raises(ValueError) as info:
            trainer.train()
    message = str(info.value)
    assert "contains FSDP unit" in message
    assert ("Pass the model your training_step receives (what accelerator.prepare "
            "returned), not self.accelerator.unwrap_model(model): that is the FSDP "
            "root.") in message, message
    assert "Lightning" not in message


def _lightning_module(net: nn.Module):
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net
            self.scale = nn.Parameter(torch.ones(1))

    return Module()


@registry.case()
def lightning_ddp_names_fsdp_strategies() -> None:
    """What Lightning's DDPStrategy hands over: DDP around the LightningModule; and a
    LightningModule with no FSDP unit in it."""
    message = _refusal(nn.parallel.DistributedDataParallel(_lightning_module(Net())))
    assert "Lightning's DDPStrategy wrapped it: use FSDPStrategy (FSDP1) or " in message
    assert "pass self.trainer.strategy.model (Lightning's Trainer)" in message, message
    plain = _refusal(_lightning_module(Net()))
    assert ("not wrapped by FSDP. Under Lightning's FSDPStrategy or ModelParallelStrategy "
            "pass self.trainer.strategy.model") in plain, plain
    assert "accelerat" not in message + plain


@registry.case()
def lightning_module_with_own_parameters_names_strategy_model() -> None:
    """A LightningModule holding a sharded self.net and a parameter of its own."""
    net = Net()
    for block in net.blocks:
        fully_shard(block)
    message = _refusal(_lightning_module(fully_shard(net)))
    assert "contains FSDP unit 'net' and parameters outside it (scale)" in message, message
    assert ("Pass the FSDP root: self.trainer.strategy.model (Lightning's Trainer) or the "
            "module fabric.setup returned (Fabric).") in message, message


@registry.case()
def no_stack_gets_the_generic_fix() -> None:
    """No stack: a plain container of FSDP2 units, a plain module, a DDP model."""
    net = Net()
    for block in net.blocks:
        fully_shard(block)
    wrapper = _refusal(net)
    assert wrapper.endswith("Wrap the root too (fully_shard(model) or "
                            "FullyShardedDataParallel(model)) and pass it."), wrapper
    plain = _refusal(Net())
    assert plain.endswith("with DeepSpeed ZeRO-3, pass the engine deepspeed.initialize "
                          "returns)."), plain
    ddp = _refusal(nn.parallel.DistributedDataParallel(Net()))
    assert ddp.endswith("Wrap the model with fully_shard(...) or "
                        "FullyShardedDataParallel(...) instead."), ddp
    for message in (wrapper, plain, ddp):
        assert "Lightning" not in message and "accelerat" not in message, message
