"""Models and steps that run backward passes inside a backward (run inside ranks).

- ``TiledMLP``: a tiled MLP as DeepSpeed's ``TiledMLP`` and axolotl's write it: the
  forward runs the MLP over sequence tiles under ``no_grad``; the backward recomputes
  each tile with grad enabled and calls ``torch.autograd.backward`` per tile, so the
  parameters accumulate one gradient per tile. ``how="grad"`` takes
  ``torch.autograd.grad`` per tile over the input and the parameters (Liger-Kernel's
  ``LigerTiledMLPFunction``), ``how="checkpoint"`` recomputes each tile under reentrant
  activation checkpointing (a backward inside the tile's backward).
- ``TiledNet``: an input ``Linear``, two ``TiledLayer`` (a norm, then the tiled MLP
  in a residual), an output ``Linear``; ``inside=True`` puts the tiling inside the
  MLP's own forward (the tiles bypass the MLP's ``__call__``, as Liger's and axolotl's
  modules do), else the layer tiles a call of the MLP module.
- ``cached_step``: a GradCache (sentence-transformers ``CachedMultipleNegativesRankingLoss``)
  step: mini-batch forwards without grad, a contrastive loss over the detached
  embeddings, then one forward and ``backward(cached gradient)`` per mini-batch, after
  the loss's backward (``replay="after"``) or from a hook on the loss during it
  (``replay="hook"``, as sentence-transformers does).

Everything is float64: parity is checked to 1e-9 against one process on the union
batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

DIM = 8
SEQ = 8  # tiled along this dimension (dim 1)
BATCH = 2  # per rank


def call_module(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x)


class TiledMLP(torch.autograd.Function):
    """``TiledMLP.apply(fn, module, x, tiles, how)``: ``fn(module, tile)`` per tile."""

    @staticmethod
    def forward(ctx, fn, module, x, tiles, how):  # type: ignore[override]
        ctx.fn, ctx.module, ctx.tiles, ctx.how = fn, module, tiles, how
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([fn(module, t) for t in x.chunk(tiles, dim=1)], dim=1)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        x = x.detach()
        x_grad = torch.zeros_like(x)
        tiles = zip(x.chunk(ctx.tiles, dim=1), grad.chunk(ctx.tiles, dim=1),
                    x_grad.chunk(ctx.tiles, dim=1))
        for x_tile, grad_tile, x_grad_tile in tiles:
            x_tile = x_tile.detach().requires_grad_(True)
            with torch.enable_grad():
                if ctx.how == "checkpoint":
                    out = checkpoint(ctx.fn, ctx.module, x_tile, use_reentrant=True)
                else:
                    out = ctx.fn(ctx.module, x_tile)
            if ctx.how == "grad":
                params = [p for p in ctx.module.parameters() if p.requires_grad]
                found = torch.autograd.grad(out, [x_tile, *params], grad_tile)
                x_grad_tile.copy_(found[0])
                for param, param_grad in zip(params, found[1:]):
                    param.grad = param_grad if param.grad is None else param.grad + param_grad
                continue
            torch.autograd.backward(out, grad_tile)
            x_grad_tile.copy_(x_tile.grad)
        return None, None, x_grad, None, None


class MLP(nn.Module):
    def __init__(self, dim: int = DIM, tiles: int = 0, how: str = "backward") -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * dim + 1)
        self.fc2 = nn.Linear(2 * dim + 1, dim)
        self.tiles, self.how = tiles, how  # tiles > 0: tile inside this forward

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tiles:
            return TiledMLP.apply(MLP.plain, self, x, self.tiles, self.how)
        return self.plain(x)


class TiledLayer(nn.Module):
    def __init__(self, dim: int, tiles: int, how: str, inside: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = MLP(dim, tiles if inside else 0, how)
        self.tiles, self.how, self.inside = tiles, how, inside

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        if self.inside:
            return x + self.mlp(h)
        return x + TiledMLP.apply(call_module, self.mlp, h, self.tiles, self.how)


class TiledNet(nn.Module):
    def __init__(self, tiles: int = 4, how: str = "backward", inside: bool = False,
                 dim: int = DIM, tied: bool = False, frozen: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim, bias=False)
        self.layers = nn.ModuleList(TiledLayer(dim, tiles, how, inside) for _ in range(2))
        self.out = nn.Linear(dim, dim, bias=False)
        if tied:
            self.out.weight = self.inp.weight
        if frozen:  # a frozen part, as a LoRA base: the first layer's norm
            self.layers[0].norm.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


def make_tiled(**kwargs) -> TiledNet:
    torch.manual_seed(42)
    return TiledNet(**kwargs).double()


def tokens(rank: int, step: int) -> torch.Tensor:
    """Rank ``rank``'s batch at ``step``: (BATCH, SEQ, DIM), float64."""
    gen = torch.Generator().manual_seed(42 + rank + 1 + 1000 * step)
    return torch.randn(BATCH, SEQ, DIM, generator=gen, dtype=torch.float64)


def loss1(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def loss2(out: torch.Tensor) -> torch.Tensor:
    return out.sin().mean()


# Cached (GradCache) losses #
class Encoder(nn.Module):
    """Token embeddings in, one embedding per example out (mean over the sequence)."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim, bias=False)
        self.layers = nn.ModuleList(MLP(dim) for _ in range(2))
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.out(h).mean(dim=1)


def make_encoder() -> Encoder:
    torch.manual_seed(42)
    return Encoder().double()


def pairs(rank: int, step: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s (queries, documents) at ``step``: ``size`` pairs each."""
    gen = torch.Generator().manual_seed(7 + rank + 1 + 1000 * step)
    shape = (size, 4, DIM)
    return (torch.randn(shape, generator=gen, dtype=torch.float64),
            torch.randn(shape, generator=gen, dtype=torch.float64))


def ranking_loss(queries: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
    """Multiple-negatives ranking loss: each query against every document of the batch."""
    scores = queries @ docs.T / 0.5
    return F.cross_entropy(scores, torch.arange(len(queries)))


def plain_ranking_step(model: nn.Module, queries: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
    """The same loss without caching: one forward per side, one backward."""
    loss = ranking_loss(model(queries), model(docs))
    loss.backward()
    return loss.detach()


def cached_step(model: nn.Module, queries: torch.Tensor, docs: torch.Tensor,
                minibatches: int, replay: str = "hook",
                backward: Any = None) -> torch.Tensor:
    """One GradCache step over ``minibatches`` mini-batches per side; returns the loss.
    ``backward``: the trainer's backward of the returned loss (default
    ``loss.backward()``; a DeepSpeed engine's ``engine.backward`` under the Trainer)."""
    sides = [queries.chunk(minibatches), docs.chunk(minibatches)]
    with torch.no_grad():
        reps = [[model(mb).detach().requires_grad_() for mb in side] for side in sides]
    loss = ranking_loss(torch.cat(reps[0]), torch.cat(reps[1]))
    loss.backward()  # reaches the cached embeddings only
    cached = [[r.grad for r in side] for side in reps]

    def replay_all(scale: torch.Tensor | float = 1.0) -> None:
        with torch.enable_grad():
            for side, grads in zip(sides, cached):
                for mb, grad in zip(side, grads):
                    surrogate = torch.dot(model(mb).flatten(), grad.flatten()) * scale
                    surrogate.backward()

    if replay == "after":
        replay_all()
        return loss.detach()
    # sentence-transformers: the loss returned to the trainer is a leaf whose hook
    # replays the mini-batches when the trainer's backward reaches it.
    out = loss.detach().requires_grad_()

    def hook(grad_output: torch.Tensor) -> torch.Tensor:
        replay_all(grad_output)
        return grad_output

    out.register_hook(hook)
    (backward or torch.Tensor.backward)(out * 1.0)  # the trainer's loss.backward()
    return out.detach()
