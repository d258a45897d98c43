"""PyTorch Lightning manual optimization with two backward passes over one forward, under
FSDP (Lightning issue #19685) and DDP, checked against a one-process reference.

    python examples/lightning_manual.py --api trainer --fsdp 1 --wrap lightning
    python examples/lightning_manual.py --api trainer --fsdp 1 --wrap user
    python examples/lightning_manual.py --api trainer --fsdp 2
    python examples/lightning_manual.py --api fabric --fsdp 1
    python examples/lightning_manual.py --api fabric --fsdp 2
    python examples/lightning_manual.py --api trainer --ddp --static-graph
    python examples/lightning_manual.py --api fabric --ddp

Lightning starts the 2 ranks itself (CPU, gloo). The block takes the module the strategy
wraps: ``self.trainer.strategy.model`` in a LightningModule, the module ``fabric.setup``
returned with Fabric. ``--ddp``: Lightning's ``DDPStrategy`` (``--static-graph``: with
``static_graph=True``) instead of FSDP; plain Fabric DDP (``--no-library``) is silently
wrong there, and the last line says so. ``--wrap lightning``: Lightning's ``FSDPStrategy`` wraps the model
(``auto_wrap_policy``), and runs ``training_step`` inside the FSDP root's forward;
``--wrap user``: ``configure_model`` shards it. FSDP2: ``ModelParallelStrategy``,
``fully_shard`` in ``configure_model``.

Lightning refuses FSDP1 on a machine without an accelerator (FSDP1 needs ``device_id``
set to the CPU there): ``CPUFSDPStrategy`` below gives FSDP1 ``device_id=cpu`` and
changes nothing else; drop it on GPUs. The last line says whether every parameter after
3 SGD-momentum steps equals the reference's within 1e-6.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from _deps import require  # checking, not the point

require("lightning", why="examples/lightning_manual.py", extra="lightning")

import lightning as L  # noqa: E402
from lightning.fabric.strategies import FSDPStrategy as FabricFSDPStrategy  # noqa: E402
from lightning.fabric.strategies import (  # noqa: E402
    ModelParallelStrategy as FabricModelParallelStrategy,
)
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy  # noqa: E402
from lightning.pytorch.strategies import (  # noqa: E402
    DDPStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
)

from fsdp_retain import no_reshard_between_backwards  # noqa: E402

STEPS, BATCH, DIM, WORLD = 3, 4, 16, 2
USE_LIBRARY = True  # --no-library: the same code without the block (FSDP1 fails)


def retain_block(model: nn.Module):
    return no_reshard_between_backwards(model) if USE_LIBRARY else contextlib.nullcontext()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(Block(), Block(), Block())
        self.head = nn.Linear(DIM, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def losses(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return out.pow(2).mean(), out.tanh().sum() / out.shape[0]  # two conflicting losses


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(BATCH, DIM, generator=torch.Generator().manual_seed(100 * step + rank))


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def reference() -> dict[str, torch.Tensor]:
    """One process, unsharded: each step the gradient of both losses, averaged over the
    ranks' batches (what FSDP's reduction gives)."""
    net = Net()
    opt = sgd(net.parameters())
    for step in range(STEPS):
        for rank in range(WORLD):
            l1, l2 = losses(net(batch(step, rank)))
            ((l1 + l2) / WORLD).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in net.named_parameters()}


@contextlib.contextmanager
def fsdp1_on_cpu():
    """FSDP1 with ``device_id`` set to the CPU while Lightning wraps the model (Lightning
    passes the accelerator's index, None on a CPU); nothing else changes."""
    import torch.distributed.fsdp as fsdp

    real = fsdp.FullyShardedDataParallel

    class OnCPU(real):  # type: ignore[misc, valid-type]
        def __init__(self, *args, device_id=None, **kwargs) -> None:
            super().__init__(*args, device_id=device_id or torch.device("cpu"), **kwargs)

    fsdp.FullyShardedDataParallel = OnCPU
    try:
        yield
    finally:
        fsdp.FullyShardedDataParallel = real


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's FSDPStrategy on a CPU (CPU-only tests; drop it on GPUs)."""

    def _setup_model(self, model: nn.Module) -> nn.Module:
        with fsdp1_on_cpu():
            return super()._setup_model(model)


class CPUFabricFSDPStrategy(FabricFSDPStrategy):
    """Fabric's FSDPStrategy on a CPU: Fabric refuses the class itself without a GPU, not
    a subclass (CPU-only tests; drop it on GPUs)."""

    def setup_module(self, module: nn.Module) -> nn.Module:
        with fsdp1_on_cpu():
            return super().setup_module(module)


def shard(net: Net, fsdp: int, mesh=None) -> nn.Module:
    """What a user's ``configure_model`` does: each block its own unit, then the root."""
    if fsdp == 2:
        from torch.distributed.fsdp import fully_shard

        for block in net.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(net, mesh=mesh)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    # use_orig_params=True: as Lightning's own wrapping of the LightningModule around it.
    return FSDP(net, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"),
                use_orig_params=True)


class Model(L.LightningModule):
    def __init__(self, fsdp: int, wrap: str) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.fsdp, self.wrap = fsdp, wrap
        self.net: nn.Module = Net()

    def configure_model(self) -> None:
        if self.fsdp == 2:
            self.net = shard(self.net, 2, self.device_mesh["data_parallel"])
        elif self.wrap == "user":
            self.net = shard(self.net, 1)

    def training_step(self, _, step: int) -> None:
        opt = self.optimizers()
        # New code #
        with retain_block(self.trainer.strategy.model):
            l1, l2 = losses(self.net(batch(step, self.global_rank)))
            self.manual_backward(l1, retain_graph=True)  # pass 1
            self.manual_backward(l2)  # pass 2
        opt.step()
        opt.zero_grad()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return sgd(self.parameters())

    def train_dataloader(self):
        return torch.utils.data.DataLoader(range(STEPS), batch_size=1)


def full_params(module: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    fsdp1 = [m for m in module.modules() if isinstance(m, FSDP)]
    if fsdp1:
        with FSDP.summon_full_params(fsdp1[0], writeback=False):
            return {_clean(n): p.detach().clone() for n, p in fsdp1[0].named_parameters()}
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in module.named_parameters()}


def _clean(name: str) -> str:
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    name = clean_tensor_name(name)
    prefixes = ("module.", "_forward_module.", "net.")  # DDP's, Fabric's, the LightningModule's
    while name.startswith(prefixes):
        name = name.split(".", 1)[1]
    return name


def run_trainer(fsdp: int, wrap: str, ddp: dict | None = None) -> dict[str, torch.Tensor]:
    if ddp is not None:
        strategy = DDPStrategy(**ddp)
    elif fsdp == 2:
        strategy = ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1)
    elif wrap == "lightning":
        strategy = CPUFSDPStrategy(auto_wrap_policy={Block})
    else:
        strategy = CPUFSDPStrategy()
    model = Model(fsdp, wrap)
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=STEPS,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(model)
    return {_clean(n): v for n, v in full_params(trainer.strategy.model).items()}


def run_fabric(fsdp: int, ddp: dict | None = None) -> dict[str, torch.Tensor]:
    if ddp is not None:
        strategy = FabricDDPStrategy(**ddp)
    elif fsdp == 2:
        strategy = FabricModelParallelStrategy(
            parallelize_fn=lambda net, mesh: shard(net, 2, mesh["data_parallel"]),
            data_parallel_size=WORLD, tensor_parallel_size=1)
    else:
        strategy = CPUFabricFSDPStrategy(auto_wrap_policy={Block})
    fabric = L.Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(Net())
    opt = fabric.setup_optimizers(sgd(model.parameters()))
    for step in range(STEPS):
        # New code #
        with retain_block(model):
            l1, l2 = losses(model(batch(step, fabric.global_rank)))
            fabric.backward(l1, retain_graph=True)
            fabric.backward(l2)
        opt.step()
        opt.zero_grad()
    return {_clean(n): v for n, v in full_params(model).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--api", choices=("trainer", "fabric"), default="trainer")
    parser.add_argument("--fsdp", type=int, choices=(1, 2), default=1)
    parser.add_argument("--wrap", choices=("lightning", "user"), default="lightning",
                        help="FSDP1 with the Trainer: who wraps the model")
    parser.add_argument("--ddp", action="store_true", help="DDPStrategy instead of FSDP")
    parser.add_argument("--static-graph", action="store_true",
                        help="with --ddp: DDPStrategy(static_graph=True)")
    parser.add_argument("--no-library", action="store_true",
                        help="the same passes without the block")
    args = parser.parse_args()
    global USE_LIBRARY
    USE_LIBRARY = not args.no_library
    ddp = dict(static_graph=args.static_graph) if args.ddp else None
    if args.api == "fabric":
        params = run_fabric(args.fsdp, ddp)
    else:
        params = run_trainer(args.fsdp, args.wrap, ddp)
    expected = reference()
    assert set(params) == set(expected), (sorted(params), sorted(expected))
    diff = max((params[n] - expected[n]).abs().max().item() for n in expected)
    if dist.get_rank() == 0:
        print(f"PARITY max_diff={diff:.3g}")
        print(f"agreement: {'OK' if diff < 1e-6 else 'MISMATCH'}")
    if diff >= 1e-6:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
