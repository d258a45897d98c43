"""Chunked cross-entropy (torchtitan's ChunkedCELoss) under FSDP: the lm_head gathered once
and its gradient reduced once per step, not once per chunk.

Run (2 processes; CPU with gloo, or one GPU per process with NCCL if CUDA is there):

    torchrun --nproc_per_node 2 examples/chunked_ce.py                     # FSDP2, 4 chunks
    torchrun --nproc_per_node 2 examples/chunked_ce.py --fsdp 1            # FSDP1
    torchrun --nproc_per_node 2 examples/chunked_ce.py --no-library        # the plain loop
    torchrun --nproc_per_node 2 examples/chunked_ce.py --keep-unsharded lm_head  # a budget

A tiny decoder (embedding, residual blocks, final norm, lm_head; each block and the
lm_head its own FSDP unit). The logits of a long sequence over a large vocabulary are
the largest activation of a step, so the loss never builds them whole: one forward of
the trunk to hidden states ``h``, cut off the graph (``h_d = h.detach()``); per sequence
chunk, the lm_head's logits, that chunk's share of the cross-entropy and its backward
through the lm_head alone (it adds to ``h_d.grad``); then one backward of the trunk,
``h.backward(h_d.grad)``. Each chunk is a forward and a backward of the lm_head unit,
and plain FSDP (1 and 2) treats each as its own iteration: it all-gathers the lm_head
twice per chunk (forward, then backward, having resharded after the forward) and
reduce-scatters its gradient once per chunk. Inside
``no_reshard_between_backwards(model, sync_grads="last", backwards=chunks + 1)`` the
lm_head is gathered once for all chunks and every unit reduces its gradient once.

Per step it prints the all-gathers and reduce-scatters (counted by a dispatch mode as
torch's ``CommDebugMode`` counts them; see ``CollectiveCounter`` in examples/_shared.py); after every step it
compares the parameters with a one-process unsharded model trained on the full
(unchunked) loss (each rank's batch; gradients averaged over ranks, as FSDP does), and
exits non-zero if they differ by 1e-6 or more.
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


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Decoder(nn.Module):
    """``forward`` returns the normed hidden states; the loss applies ``lm_head`` (as in
    torchtitan when a chunked loss owns the output projection)."""

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
        return self.norm(x)


def shard_fsdp2(model: nn.Module, device: torch.device) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model.lm_head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def shard_fsdp1(model: nn.Module, device: torch.device) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    units = {id(m) for m in [*model.blocks, model.lm_head]}
    policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in units)
    return FullyShardedDataParallel(
        model, auto_wrap_policy=policy, device_id=device, use_orig_params=True
    )


def chunk_loss(lm_head: nn.Module, h: torch.Tensor, labels: torch.Tensor, chunk: slice):
    """The chunk's cross-entropy, scaled by its share of the tokens (the chunks add up to
    the mean over the whole sequence)."""
    logits = lm_head(h[:, chunk])
    loss = F.cross_entropy(logits.flatten(0, 1), labels[:, chunk].flatten(), reduction="sum")
    return loss / labels.numel()


def chunked_passes(model, tokens, labels, chunks) -> torch.Tensor:
    h = model(tokens)  # one forward of the trunk
    h_d = h.detach().requires_grad_()
    total = torch.zeros((), device=h.device)
    for chunk in chunks:  # one forward and backward of the lm_head per chunk
        loss = chunk_loss(model.lm_head, h_d, labels, chunk)
        loss.backward()  # adds to h_d.grad and the lm_head's gradient
        total += loss.detach()
    h.backward(h_d.grad)  # one backward of the trunk
    return total


def step_plain(model, tokens, labels, chunks) -> torch.Tensor:
    """Without the library."""
    return chunked_passes(model, tokens, labels, chunks)


def step_block(model, tokens, labels, chunks, keep_unsharded: bool | int = True) -> torch.Tensor:
    # New code #
    with no_reshard_between_backwards(
        model, keep_unsharded=keep_unsharded, sync_grads="last", backwards=len(chunks) + 1
    ):
        return chunked_passes(model, tokens, labels, chunks)


def reference_step(ref, ref_opt, tokens, labels) -> torch.Tensor:
    """The unsharded model on the full loss (logits of the whole sequence at once), its
    gradients averaged over ranks as FSDP does."""
    logits = ref.lm_head(ref(tokens))
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
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
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-library", action="store_true", help="the plain loop, no block")
    parser.add_argument(
        "--keep-unsharded", choices=("all", "lm_head", "none"), default="all",
        help="the block's keep_unsharded: True, a budget of the lm_head's bytes, or False",
    )
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=96)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    args = parser.parse_args()
    if not 1 <= args.chunks <= args.seq:
        parser.error(f"--chunks {args.chunks}: pass 1 to --seq ({args.seq}) chunks")

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
    ref = copy.deepcopy(base)
    lm_head_bytes = base.lm_head.weight.numel() * base.lm_head.weight.element_size()
    units = {"lm_head": base.lm_head.weight.numel()}
    model = (shard_fsdp2 if args.fsdp == 2 else shard_fsdp1)(base, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    bounds = torch.linspace(0, args.seq, args.chunks + 1).round().long().tolist()
    chunks = [slice(a, b) for a, b in zip(bounds, bounds[1:])]
    keep = {"all": True, "lm_head": lm_head_bytes, "none": False}[args.keep_unsharded]
    step_fn = step_plain if args.no_library else functools.partial(step_block, keep_unsharded=keep)
    mode = "plain" if args.no_library else f"block (keep_unsharded={keep})"
    if rank == 0:
        print(
            f"FSDP{args.fsdp}, {dist.get_world_size()} ranks, {device.type}, {mode}, "
            f"{args.chunks} chunks, {args.layers} blocks + lm_head + root, {args.steps} steps"
        )
    gen = torch.Generator().manual_seed(42 + rank + 1)
    max_diff = max_loss_diff = 0.0
    for step in range(args.steps):
        seq = torch.randint(args.vocab, (args.batch, args.seq + 1), generator=gen).to(device)
        tokens, labels = seq[:, :-1], seq[:, 1:]
        with CollectiveCounter(units) as comm:
            loss = step_fn(model, tokens, labels, chunks)
        opt.step()
        opt.zero_grad()
        ref_loss = reference_step(ref, ref_opt, tokens, labels)
        max_loss_diff = max(max_loss_diff, (loss - ref_loss).abs().item())
        for name, p in full_params(model).items():  # compared after every step
            max_diff = max(max_diff, (p - ref.get_parameter(name)).abs().max().item())
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f} {comm.line()}")

    ok = max_diff < 1e-6
    if rank == 0:
        print(f"max |loss difference| vs the unchunked loss: {max_loss_diff:.3g}")
        print(f"PARITY max_diff={max_diff:.3g} (max |param difference| over {args.steps} steps)")
        print("agreement: OK" if ok else "agreement: FAILED")
    dist.barrier()
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
