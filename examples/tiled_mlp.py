"""A tiled MLP (DeepSpeed's and axolotl's TiledMLP, Liger-Kernel's tiled MLP) under FSDP:
each decoder block gathered once and its gradient reduced once per step, on FSDP1 too.

Run (2 processes; CPU with gloo, or one GPU per process with NCCL if CUDA is there):

    torchrun --nproc_per_node 2 examples/tiled_mlp.py                  # FSDP2, 4 tiles
    torchrun --nproc_per_node 2 examples/tiled_mlp.py --fsdp 1         # FSDP1
    torchrun --nproc_per_node 2 examples/tiled_mlp.py --no-library     # the plain loop
    torchrun --nproc_per_node 2 examples/tiled_mlp.py --mlp-units      # each MLP its own unit

A tiny decoder (embedding, residual blocks of attention-free mixing and an MLP, final
norm, lm_head); each block an FSDP unit. For long sequences the MLP's intermediate
activation is the largest of a layer, so the MLP runs tiled, as the patch axolotl and
Liger apply to a model's MLP class: its forward runs the MLP over sequence tiles under
``no_grad`` (``TiledMLP.forward``), and its backward recomputes each tile with grad and
calls ``torch.autograd.backward`` per tile: a backward inside the backward, once per tile.
FSDP1's post-backward hook fires in each tile's backward: it reduce-scatters that tile's
gradient and frees the block's parameters, and the next tile computes with freed storage
(``RuntimeError: size mismatch``; Liger-Kernel #893: "parameters are always resharded
after the first backward pass"). FSDP2 runs the patch right (the tiles run inside the
unit's own hooks), gathering each block in the forward and again in the backward.
Inside ``no_reshard_between_backwards(model)`` the tiles of a pass are one backward for
FSDP: each unit gathered once per step and reduced once (see [Note: nested backward
passes] in ``fsdp_retain/_nested.py``). (A tiled function that calls an FSDP2 unit's
module per tile, instead of its forward, loses every tile after the first on plain
FSDP2: ``tests/nested/cases_nested.py``.)

Per step it prints the all-gathers and reduce-scatters (``CollectiveCounter`` in
examples/_shared.py); after every step it compares the parameters with a one-process
model trained without tiling on the same batches (gradients averaged over ranks, as FSDP
does), and exits non-zero if they differ by 1e-6 or more.
"""

import argparse
import copy
import functools
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _shared import CollectiveCounter, full_params  # checking and counting, not the point

# New code #
from fsdp_retain import no_reshard_between_backwards


class TiledMLP(torch.autograd.Function):
    """``TiledMLP.apply(fn, module, x, tiles)``: ``fn(module, tile)`` per sequence tile,
    as DeepSpeed's ``TiledMLP`` (axolotl's and Liger's are alike)."""

    @staticmethod
    def forward(ctx, fn, module, x, tiles):
        ctx.fn, ctx.module, ctx.tiles = fn, module, tiles
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([fn(module, t) for t in x.chunk(tiles, dim=1)], dim=1)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x = x.detach()
        x_grad = torch.zeros_like(x)
        tiles = zip(x.chunk(ctx.tiles, dim=1), grad.chunk(ctx.tiles, dim=1),
                    x_grad.chunk(ctx.tiles, dim=1))
        for x_tile, grad_tile, x_grad_tile in tiles:
            x_tile = x_tile.detach().requires_grad_(True)
            with torch.enable_grad():
                out = ctx.fn(ctx.module, x_tile)
            torch.autograd.backward(out, grad_tile)  # a backward inside the backward
            x_grad_tile.copy_(x_tile.grad)
        return None, None, x_grad, None


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.tiles = 0  # set by tile_mlps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def tile_mlps(model: nn.Module, tiles: int) -> None:
    """What axolotl's and Liger's patches do: the MLP's forward runs tiled."""
    original = MLP.forward

    def tiled_forward(self: MLP, x: torch.Tensor) -> torch.Tensor:
        if not self.tiles:
            return original(self, x)
        return TiledMLP.apply(original, self, x, self.tiles)

    MLP.forward = tiled_forward
    for module in model.modules():
        if isinstance(module, MLP):
            module.tiles = tiles


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.mix = nn.Linear(dim, dim)  # stands in for attention
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.norm1(x)).cumsum(dim=1) / x.shape[1]
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def units(model: nn.Module, mlp_units: bool) -> list[nn.Module]:
    return [*([b.mlp for b in model.blocks] if mlp_units else []), *model.blocks]


def shard_fsdp2(model: nn.Module, device: torch.device, mlp_units: bool) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for unit in units(model, mlp_units):
        fully_shard(unit, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def shard_fsdp1(model: nn.Module, device: torch.device, mlp_units: bool) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    wrapped = {id(m) for m in units(model, mlp_units)}
    policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in wrapped)
    return FullyShardedDataParallel(
        model, auto_wrap_policy=policy, device_id=device, use_orig_params=True
    )


def lm_loss(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def step_plain(model, tokens, labels) -> torch.Tensor:
    """Without the library."""
    loss = lm_loss(model, tokens, labels)
    loss.backward()
    return loss.detach()


def step_block(model, tokens, labels) -> torch.Tensor:
    # New code #
    with no_reshard_between_backwards(model):
        loss = lm_loss(model, tokens, labels)
        loss.backward()
    return loss.detach()


def reference_step(ref, ref_opt, tokens, labels) -> torch.Tensor:
    """The unsharded model without tiling, its gradients averaged over ranks as FSDP does."""
    loss = lm_loss(ref, tokens, labels)
    loss.backward()
    for p in ref.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    ref_opt.step()
    ref_opt.zero_grad()
    return loss.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fsdp", type=int, choices=(1, 2), default=2)
    parser.add_argument("--tiles", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-library", action="store_true", help="the plain loop, no block")
    parser.add_argument("--mlp-units", action="store_true", help="each MLP its own FSDP unit")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=96)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    args = parser.parse_args()
    if not 1 <= args.tiles <= args.seq:
        parser.error(f"--tiles {args.tiles}: pass 1 to --seq ({args.seq}) tiles")

    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank = dist.get_rank()

    torch.manual_seed(42)
    base = Decoder(args.vocab, args.dim, args.layers).to(device)
    ref = copy.deepcopy(base)  # untiled
    tile_mlps(base, args.tiles)
    shard = shard_fsdp2 if args.fsdp == 2 else shard_fsdp1
    model = shard(base, device, args.mlp_units)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    step_fn = step_plain if args.no_library else step_block
    count = len(units(base, args.mlp_units)) + 1
    if rank == 0:
        print(
            f"FSDP{args.fsdp}, {dist.get_world_size()} ranks, {device.type}, "
            f"{'plain' if args.no_library else 'block'}, {args.tiles} tiles, {count} units "
            f"({'MLPs, ' if args.mlp_units else ''}blocks, root), {args.steps} steps"
        )
    gen = torch.Generator().manual_seed(42 + rank + 1)
    max_diff = 0.0
    for step in range(args.steps):
        seq = torch.randint(args.vocab, (args.batch, args.seq + 1), generator=gen).to(device)
        tokens, labels = seq[:, :-1], seq[:, 1:]
        with CollectiveCounter({}) as comm:
            loss = step_fn(model, tokens, labels)
        opt.step()
        opt.zero_grad()
        reference_step(ref, ref_opt, tokens, labels)
        for name, p in full_params(model).items():  # compared after every step
            max_diff = max(max_diff, (p - ref.get_parameter(name)).abs().max().item())
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f} {comm.line()}")

    ok = max_diff < 1e-6
    if rank == 0:
        print(f"PARITY max_diff={max_diff:.3g} (max |param difference| vs untiled, "
              f"{args.steps} steps)")
        print("agreement: OK" if ok else "agreement: FAILED")
    dist.barrier()
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
