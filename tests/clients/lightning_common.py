"""What the Lightning cases share (tests/clients/cases_lightning.py and
tests/clients/cases_lightning_deepspeed.py): the model, each rank's batches, the
one-process replay they are checked against, a Lightning Trainer on the harness's ranks.

The harness starts the ranks (``LOCAL_RANK`` in the environment) and the gloo process
group: Lightning then starts no rank of its own and joins that group, so every Trainer and
Fabric of a launch runs in one pair of processes.

A step: one forward of this rank's batch, two backward passes (two conflicting losses),
then one optimizer step (SGD with momentum), ``STEPS`` steps; with ``accumulate`` > 1
that many micro-batches (one forward and two passes each) before each step. The replay:
one process, the same weights, each micro-batch's two losses of every rank's batch,
divided by the world size (DDP's and DeepSpeed's average), summed over the micro-batches
of a step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_retain import no_reshard_between_backwards

STEPS, BATCH, DIM, WORLD = 3, 4, 8, 2
TOL = 1e-6


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    """Two residual blocks and a head. ``branch``: also ``aux``, used by rank 0 only, and
    ``unused``, used by no rank (what ``find_unused_parameters=True`` is for)."""

    def __init__(self, branch: bool = False) -> None:
        super().__init__()
        torch.manual_seed(42)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(DIM, 4)
        self.branch = branch
        if branch:
            self.aux = nn.Linear(DIM, DIM)
            self.unused = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, rank: int = 0) -> torch.Tensor:
        x = self.blocks(x)
        if self.branch and rank == 0:
            x = x + self.aux(x)
        return self.head(x)


def losses(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return out.pow(2).mean(), out.tanh().sum() / out.shape[0]  # two conflicting losses


def batch(step: int, micro: int, rank: int) -> torch.Tensor:
    seed = 42 + rank + 1 + 100 * step + 10 * micro
    return torch.randn(BATCH, DIM, generator=torch.Generator().manual_seed(seed))


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def replay(*, branch: bool = False, accumulate: int = 1,
           steps: int = STEPS) -> dict[str, torch.Tensor]:
    """The parameters after ``steps`` steps in one process (see the module docstring)."""
    net = Net(branch)
    opt = sgd(net.parameters())
    for step in range(steps):
        for micro in range(accumulate):
            for rank in range(WORLD):
                l1, l2 = losses(net(batch(step, micro, rank), rank))
                ((l1 + l2) / WORLD).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def max_diff(params: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    assert set(params) == set(expected), (sorted(params), sorted(expected))
    return max((params[n].detach().cpu() - expected[n]).abs().max().item() for n in expected)


def net_params(net: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def same_on_every_rank(value: Any) -> None:
    """Each rank's ``value`` is rank 0's: a case's verdict must not differ by rank."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    assert all(v == values[0] for v in values), values


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run: with the block (``options``: its keyword arguments) or plain
    (``options`` None), ``accumulate`` micro-batches per optimizer step."""

    options: dict | None = None
    accumulate: int = 1
    branch: bool = False  # Net(branch=True)
    steps: int = STEPS
    plain_steps: tuple[int, ...] = ()  # optimizer steps run without the block
    first: str = "manual"  # "loss": the run's first pass is loss.backward(), not Lightning's

    @property
    def batches(self) -> int:
        return self.steps * self.accumulate

    def block(self, model: Any, step: int = 0) -> Any:
        if self.options is None or step in self.plain_steps:
            return contextlib.nullcontext()
        return no_reshard_between_backwards(model, **self.options)


def trainer(strategy: Any, **kwargs: Any) -> Any:
    """A Lightning ``Trainer`` on the harness's 2 CPU ranks: nothing saved or printed."""
    import lightning as L

    return L.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_epochs=1,
                     logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, use_distributed_sampler=False,
                     num_sanity_val_steps=0, **kwargs)


@contextlib.contextmanager
def quiet() -> Any:
    """Lightning's advice on CPU runs (worker counts, small batches) left out of the logs."""
    import logging

    lightning_log = logging.getLogger("lightning.pytorch")
    level = lightning_log.level
    lightning_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module="lightning")
            yield
    finally:
        lightning_log.setLevel(level)
