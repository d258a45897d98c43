"""Quick start: two losses, one forward, two backward passes under FSDP.

Run (2 processes; CPU with gloo, or one GPU per process with NCCL if CUDA is there):

    torchrun --nproc_per_node 2 examples/quickstart.py            # FSDP2 (fully_shard)
    torchrun --nproc_per_node 2 examples/quickstart.py --fsdp 1   # FSDP1 (FullyShardedDataParallel)

The training step logs the gradient norm of the task loss alone, then adds an
auxiliary loss: two backward passes over one forward. FSDP frees the unsharded
parameters a retained graph saved (FSDP1 then fails in the second backward,
FSDP2 all-gathers every layer again), so the usual workaround is a second
forward. This script trains two copies of one model side by side, the
two-forward way and with ``no_reshard_between_backwards``, then prints how far
apart their parameters end up (float rounding only; it exits non-zero
otherwise) and the step-time ratio.
"""

import argparse
import copy
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# New code #
from fsdp_retain import no_reshard_between_backwards


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def task_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def aux_loss(out: torch.Tensor) -> torch.Tensor:
    return 0.1 * out.pow(2).mean()


def shard_fsdp2(model: nn.Module, device: torch.device) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def shard_fsdp1(model: nn.Module, device: torch.device) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FullyShardedDataParallel(
        model,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        device_id=device,
    )


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard (FSDP2 parameters are DTensors, FSDP1's are local tensors)."""
    return t.to_local() if hasattr(t, "to_local") else t


def grad_norm(model: nn.Module) -> float:
    """L2 norm of the (sharded) gradients over all ranks."""
    total = torch.zeros((), device=next(model.parameters()).device)
    for p in model.parameters():
        if p.grad is not None:
            total += local(p.grad).float().pow(2).sum()
    dist.all_reduce(total)
    return total.sqrt().item()


def step_two_forward(model, optimizer, x, target) -> float:
    out = model(x)
    task_loss(out, target).backward()
    task_norm = grad_norm(model)
    out = model(x)  # the second forward this library removes
    aux_loss(out).backward()
    optimizer.step()
    optimizer.zero_grad()
    return task_norm


def step_retain(model, optimizer, x, target) -> float:
    # New code #
    with no_reshard_between_backwards(model):
        out = model(x)
        task_loss(out, target).backward(retain_graph=True)
        task_norm = grad_norm(model)
        aux_loss(out).backward()
    optimizer.step()
    optimizer.zero_grad()
    return task_norm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fsdp", type=int, choices=(1, 2), default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the timing")
    parser.add_argument("--dim", type=int, default=None, help="default: 256 on CPU, 2048 on GPU")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=None, help="per rank; default: 64 CPU, 4096 GPU")
    args = parser.parse_args()

    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    on_gpu = device.type == "cuda"
    dim = args.dim or (2048 if on_gpu else 256)
    batch = args.batch or (4096 if on_gpu else 64)

    torch.manual_seed(0)
    base = Net(dim, args.layers).to(device)
    shard = shard_fsdp2 if args.fsdp == 2 else shard_fsdp1
    models = {"two_forward": shard(copy.deepcopy(base), device), "retain": shard(base, device)}
    steps = {"two_forward": step_two_forward, "retain": step_retain}
    optimizers = {
        name: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for name, m in models.items()
    }
    times = {name: [] for name in models}
    norms = {name: [] for name in models}

    gen = torch.Generator().manual_seed(1 + rank)
    for step in range(args.steps):
        x = torch.randn(batch, dim, generator=gen).to(device)
        target = torch.randn(batch, dim, generator=gen).to(device)
        for name in models:  # the two ways alternate, so both see the same machine load
            if on_gpu:
                torch.cuda.synchronize()
            start = time.perf_counter()
            norms[name].append(steps[name](models[name], optimizers[name], x, target))
            if on_gpu:
                torch.cuda.synchronize()
            if step >= args.warmup:
                times[name].append(time.perf_counter() - start)

    max_diff = torch.zeros((), device=device)
    for p_old, p_new in zip(models["two_forward"].parameters(), models["retain"].parameters()):
        max_diff = torch.maximum(max_diff, (local(p_old) - local(p_new)).abs().max())
    dist.all_reduce(max_diff, op=dist.ReduceOp.MAX)
    pairs = zip(norms["two_forward"], norms["retain"])
    norm_diff = max(abs(a - b) / max(a, 1e-12) for a, b in pairs)
    t_old = statistics.median(times["two_forward"])
    t_new = statistics.median(times["retain"])
    if rank == 0:
        print(
            f"FSDP{args.fsdp}, {dist.get_world_size()} ranks, {device.type}, "
            f"{args.layers} blocks of dim {dim}, batch {batch}/rank, {args.steps} SGD steps"
        )
        print(f"max |param difference| vs two-forward: {max_diff.item():.3g}")
        print(f"max relative difference of the task-loss grad norm: {norm_diff:.3g}")
        print(
            f"median step: two-forward {t_old * 1e3:.1f} ms, retain {t_new * 1e3:.1f} ms: "
            f"speedup {t_old / t_new:.2f}x ({100 * (1 - t_new / t_old):.0f}% of the step saved)"
        )
    ok = max_diff.item() <= 1e-4 and norm_diff <= 1e-4
    if rank == 0:
        print("agreement: OK" if ok else "agreement: FAILED")
    dist.barrier()  # torch 2.13 + gloo can abort at exit when one rank destroys the group early
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
