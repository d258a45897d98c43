"""Multi-token prediction (several heads over one trunk) under FSDP: one forward, one
backward per head, the trunk gathered once and reduced once per step.

Run (2 processes; CPU with gloo, or one GPU per process with NCCL if CUDA is there):

    torchrun --nproc_per_node 2 examples/mtp_heads.py                     # FSDP2, 3 heads
    torchrun --nproc_per_node 2 examples/mtp_heads.py --fsdp 1            # FSDP1
    torchrun --nproc_per_node 2 examples/mtp_heads.py --no-library        # the plain loop
    torchrun --nproc_per_node 2 examples/mtp_heads.py --head-norms        # each head's norm

A tiny decoder (embedding, residual blocks) whose hidden states feed k prediction
heads; head i predicts the token i + 1 positions ahead (multi-token prediction, as in
DeepSeek-V3, whose MTP modules are chained rather than side by side; see
docs/mtp.md). Each trunk block and each head is its own FSDP unit. One forward of
the trunk and every head; then each head's loss its own backward, through that head
and the trunk (``retain_graph=True`` except the last). Plain FSDP1 fails in the second
backward (the first one freed unsharded parameters the retained graph still uses);
plain FSDP2 runs but all-gathers the trunk again and reduce-scatters its gradient in
every backward. Inside
``no_reshard_between_backwards(model, sync_grads="last", backwards=heads)`` the trunk is
gathered once and every unit reduces its gradient once. ``--head-norms`` takes each
head's gradient apart instead (``block.grads``), logs its norm and applies their sum.

Per step it prints the all-gathers and reduce-scatters (counted by a dispatch mode as
torch's ``CommDebugMode`` counts them; see ``CollectiveCounter`` in examples/_shared.py); after every step it
compares the parameters with a one-process unsharded model trained on the sum of the
head losses in one backward (each rank's batch; gradients averaged over ranks, as FSDP
does), and exits non-zero if they differ by 1e-6 or more (or, with ``--head-norms``, a
head's gradient norm by 1e-5 relative).
"""

import argparse
import copy
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _shared import CollectiveCounter, full_params  # checking and counting, not the point

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


class Head(nn.Module):
    """One prediction head: a block of its own, a norm and an output projection."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.block = Block(dim)
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, vocab, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(self.block(h)))


class MTPDecoder(nn.Module):
    """``forward`` returns one logits tensor per head, all from one pass of the trunk."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.heads = nn.ModuleList(Head(vocab, dim) for _ in range(heads))

    def forward(self, tokens: torch.Tensor) -> list[torch.Tensor]:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return [head(x) for head in self.heads]


def shard_fsdp2(model: nn.Module, device: torch.device) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    for head in model.heads:
        fully_shard(head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def shard_fsdp1(model: nn.Module, device: torch.device) -> nn.Module:
    import functools

    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    units = {id(m) for m in [*model.blocks, *model.heads]}
    policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in units)
    return FullyShardedDataParallel(
        model, auto_wrap_policy=policy, device_id=device, use_orig_params=True
    )


def head_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def head_passes(model, tokens, targets) -> torch.Tensor:
    outs = model(tokens)  # one forward of the trunk and every head
    total = torch.zeros((), device=tokens.device)
    for i, (logits, target) in enumerate(zip(outs, targets)):
        loss = head_loss(logits, target)
        loss.backward(retain_graph=i < len(outs) - 1)  # through head i and the trunk
        total += loss.detach()
    return total


def step_plain(model, tokens, targets) -> tuple[torch.Tensor, None]:
    """Without the library."""
    return head_passes(model, tokens, targets), None


def step_block(model, tokens, targets) -> tuple[torch.Tensor, None]:
    # New code #
    with no_reshard_between_backwards(model, sync_grads="last", backwards=len(targets)):
        return head_passes(model, tokens, targets), None


def step_block_norms(model, tokens, targets) -> tuple[torch.Tensor, list[float]]:
    """Each head's gradient apart (``block.grads``: reduced and sharded, ``.grad`` left
    alone), their norms from the Gramian's diagonal (one all-reduce), then their sum
    applied to ``.grad``. Each pass reduces its own gradient: ``sync_grads="every"``."""
    # New code #
    with no_reshard_between_backwards(model, backwards=len(targets)) as block:
        outs = model(tokens)
        losses = [head_loss(logits, target) for logits, target in zip(outs, targets)]
        grads = [
            block.grads(loss, retain_graph=i < len(losses) - 1) for i, loss in enumerate(losses)
        ]
        norms = fsdp_retain.gramian(grads).diagonal().sqrt()
        fsdp_retain.apply_grads(fsdp_retain.combine(grads, torch.ones_like(norms)))
    return torch.stack(losses).sum().detach(), norms.tolist()


def reference_step(ref, ref_opt, tokens, targets, head_norms: bool):
    """The unsharded model on the sum of the head losses in one backward, its gradients
    averaged over ranks as FSDP does (and, with ``head_norms``, each head's gradient
    norm, from a gradient of its own)."""
    outs = ref(tokens)
    losses = [head_loss(logits, target) for logits, target in zip(outs, targets)]
    norms = [_averaged_grad_norm(ref, loss) for loss in losses] if head_norms else None
    loss = torch.stack(losses).sum()
    loss.backward()
    for p in ref.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    ref_opt.step()
    ref_opt.zero_grad()
    return loss.detach(), norms


def _averaged_grad_norm(ref: nn.Module, loss: torch.Tensor) -> float:
    params = list(ref.parameters())
    grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    flat = torch.cat([g.reshape(-1) for g in grads if g is not None])
    dist.all_reduce(flat)
    return (flat / dist.get_world_size()).norm().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fsdp", type=int, choices=(1, 2), default=2)
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-library", action="store_true", help="the plain loop, no block")
    parser.add_argument(
        "--head-norms", action="store_true",
        help="each head's gradient apart with block.grads, its norm logged, then their sum",
    )
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=96)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    args = parser.parse_args()
    if args.heads < 1:
        parser.error(f"--heads {args.heads}: pass at least 1 head")
    if args.head_norms and args.no_library:
        parser.error("--head-norms uses block.grads: leave out --no-library")

    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank = dist.get_rank()

    torch.manual_seed(42)
    base = MTPDecoder(args.vocab, args.dim, args.layers, args.heads).to(device)
    ref = copy.deepcopy(base)
    units = {"trunk_block": sum(p.numel() for p in base.blocks[0].parameters())}
    model = (shard_fsdp2 if args.fsdp == 2 else shard_fsdp1)(base, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    step_fn = step_plain if args.no_library else step_block_norms if args.head_norms else step_block
    mode = "plain" if args.no_library else "block.grads" if args.head_norms else "block"
    if rank == 0:
        print(
            f"FSDP{args.fsdp}, {dist.get_world_size()} ranks, {device.type}, {mode}, "
            f"{args.heads} heads, {args.layers} blocks + {args.heads} heads + root, "
            f"{args.steps} steps"
        )
    gen = torch.Generator().manual_seed(42 + rank + 1)
    max_diff = max_loss_diff = max_norm_diff = 0.0
    for step in range(args.steps):
        seq = torch.randint(args.vocab, (args.batch, args.seq + args.heads), generator=gen)
        seq = seq.to(device)
        tokens = seq[:, : args.seq]
        targets = [seq[:, 1 + i : 1 + i + args.seq] for i in range(args.heads)]
        with CollectiveCounter(units) as comm:
            loss, norms = step_fn(model, tokens, targets)
        opt.step()
        opt.zero_grad()
        ref_loss, ref_norms = reference_step(ref, ref_opt, tokens, targets, args.head_norms)
        if norms is not None:
            for got, want in zip(norms, ref_norms):
                max_norm_diff = max(max_norm_diff, abs(got - want) / want)
        max_loss_diff = max(max_loss_diff, (loss - ref_loss).abs().item())
        for name, p in full_params(model).items():  # compared after every step
            max_diff = max(max_diff, (p - ref.get_parameter(name)).abs().max().item())
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f} {comm.line()}")
            if norms is not None:
                print(f"  head gradient norms: {', '.join(f'{n:.5g}' for n in norms)}")

    ok = max_diff < 1e-6 and max_norm_diff < 1e-5
    if rank == 0:
        if args.head_norms:
            print(f"head gradient norms: max relative difference {max_norm_diff:.3g}")
        print(f"max |loss difference| vs one backward of the summed loss: {max_loss_diff:.3g}")
        print(f"PARITY max_diff={max_diff:.3g} (max |param difference| over {args.steps} steps)")
        print("agreement: OK" if ok else "agreement: FAILED")
    dist.barrier()
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
