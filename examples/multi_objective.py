"""Multi-objective training under FSDP: one gradient per loss from one forward,
combined before the step.

Run (2 processes; CPU with gloo, or one GPU per process with NCCL if CUDA is there):

    torchrun --nproc_per_node 2 examples/multi_objective.py                    # PCGrad, FSDP2
    torchrun --nproc_per_node 2 examples/multi_objective.py --fsdp 1           # PCGrad, FSDP1
    torchrun --nproc_per_node 2 examples/multi_objective.py --method upgrad    # torchjd's UPGrad
    torchrun --nproc_per_node 2 examples/multi_objective.py --method norms     # log, then sum
    torchrun --nproc_per_node 2 examples/multi_objective.py --method upgrad --shared-only

A shared trunk with three task heads. Every method here needs each task's gradient
separately: PCGrad (Yu et al. 2020) projects each task's gradient off the others it
conflicts with, then sums them; torchjd's UPGrad (Jacobian descent; ``pip install
'.[mtl]'``) weights them by a quadratic program on their Gramian; ``norms`` only logs
how much each task pulls (each gradient's norm) and sums them. Without this library
each task gets its own forward and backward, its gradient copied out of ``.grad``.
With ``block.grads(loss)`` one forward serves every task: each pass is reduced and
sharded as usual (one reduce-scatter per unit), and the method runs on the k x k
Gramian of the task gradients (one all-reduce), the same on every rank. The script
trains both ways side by side, prints how far apart their parameters end up (float
rounding; it exits non-zero otherwise) and the step-time ratio.

``--shared-only`` is what torchjd's ``mtl_backward`` + ``jac_to_grad(shared, UPGrad())``
computes: the method weighs the task gradients over the shared trunk only (their
Gramian over ``model.blocks``), and each head gets its own task's gradient. One
forward still serves every task: ``LossGrads.select`` narrows the gradients to the
trunk, or to everything but it.
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
import fsdp_retain
from fsdp_retain import no_reshard_between_backwards


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class MultiTask(nn.Module):
    def __init__(self, dim: int, layers: int, tasks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.heads = nn.ModuleList(nn.Linear(dim, dim) for _ in range(tasks))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        for block in self.blocks:
            x = block(x)
        return [head(x) for head in self.heads]


def task_losses(outs: list[torch.Tensor], targets: list[torch.Tensor]) -> list[torch.Tensor]:
    return [F.mse_loss(out, target) for out, target in zip(outs, targets)]


def pcgrad_weights(gram: torch.Tensor) -> torch.Tensor:
    """PCGrad on the Gramian ``G[i, j] = <g_i, g_j>``: each projected gradient is a
    combination of the task gradients; returns the summed coefficients."""
    k = gram.shape[0]
    eye = torch.eye(k, dtype=gram.dtype, device=gram.device)
    coeffs = eye.clone()
    for i in range(k):
        for j in range(k):
            inner = coeffs[i] @ gram[:, j]
            if i != j and inner < 0:
                coeffs[i] -= inner / gram[j, j] * eye[j]
    return coeffs.sum(0)


def upgrad_weights(gram: torch.Tensor) -> torch.Tensor:
    from torchjd.aggregation import UPGrad  # pip install '.[mtl]'

    return UPGrad().gramian_weighting(gram)


def sum_weights(gram: torch.Tensor) -> torch.Tensor:
    return torch.ones(gram.shape[0], dtype=gram.dtype, device=gram.device)


METHODS = {"pcgrad": pcgrad_weights, "upgrad": upgrad_weights, "norms": sum_weights}


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
        model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=device, use_orig_params=True
    )


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def step_k_forwards(model, optimizer, x, targets, method, shared_only: bool) -> list[float]:
    """Without the library: a forward and a backward per task, each gradient copied out."""
    params = list(model.parameters())
    trunk = {id(p) for p in model.blocks.parameters()}
    weighed = [id(p) in trunk or not shared_only for p in params]
    grads = []
    for i in range(len(targets)):
        task_losses(model(x), targets)[i].backward()  # one forward per task
        grads.append([None if p.grad is None else p.grad.detach().clone() for p in params])
        optimizer.zero_grad()
    flat = [
        torch.cat([local(g).reshape(-1) for g, w in zip(gs, weighed) if g is not None and w]).double()
        for gs in grads
    ]
    gram = torch.stack(flat) @ torch.stack(flat).T
    dist.all_reduce(gram)  # the shards partition the model: their Gramians add up
    weights = method(gram)
    for p, w_p, *gs in zip(params, weighed, *grads):
        ws = weights if w_p else [1.0] * len(gs)  # a head: its own task's gradient
        present = [(float(w), g) for w, g in zip(ws, gs) if g is not None]
        if present:
            p.grad = sum(w * g for w, g in present)
    optimizer.step()
    optimizer.zero_grad()
    return gram.diagonal().sqrt().tolist()


def step_one_forward(model, optimizer, x, targets, method, shared_only: bool) -> list[float]:
    # New code #
    with no_reshard_between_backwards(model) as block:
        losses = task_losses(model(x), targets)  # one forward for every task
        grads = [block.grads(loss, retain_graph=True) for loss in losses]
        weighed = [g.select(model.blocks) for g in grads] if shared_only else grads
        gram = fsdp_retain.gramian(weighed)  # k x k, one all-reduce
        fsdp_retain.apply_grads(fsdp_retain.combine(weighed, method(gram)))
        if shared_only:  # each head: its own task's gradient
            heads = [g.select(exclude=model.blocks) for g in grads]
            fsdp_retain.apply_grads(fsdp_retain.combine(heads, [1.0] * len(heads)))
    optimizer.step()
    optimizer.zero_grad()
    return gram.diagonal().sqrt().tolist()  # each task's gradient norm (over the trunk)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fsdp", type=int, choices=(1, 2), default=2)
    parser.add_argument("--method", choices=sorted(METHODS), default="pcgrad")
    parser.add_argument("--tasks", type=int, default=3)
    parser.add_argument(
        "--shared-only", action="store_true",
        help="weigh over the shared trunk only; each head gets its own task's gradient "
        "(torchjd's mtl_backward)",
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the timing")
    parser.add_argument("--dim", type=int, default=None, help="default: 128 on CPU, 2048 on GPU")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=None, help="per rank; default: 32 CPU, 4096 GPU")
    args = parser.parse_args()
    if args.method == "upgrad":  # before any rank starts work
        from _deps import require

        require("torchjd", "qpsolvers", "quadprog", extra="mtl",
                why="examples/multi_objective.py --method upgrad")

    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    on_gpu = device.type == "cuda"
    dim = args.dim or (2048 if on_gpu else 128)
    batch = args.batch or (4096 if on_gpu else 32)

    torch.manual_seed(0)
    base = MultiTask(dim, args.layers, args.tasks).to(device)
    shard = shard_fsdp2 if args.fsdp == 2 else shard_fsdp1
    models = {"k_forwards": shard(copy.deepcopy(base), device), "one_forward": shard(base, device)}
    steps = {"k_forwards": step_k_forwards, "one_forward": step_one_forward}
    optimizers = {
        name: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for name, m in models.items()
    }
    times: dict[str, list[float]] = {name: [] for name in models}
    norms: dict[str, list[float]] = {name: [] for name in models}
    method = METHODS[args.method]
    gen = torch.Generator().manual_seed(1 + rank)
    for step in range(args.steps):
        x = torch.randn(batch, dim, generator=gen).to(device)
        targets = [torch.randn(batch, dim, generator=gen).to(device) for _ in range(args.tasks)]
        for name in models:  # alternate, so both see the same machine load
            if on_gpu:
                torch.cuda.synchronize()
            start = time.perf_counter()
            norms[name] = steps[name](
                models[name], optimizers[name], x, targets, method, args.shared_only
            )
            if on_gpu:
                torch.cuda.synchronize()
            if step >= args.warmup:
                times[name].append(time.perf_counter() - start)

    max_diff = torch.zeros((), device=device)
    for p_old, p_new in zip(models["k_forwards"].parameters(), models["one_forward"].parameters()):
        if local(p_old).numel():  # FSDP1 leaves some ranks no part of a parameter
            max_diff = torch.maximum(max_diff, (local(p_old) - local(p_new)).abs().max())
    dist.all_reduce(max_diff, op=dist.ReduceOp.MAX)
    t_old = statistics.median(times["k_forwards"])
    t_new = statistics.median(times["one_forward"])
    if rank == 0:
        print(
            f"FSDP{args.fsdp}, {dist.get_world_size()} ranks, {device.type}, {args.tasks} tasks, "
            f"{args.layers} blocks of dim {dim}, batch {batch}/rank, {args.steps} "
            f"{args.method} steps" + (" (weighing the shared trunk only)" if args.shared_only else "")
        )
        print("last step's task gradient norms: " + ", ".join(f"{n:.4g}" for n in norms["one_forward"]))
        print(f"max |param difference| vs {args.tasks} forwards: {max_diff.item():.3g}")
        print(
            f"median step: {args.tasks} forwards {t_old * 1e3:.1f} ms, one forward "
            f"{t_new * 1e3:.1f} ms: speedup {t_old / t_new:.2f}x"
        )
    ok = max_diff.item() <= 1e-4
    if rank == 0:
        print("agreement: OK" if ok else "agreement: FAILED")
    dist.barrier()
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
