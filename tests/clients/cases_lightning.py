"""PyTorch Lightning's own DDP strategies as a client, CPU/gloo, world size 2: the
``Trainer`` with ``DDPStrategy`` (default, ``static_graph=True``,
``find_unused_parameters=True``, manual gradient accumulation) and ``Fabric`` with its
``DDPStrategy``, manual optimization, two backward passes over one forward per
micro-batch, the block around the forward and the passes and the optimizer step after it.

Every run trains 3 SGD-momentum steps and compares every parameter with a one-process
replay (``tests/clients/lightning_common.py``); the plain run (no block) beside each says
what Lightning alone gives. The Trainer runs also count every all-reduce of each
micro-batch (the block and DDP's reducer; ``count_collectives`` inside ``training_step``)
against the formulas in ``_all_reduces``. What was measured:

- Trainer, ``DDPStrategy``: plain manual optimization is right (Lightning arms DDP's
  reducer before every ``manual_backward``: an all-reduce of every bucket per pass); the
  block is right with one all-reduce per bucket per pass, or per step with
  ``sync_grads="last"``. The same with ``find_unused_parameters=True`` (plus the used-map
  all-reduce per reduction) and with 2 micro-batches per optimizer step (a block each).
- Trainer, ``DDPStrategy(static_graph=True)``: the block from the first step is right, in
  every step and mixed with plain steps (DDP learns its static graph from the first
  ``manual_backward``, which Lightning arms and flushes: [Note: Lightning's DDPStrategy
  around the block] in ``fsdp_retain/_ddp/_lightning.py``). Before that note
  Lightning's flush failed on torch's internal assert in the first step. Plain is right.
- Fabric, ``DDPStrategy`` (also ``static_graph``, ``find_unused_parameters``): the block
  with the module ``fabric.setup`` returned is right; plain is silently wrong (DDP reduces
  the first pass of a forward only).
- Refusals that name the Lightning object to pass: the user's own module under Fabric
  (``fabric.setup(model)``'s module), ``self`` and ``self.net`` under the Trainer
  (``self.trainer.strategy.model``).

tests/clients/cases_lightning_deepspeed.py has ``DeepSpeedStrategy`` (its own venv); the
FSDP strategies run in tests/docs/test_examples.py (examples/lightning_manual.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn as nn

from fsdp_retain import no_reshard_between_backwards
from fsdp_retain._measure import count_collectives
from tests.clients.lightning_common import (
    TOL, WORLD, Net, Run, batch, losses, max_diff, net_params, quiet, replay, sgd,
    same_on_every_rank, trainer,
)
from tests.support.harness import Registry

registry = Registry()
WRONG = 1e-3  # a pass left unreduced moves the parameters by ~1e-1 here


@dataclasses.dataclass
class Fit:
    """What a Trainer run gives: the parameters, the all-reduces of each micro-batch,
    the refusals met in the first step (``refusals=True``)."""

    params: dict[str, torch.Tensor]
    all_reduces: list[int]
    buckets: int
    refusals: dict[str, str]


def _lightning_module(run: Run, refusals: bool) -> Any:
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.net = Net(run.branch)
            self.all_reduces: list[int] = []
            self.buckets = 0
            self.refusals: dict[str, str] = {}

        def training_step(self, _: Any, index: int) -> None:
            if refusals and index == 0:
                self.refusals = {"self": _refusal(self), "self.net": _refusal(self.net)}
            opt = self.optimizers()
            step, micro = divmod(index, run.accumulate)
            rank = self.global_rank
            with count_collectives() as counts:
                with run.block(self.trainer.strategy.model, step):
                    l1, l2 = losses(self.net(batch(step, micro, rank), rank))
                    if run.first == "loss" and index == 0:
                        l1.backward(retain_graph=True)  # a pass Lightning does not arm
                    else:
                        self.manual_backward(l1, retain_graph=True)
                    self.manual_backward(l2)
            self.all_reduces.append(counts.all_reduce)
            # DDP's buckets (rebuilt after its first iteration): one all-reduce each.
            sizes = self.trainer.strategy.model._get_ddp_logging_data()["bucket_sizes"]
            self.buckets = sizes.count(",") + 1
            if micro == run.accumulate - 1:
                opt.step()
                opt.zero_grad()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return sgd(self.parameters())

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(range(run.batches), batch_size=1)

    return Module()


def fit(run: Run, refusals: bool = False, **ddp: Any) -> Fit:
    """``run`` under Lightning's ``Trainer`` with ``DDPStrategy(**ddp)``."""
    from lightning.pytorch.strategies import DDPStrategy

    module = _lightning_module(run, refusals)
    strategy = DDPStrategy(process_group_backend="gloo", **ddp)
    with quiet():
        trainer(strategy).fit(module)
    return Fit(net_params(module.net), module.all_reduces, module.buckets, module.refusals)


def fabric_run(run: Run, **ddp: Any) -> dict[str, torch.Tensor]:
    """``run`` under ``Fabric`` with its ``DDPStrategy(**ddp)``; the block gets what
    ``fabric.setup`` returned."""
    import lightning as L
    from lightning.fabric.strategies import DDPStrategy

    with quiet():
        fabric = L.Fabric(accelerator="cpu", devices=WORLD,
                          strategy=DDPStrategy(process_group_backend="gloo", **ddp))
        fabric.launch()  # the harness started the ranks: Lightning joins them
        net = Net(run.branch)
        model, opt = fabric.setup(net, sgd(net.parameters()))
        rank = fabric.global_rank
        for step in range(run.steps):
            with run.block(model, step):
                l1, l2 = losses(model(batch(step, 0, rank), rank))
                fabric.backward(l1, retain_graph=True)
                fabric.backward(l2)
            opt.step()
            opt.zero_grad()
    return net_params(net)


def _refusal(model: nn.Module) -> str:
    with pytest.raises(ValueError) as info:
        with no_reshard_between_backwards(model):
            pass
    return str(info.value)


def _all_reduces(run: Run, buckets: int, *, tracked: bool = False,
                 first_flush: bool = False) -> list[int]:
    """All-reduces per micro-batch. Plain: DDP's reducer, armed by Lightning before each
    of the 2 passes, all-reduces every bucket (and, with ``find_unused_parameters``, its
    used-map) once per pass. The block: one reduction per pass (``sync_grads="every"``)
    or per micro-batch (``"last"``): every bucket, and a used-map first where DDP tracks
    unused parameters (``tracked``: ``find_unused_parameters`` or ``static_graph``).
    ``first_flush``: in the first micro-batch of a ``static_graph`` run DDP's own flush of
    its first iteration adds the buckets and its used-map once."""
    if run.options is None:
        per_batch = 2 * (buckets + tracked)
    else:
        passes = 1 if run.options.get("sync_grads") == "last" else 2
        per_batch = passes * (buckets + tracked)
    counts = [per_batch] * run.batches
    if first_flush:
        counts[0] += buckets + 1
    return counts


def _check(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
           right: bool, what: str) -> None:
    diff = max_diff(got, expected)
    same_on_every_rank(diff < TOL)
    if right:
        assert diff < TOL, f"{what}: max |param - replay| {diff:.3g}"
    else:
        assert diff > WRONG, f"{what}: expected silently wrong, max |param - replay| {diff:.3g}"


@registry.case()
def trainer_ddp() -> None:
    """DDPStrategy(): plain, the block and the block with sync_grads="last" all right;
    all-reduces by ``_all_reduces`` (the block with "last": half of plain's). In the first
    step, ``self`` and ``self.net`` are refused naming self.trainer.strategy.model."""
    expected = replay()
    for options in (None, {}, {"sync_grads": "last"}):
        run = Run(options)
        got = fit(run, refusals=options is None)
        _check(got.params, expected, True, f"Trainer DDPStrategy, block {options}")
        assert got.all_reduces == _all_reduces(run, got.buckets), (options, got.all_reduces)
        if options is None:
            for given, message in got.refusals.items():
                assert "Pass the model the strategy wrapped: self.trainer.strategy.model " \
                       "(what Lightning's Trainer wrapped, not self nor a module inside " \
                       "it)" in message, (given, message)
                assert "fabric" not in message and "Wrap it with" not in message, message


@registry.case()
def trainer_ddp_static_graph() -> None:
    """DDPStrategy(static_graph=True), the block from the first step: right, every step in
    the block (sync_grads "every" and "last", all-reduces by ``_all_reduces`` with DDP's
    flush of its first iteration), mixed with plain steps (block, plain, block, plain: a
    later plain step is DDP's, which needs the graph learned in the first), and with a
    first pass Lightning does not arm (``loss.backward()`` then ``manual_backward``).
    Plain: right."""
    steps = 4
    expected = replay(steps=steps)
    for options in ({}, {"sync_grads": "last"}):
        run = Run(options, steps=steps)
        got = fit(run, static_graph=True)
        _check(got.params, expected, True, f"static_graph, block {options}")
        want = _all_reduces(run, got.buckets, tracked=True, first_flush=True)
        assert got.all_reduces == want, (options, got.all_reduces, want)
    for run, what in ((Run({}, steps=steps, plain_steps=(1, 3)), "block, plain, block, plain"),
                      (Run({}, steps=steps, first="loss"), "first pass loss.backward()"),
                      (Run(None, steps=steps), "plain")):
        _check(fit(run, static_graph=True).params, expected, True, f"static_graph, {what}")


@registry.case()
def trainer_ddp_find_unused_parameters() -> None:
    """DDPStrategy(find_unused_parameters=True), a parameter only rank 0 uses and one no
    rank uses: plain and the block (sync_grads "every" and "last") right; all-reduces by
    ``_all_reduces`` (the used-map with every reduction)."""
    expected = replay(branch=True)
    for options in (None, {}, {"sync_grads": "last"}):
        run = Run(options, branch=True)
        got = fit(run, find_unused_parameters=True)
        _check(got.params, expected, True, f"find_unused_parameters, block {options}")
        assert got.all_reduces == _all_reduces(run, got.buckets, tracked=True), \
            (options, got.all_reduces)


@registry.case()
def trainer_ddp_manual_accumulation() -> None:
    """DDPStrategy(), 2 micro-batches (each a training_step with its forward, two
    manual_backward passes and the block) per optimizer step: plain and the block
    (sync_grads "every" and "last") right; all-reduces by ``_all_reduces`` per
    micro-batch."""
    expected = replay(accumulate=2)
    for options in (None, {}, {"sync_grads": "last"}):
        run = Run(options, accumulate=2)
        got = fit(run)
        _check(got.params, expected, True, f"2 micro-batches, block {options}")
        assert got.all_reduces == _all_reduces(run, got.buckets), (options, got.all_reduces)


@registry.case()
def fabric_ddp() -> None:
    """Fabric's DDPStrategy, the block on what fabric.setup returned: right (sync_grads
    "every" and "last"; static_graph; find_unused_parameters). Plain: silently wrong
    (DDP all-reduces the first pass only), also with static_graph."""
    expected, branched = replay(), replay(branch=True)
    for options in ({}, {"sync_grads": "last"}):
        _check(fabric_run(Run(options)), expected, True, f"Fabric DDP, block {options}")
    _check(fabric_run(Run({}), static_graph=True), expected, True, "Fabric static_graph, block")
    _check(fabric_run(Run({}, branch=True), find_unused_parameters=True), branched, True,
           "Fabric find_unused_parameters, block")
    _check(fabric_run(Run()), expected, False, "Fabric DDP, plain")
    _check(fabric_run(Run(), static_graph=True), expected, False, "Fabric static_graph, plain")


@registry.case()
def fabric_own_module_refused() -> None:
    """Under Fabric's DDPStrategy the user's own module (not what fabric.setup returned)
    is refused naming fabric.setup(model)'s module, not "wrap it with
    DistributedDataParallel"; nothing was computed."""
    import lightning as L
    from lightning.fabric.strategies import DDPStrategy

    with quiet():
        fabric = L.Fabric(accelerator="cpu", devices=WORLD,
                          strategy=DDPStrategy(process_group_backend="gloo"))
        fabric.launch()
        net = Net()
        model = fabric.setup_module(net)
    message = _refusal(net)
    assert ("Pass the model the strategy wrapped: the module fabric.setup(model) returned "
            "(or fabric.setup_module(model)), not the model you gave it") in message, message
    assert "Wrap it with" not in message and "self.trainer" not in message, message
    assert all(p.grad is None for p in model.parameters())
    with no_reshard_between_backwards(model):  # what setup returned is taken
        pass
