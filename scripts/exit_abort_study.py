"""Is gloo's exit-time abort ("terminate called without an active exception", exit -6
after a run that passed) caused by fsdp_retain? A quickstart-like 2-rank FSDP2 run on
CPU/gloo, with or without the library.

    torchrun --standalone --nproc_per_node 2 scripts/exit_abort_study.py --mode two_forward
    # --mode two_forward | retain_plain | lib | both_lib (quickstart's two copies)
    # --shutdown barrier_destroy | destroy | none | barrier_only

fsdp_retain is imported only for --mode lib / both_lib. Run each variant many times
and count exits of -6 (results in docs/limits.md).
"""

import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, dim: int, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, dim)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def shard(model: Net) -> Net:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def grad_norm(model: Net) -> float:
    total = torch.zeros(())
    for param in model.parameters():
        if param.grad is not None:
            total += param.grad.to_local().pow(2).sum()
    dist.all_reduce(total)
    return total.sqrt().item()


def step_two_forward(model, opt, x, y) -> None:
    F.mse_loss(model(x), y).backward()
    grad_norm(model)
    (0.1 * model(x).pow(2).mean()).backward()
    opt.step()
    opt.zero_grad()


def step_retain_plain(model, opt, x, y) -> None:
    out = model(x)
    F.mse_loss(out, y).backward(retain_graph=True)
    grad_norm(model)
    (0.1 * out.pow(2).mean()).backward()
    opt.step()
    opt.zero_grad()


def step_lib(model, opt, x, y) -> None:
    from fsdp_retain import no_reshard_between_backwards

    with no_reshard_between_backwards(model):
        out = model(x)
        F.mse_loss(out, y).backward(retain_graph=True)
        grad_norm(model)
        (0.1 * out.pow(2).mean()).backward()
    opt.step()
    opt.zero_grad()


STEPS = {
    "two_forward": [step_two_forward],
    "retain_plain": [step_retain_plain],
    "lib": [step_lib],
    "both_lib": [step_two_forward, step_lib],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="two_forward", choices=sorted(STEPS))
    parser.add_argument("--shutdown", default="barrier_destroy",
                        choices=("barrier_destroy", "destroy", "none", "barrier_only"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dim", type=int, default=256)
    args = parser.parse_args()
    if args.mode in ("lib", "both_lib"):
        import fsdp_retain  # noqa: F401
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = Net(args.dim)
    steps = STEPS[args.mode]
    models = [shard(copy.deepcopy(base)) for _ in steps]
    opts = [torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in models]
    gen = torch.Generator().manual_seed(1 + rank)
    for _ in range(args.steps):
        x = torch.randn(64, args.dim, generator=gen)
        y = torch.randn(64, args.dim, generator=gen)
        for step, model, opt in zip(steps, models, opts):
            step(model, opt, x, y)
    if rank == 0:
        print("agreement: OK", flush=True)
    if args.shutdown in ("barrier_destroy", "barrier_only"):
        dist.barrier()
    if args.shutdown in ("barrier_destroy", "destroy"):
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
