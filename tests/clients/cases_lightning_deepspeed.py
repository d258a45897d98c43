"""PyTorch Lightning's ``DeepSpeedStrategy`` (ZeRO stages 1, 2 and 3) as a client,
CPU/gloo, world size 2: the ``Trainer`` with manual optimization, the block on
``self.trainer.strategy.model`` (the DeepSpeed engine) around the forward and two
``self.manual_backward`` passes, ``opt.step()`` (``engine.step()``) after the block.

Every run trains 3 SGD-momentum steps and compares every parameter (gathered:
``safe_get_full_fp32_param``) with a one-process replay (``tests/clients/lightning_common.py``).
ZeRO-3 partitions every parameter (``stage3_param_persistence_threshold`` 0; Lightning's
other defaults as they are). What was measured: the block is right on every stage, with
``sync_grads`` "every" and "last"; plain, ZeRO-1 and ZeRO-2 are silently wrong and ZeRO-3
fails in the second pass (its parameters were released after the first).

Needs deepspeed (tests/clients/test_lightning_deepspeed.py skips without it).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.clients.lightning_common import (
    TOL, WORLD, Net, Run, batch, losses, max_diff, quiet, replay, same_on_every_rank, sgd,
    trainer,
)
from tests.support.harness import Registry

registry = Registry()
WRONG = 1e-3  # a pass reduced wrongly moves the parameters by ~1e-1 here


def _strategy(stage: int) -> Any:
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):
        """Lightning's DeepSpeedStrategy on CPU ranks (CPU-only tests). Lightning refuses
        it without a CUDA accelerator in ``setup_environment``: this skips that check
        (DDPStrategy's, its parent's, runs as before); DeepSpeed itself runs on its CPU
        accelerator over gloo. Nothing else changes."""

        def setup_environment(self) -> None:
            DDPStrategy.setup_environment(self)

    # Indexed CPU devices: Lightning checks the device indices against the local ranks
    # and hands the root device's index to deepspeed.initialize (None for a plain "cpu").
    devices = [torch.device("cpu", rank) for rank in range(WORLD)]
    strategy = CPUDeepSpeedStrategy(stage=stage, process_group_backend="gloo",
                                    parallel_devices=devices)
    # ZeRO-3 partitions every parameter: none small enough to stay whole on each rank.
    strategy.config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    return strategy


def _lightning_module(run: Run) -> Any:
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.net = Net()
            self.final: dict[str, torch.Tensor] = {}

        def training_step(self, _: Any, step: int) -> None:
            opt = self.optimizers()
            with run.block(self.trainer.strategy.model):  # the DeepSpeed engine
                l1, l2 = losses(self.net(batch(step, 0, self.global_rank)))
                self.manual_backward(l1, retain_graph=True)
                self.manual_backward(l2)
            opt.step()  # engine.step()
            opt.zero_grad()

        def on_train_end(self) -> None:
            from deepspeed.utils import safe_get_full_fp32_param

            self.final = {n: safe_get_full_fp32_param(p).detach().clone()
                          for n, p in self.net.named_parameters()}

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return sgd(self.parameters())

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(range(run.batches), batch_size=1)

    return Module()


def fit(run: Run, stage: int) -> dict[str, torch.Tensor]:
    module = _lightning_module(run)
    with quiet():
        trainer(_strategy(stage), precision="32-true").fit(module)
    return module.final


def _check_stage(stage: int) -> None:
    expected = replay()
    for options in ({}, {"sync_grads": "last"}):
        diff = max_diff(fit(Run(options), stage), expected)
        same_on_every_rank(diff < TOL)
        assert diff < TOL, f"ZeRO-{stage}, block {options}: max |param - replay| {diff:.3g}"
    if stage == 3:
        with pytest.raises(RuntimeError, match=r"The size of tensor a \(0\)"):
            fit(Run(), stage)
        return
    diff = max_diff(fit(Run(), stage), expected)
    same_on_every_rank(diff > WRONG)
    assert diff > WRONG, f"ZeRO-{stage}, plain: expected silently wrong, {diff:.3g}"


@registry.case()
def trainer_deepspeed_zero1() -> None:
    """DeepSpeedStrategy(stage=1): the block right (sync_grads "every" and "last"); plain
    silently wrong."""
    _check_stage(1)


@registry.case()
def trainer_deepspeed_zero2() -> None:
    """DeepSpeedStrategy(stage=2): the block right (sync_grads "every" and "last"); plain
    silently wrong."""
    _check_stage(2)


@registry.case()
def trainer_deepspeed_zero3() -> None:
    """DeepSpeedStrategy(stage=3), every parameter partitioned: the block right
    (sync_grads "every" and "last"); plain fails in the second pass."""
    _check_stage(3)
