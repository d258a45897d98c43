"""The stacks' wrappers and the refusals that name the fix there (CPU, gloo, world size 2).

The block takes an FSDP root, a DeepSpeed engine or a DDP model; for anything else the
fix depends on who built it (``fsdp_retain/_stack.py``):

- accelerate on a machine without an accelerator falls back to independent processes
  (``Accelerator()``, refused: the error says what accelerate set up and how to get DDP
  or FSDP, not "wrap the model with fully_shard") or to DDP (``cpu=True``: the block
  runs, gradients match the unwrapped model averaged over ranks, and differ without the
  block; ``accelerator.unwrap_model(model)`` is refused naming what prepare returned).
- accelerate with FSDP1 (set up on CPU through ``examples/accelerate_cpu_fsdp.py``) and
  ``accelerator.unwrap_model(model)`` or a module with no unit passed: "pass what
  accelerator.prepare returned", no Lightning advice.
- transformers' ``Trainer`` falling back to DDP (``use_cpu=True`` with FSDP asked for):
  the block runs in ``training_step``, gradients as above (and wrong without it); with
  FSDP1 and ``self.accelerator.unwrap_model(model)`` passed from ``training_step``: "the
  model your training_step receives".
- Lightning: a DDP over a LightningModule (what DDPStrategy hands over) runs, gradients
  as above; a LightningModule with no wrapper, Fabric's module around a DDP, and one
  holding a sharded ``self.net`` beside parameters of its own are refused naming the
  Lightning object to pass, no accelerate.
- No stack: a DDP model runs; the rest gets the generic advice, naming no stack.

Every case resets accelerate's process-wide state and the environment it changed.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from fsdp_retain import no_reshard_between_backwards
from tests.support.harness import ROOT, Registry

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


def _two_losses(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return out.pow(2).mean(), out.tanh().mean()


def _ddp_error(model: nn.Module, reference: nn.Module,
               block: bool = True, backward=torch.autograd.backward, outer=None) -> float:
    """Largest |grad - reference grad| of a DDP model after two backward passes over one
    forward on this rank's batch (seed 42 + rank + 1), inside the block or not. The
    reference (the unwrapped model with the same weights): one backward of the summed
    losses, its gradients averaged over ranks, as DDP's all-reduce does. ``outer``: a
    wrapper around the DDP, passed to the block instead of it."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(42 + dist.get_rank() + 1))
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    given = model if outer is None else outer
    with no_reshard_between_backwards(given) if block else contextlib.nullcontext():
        first, second = _two_losses(model(x))
        backward(first, retain_graph=True)
        backward(second)
    sum(_two_losses(reference(x))).backward()
    error = 0.0
    for param, ref in zip(model.module.parameters(), reference.parameters(), strict=True):
        dist.all_reduce(ref.grad)
        ref.grad /= dist.get_world_size()
        error = max(error, (param.grad - ref.grad).abs().max().item())
    return error


def _seeded(make):
    """``make()`` with seed 42 on every rank, and an unwrapped copy: the reference."""
    torch.manual_seed(42)
    module = make()
    return module, copy.deepcopy(module)


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
    assert ("not wrapped by DDP or FSDP. The Accelerator set up NO with 1 process on cpu, which "
            "leaves the model unwrapped: the block needs the model accelerate wraps in DDP "
            "or FSDP (or a DeepSpeed engine).") in message, message
    assert ("For DDP start 2 or more processes: accelerate launch --multi_gpu "
            "--num_processes <N>, with ACCELERATE_USE_CPU=1 in the environment on CPU.") in message
    assert "For FSDP: accelerate launch --config_file <a config with distributed_type: FSDP>" in message
    assert "On CPU accelerate sets up DDP only with use_cpu / ACCELERATE_USE_CPU=1" in message
    assert "examples/accelerate_cpu_fsdp.py" in message
    assert "Then pass what accelerator.prepare returned" in message
    assert "Trainer" not in message and "Lightning" not in message, message


@registry.case()
def accelerate_use_cpu_ddp_runs_the_block() -> None:
    """Accelerator(cpu=True): MULTI_CPU, accelerate wraps the model in DDP. Two passes
    through accelerator.backward inside the block: gradients match the unwrapped model
    averaged over ranks (1e-6, float32); without the block the second pass is never
    all-reduced (off by more than 1e-3). accelerator.unwrap_model(model) is refused,
    naming what prepare returned."""
    from accelerate import Accelerator

    with _accelerate_state():
        accelerator = Accelerator(cpu=True)
        net, reference = _seeded(Net)
        model = accelerator.prepare(net)
        assert isinstance(model, nn.parallel.DistributedDataParallel)
        error = _ddp_error(model, reference, backward=accelerator.backward)
        plain = _ddp_error(model, reference, block=False, backward=accelerator.backward)
        message = _refusal(accelerator.unwrap_model(model))
    assert error <= 1e-6, error
    assert plain > 1e-3, plain
    ws = dist.get_world_size()
    assert (f"not wrapped by DDP or FSDP. The Accelerator set up MULTI_CPU with {ws} processes on "
            "cpu") in message, message
    assert ("(DDP); pass what accelerator.prepare returned, not "
            "accelerator.unwrap_model(model)") in message, message
    assert "Trainer" not in message and "Lightning" not in message, message


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
    assert (f"not wrapped by DDP or FSDP. The Accelerator set up FSDP with {ws} processes on cpu; "
            "pass what accelerator.prepare returned") in plain, plain


class _Refusing:
    """A transformers Trainer whose training_step opens the block on ``pick(self, model)``
    (``pick`` None: no block) and then calls ``check(model, inputs)``."""

    @staticmethod
    def trainer(pick, check=None, **arguments):
        from transformers import Trainer, TrainingArguments

        class BlockTrainer(Trainer):
            def training_step(self, model, inputs, num_items_in_batch=None):
                inputs = self._prepare_inputs(inputs)
                block = (contextlib.nullcontext() if pick is None
                         else no_reshard_between_backwards(pick(self, model)))
                with block:
                    loss = model(**inputs)["loss"]
                    self.accelerator.backward(loss, retain_graph=True)
                    self.accelerator.backward(loss)
                if check is not None:
                    check(model, inputs)
                return loss.detach()

        data = [{"x": torch.randn(8), "y": torch.randn(1)} for _ in range(8)]
        output_dir = tempfile.mkdtemp(prefix="fsdp_retain_trainer_")
        args = TrainingArguments(
            output_dir=output_dir, max_steps=1, per_device_train_batch_size=2,
            report_to="none", save_strategy="no", disable_tqdm=True,
            dataloader_pin_memory=False, **arguments,
        )
        return BlockTrainer(model=Net(), args=args, train_dataset=data)


def _trainer_ddp_error(block: bool) -> float:
    """Trainer(use_cpu=True) with FSDP asked for: accelerate falls back to DDP. One step
    of two backward passes of the loss over one forward (with the block on the model
    training_step receives, or without); the largest |grad - reference| where the
    reference is twice the unwrapped model's gradient averaged over ranks."""
    errors = []

    def check(model, inputs) -> None:
        assert isinstance(model, nn.parallel.DistributedDataParallel), type(model)
        reference = copy.deepcopy(model.module)  # the step's weights; .grad is replaced
        reference.zero_grad(set_to_none=True)
        (2 * reference(**inputs)["loss"]).backward()
        error = 0.0
        for param, ref in zip(model.module.parameters(), reference.parameters(), strict=True):
            dist.all_reduce(ref.grad)
            ref.grad /= dist.get_world_size()
            error = max(error, (param.grad - ref.grad).abs().max().item())
        errors.append(error)

    with _accelerate_state():
        fsdp = {"fsdp": True, "fsdp_config": {"transformer_layer_cls_to_wrap": ["Block"]}}
        pick = (lambda self, model: model) if block else None
        _Refusing.trainer(pick, check, use_cpu=True, **fsdp).train()
    (error,) = errors
    return error


@registry.case()
def hf_trainer_ddp_fallback_runs_the_block() -> None:
    """Trainer(use_cpu=True) with FSDP asked for: accelerate falls back to DDP and the
    block runs in training_step: gradients match the unwrapped model averaged over ranks
    (1e-6, float32); without the block they are off by more than 1e-2."""
    error, plain = _trainer_ddp_error(True), _trainer_ddp_error(False)
    assert error <= 1e-6, error
    assert plain > 1e-2, plain


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

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x) * self.scale

    return Module()


@registry.case()
def lightning_ddp_runs_the_block() -> None:
    """What Lightning's DDPStrategy hands over (self.trainer.strategy.model), DDP around the
    LightningModule, runs: gradients match the unwrapped module averaged over ranks
    (1e-6). The LightningModule itself, and what Fabric's DDPStrategy returns (its
    _FabricModule around the DDP, holding no parameter of its own) runs the DDP inside;
    the LightningModule itself is refused naming the object to pass."""
    from lightning.fabric.wrappers import _FabricModule

    module, reference = _seeded(lambda: _lightning_module(Net()))
    ddp = nn.parallel.DistributedDataParallel(module)
    assert (error := _ddp_error(ddp, reference)) <= 1e-6, error
    plain = _refusal(module)
    assert ("not wrapped by DDP or FSDP. Pass the model the strategy wrapped: "
            "self.trainer.strategy.model (Lightning's Trainer) or the module fabric.setup "
            "returned (Fabric), under DDPStrategy, FSDPStrategy or ModelParallelStrategy"
            ) in plain, plain
    fabric = _FabricModule(ddp, strategy=None, original_module=module)
    assert (error := _ddp_error(ddp, reference, outer=fabric)) <= 1e-6, error
    assert "accelerat" not in plain


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
    """No stack: a plain container of FSDP2 units and a plain module are refused; a DDP
    model runs (gradients match the unwrapped model averaged over ranks, 1e-6)."""
    net = Net()
    for block in net.blocks:
        fully_shard(block)
    wrapper = _refusal(net)
    assert wrapper.endswith("Wrap the root too (fully_shard(model) or "
                            "FullyShardedDataParallel(model)) and pass it."), wrapper
    plain = _refusal(Net())
    assert plain.endswith("Wrap it with DistributedDataParallel(...), replicate(...), "
                          "fully_shard(...) or FullyShardedDataParallel(...) and pass the "
                          "wrapper (the module replicate was applied to; the root module with "
                          "FSDP; with DeepSpeed, pass the engine deepspeed.initialize "
                          "returns)."), plain
    module, reference = _seeded(Net)
    error = _ddp_error(nn.parallel.DistributedDataParallel(module), reference)
    assert error <= 1e-6, error
    for message in (wrapper, plain):
        assert "Lightning" not in message and "accelerat" not in message, message
