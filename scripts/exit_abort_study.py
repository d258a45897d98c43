"""Is gloo's exit-time abort ("terminate called without an active exception", exit -6
after a run that passed) caused by fsdp_retain? A quickstart-like 2-rank FSDP2 run on
CPU/gloo, with or without the library.

    torchrun --standalone --nproc_per_node 2 scripts/exit_abort_study.py --mode two_forward
    # --mode two_forward | retain_plain | lib | both_lib (quickstart's two copies)
    # --shutdown barrier_destroy | destroy | none | barrier_only

fsdp_retain is imported only for --mode lib / both_lib. Run each variant many times
and count exits of -6 (results in the README's known limits).
"""
import argparse, copy, os, sys
import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--mode", default="two_forward")
p.add_argument("--shutdown", default="barrier_destroy")
p.add_argument("--steps", type=int, default=3)
p.add_argument("--dim", type=int, default=256)
a = p.parse_args()

class Block(nn.Module):
    def __init__(s, d):
        super().__init__(); s.norm = nn.LayerNorm(d); s.fc1 = nn.Linear(d, 4*d); s.fc2 = nn.Linear(4*d, d)
    def forward(s, x): return x + s.fc2(F.gelu(s.fc1(s.norm(x))))
class Net(nn.Module):
    def __init__(s, d, n=4):
        super().__init__(); s.blocks = nn.ModuleList(Block(d) for _ in range(n)); s.head = nn.Linear(d, d)
    def forward(s, x):
        for b in s.blocks: x = b(x)
        return s.head(x)

def shard(m):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for b in m.blocks: fully_shard(b, mesh=mesh)
    return fully_shard(m, mesh=mesh)

def gnorm(m):
    t = torch.zeros(())
    for q in m.parameters():
        if q.grad is not None: t += q.grad.to_local().pow(2).sum()
    dist.all_reduce(t); return t.sqrt().item()

def step_two_forward(m, o, x, y):
    F.mse_loss(m(x), y).backward(); gnorm(m)
    (0.1 * m(x).pow(2).mean()).backward(); o.step(); o.zero_grad()
def step_retain_plain(m, o, x, y):
    out = m(x); F.mse_loss(out, y).backward(retain_graph=True); gnorm(m)
    (0.1 * out.pow(2).mean()).backward(); o.step(); o.zero_grad()
def step_lib(m, o, x, y):
    from fsdp_retain import no_reshard_between_backwards
    with no_reshard_between_backwards(m):
        out = m(x); F.mse_loss(out, y).backward(retain_graph=True); gnorm(m)
        (0.1 * out.pow(2).mean()).backward()
    o.step(); o.zero_grad()

if a.mode in ("lib", "both_lib"):
    import fsdp_retain  # noqa
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
base = Net(a.dim)
fns = {"two_forward": [step_two_forward], "retain_plain": [step_retain_plain], "lib": [step_lib],
       "both_lib": [step_two_forward, step_lib], "both_plain": [step_two_forward, step_retain_plain]}[a.mode]
models = [shard(copy.deepcopy(base)) for _ in fns]
opts = [torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in models]
g = torch.Generator().manual_seed(1 + rank)
for _ in range(a.steps):
    x = torch.randn(64, a.dim, generator=g); y = torch.randn(64, a.dim, generator=g)
    for f, m, o in zip(fns, models, opts): f(m, o, x, y)
if rank == 0: print("agreement: OK", flush=True)
if a.shutdown in ("barrier_destroy", "barrier_only"): dist.barrier()
if a.shutdown in ("barrier_destroy", "destroy"): dist.destroy_process_group()
