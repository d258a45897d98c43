#!/usr/bin/env python
"""Benchmark: the block's own cost against FSDP2's recipe (pytorch #172543), side by side.

    python scripts/bench_recipe.py                      # 2 CPU ranks (gloo), 8 timed steps
    python scripts/bench_recipe.py --steps 30 --profile prof   # and cProfile rank 0's block
    torchrun --nproc_per_node 2 scripts/bench_recipe.py

The model: 8 residual MLP blocks of width 256 (``x + fc2(gelu(fc1(x)))``) and a
linear head, fp32; ``fully_shard`` per block and on the root (9 FSDP2 units);
batch ``--batch`` x 256 per rank. One step: one forward, two losses, two backwards
(the first with ``retain_graph=True``), SGD step. Four ways, interleaved step by step
(each round runs every way once, so load changes hit them alike), each on its own
copy of the model (same weights):

- ``recipe``: ``fully_shard(..., reshard_after_forward=False)`` on every unit,
  ``set_reshard_after_backward(False)`` before the passes, ``reshard()`` of every
  unit after the last; FSDP2 alone;
- ``recipe_sync_last``: the same with ``set_requires_gradient_sync(False)`` for
  pass 1 and ``True`` for the last;
- ``library``: ``no_reshard_between_backwards(model)`` (the defaults);
- ``library_last``: ``no_reshard_between_backwards(model, sync_grads="last", backwards=2)``.

It prints the all-gathers and reduce-scatters of one counted step per way (the
library and the recipe must match), the median step time per way (a step lasts
until its slowest rank is done), and the block's overhead: ``library / recipe`` and
``library_last / recipe_sync_last``, as the ratio of medians and as the median of
the per-round ratios (steadier on a shared CPU), and the block's own milliseconds
(median of the per-round differences). ``--nproc 1 --batch 1`` leaves little but
the block's Python work to compare. ``--profile DIR`` writes a cProfile
of rank 0's steps of ``--profile-way`` (``library``; after the timed rounds) and prints its top entries.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import time

WAYS = ("recipe", "recipe_sync_last", "library", "library_last")
PAIRS = (("library", "recipe"), ("library_last", "recipe_sync_last"))


def build(width: int, blocks: int):
    import torch
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, width)

        def forward(self, x):
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(blocks))
            self.head = nn.Linear(width, width)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    torch.manual_seed(42)
    return Net()


def wrap(net, recipe: bool):
    from torch.distributed.fsdp import fully_shard

    kwargs = dict(reshard_after_forward=False) if recipe else {}
    for block in net.blocks:
        fully_shard(block, **kwargs)
    return fully_shard(net, **kwargs)


def step(way: str, model, opt, x) -> None:
    from torch.distributed.fsdp import FSDPModule

    from fsdp_retain import no_reshard_between_backwards

    recipe = way.startswith("recipe")
    if recipe:
        model.set_reshard_after_backward(False)
        block = contextlib.nullcontext()
    elif way == "library":
        block = no_reshard_between_backwards(model)
    else:
        block = no_reshard_between_backwards(model, sync_grads="last", backwards=2)
    with block:
        out = model(x)
        if way == "recipe_sync_last":
            model.set_requires_gradient_sync(False)
        out.pow(2).mean().backward(retain_graph=True)
        if way == "recipe_sync_last":
            model.set_requires_gradient_sync(True)
        out.mean().backward()
    if recipe:
        for unit in model.modules():
            if isinstance(unit, FSDPModule):
                unit.reshard()
    opt.step()
    opt.zero_grad(set_to_none=True)


def run_rank(args) -> None:
    import torch
    import torch.distributed as dist

    from fsdp_retain._measure import count_collectives

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        net = build(args.width, args.blocks)
        models = {way: wrap(copy.deepcopy(net), way.startswith("recipe")) for way in WAYS}
        opts = {way: torch.optim.SGD(m.parameters(), lr=1e-3) for way, m in models.items()}
        gen = torch.Generator().manual_seed(43 + rank)
        x = torch.randn(args.batch, args.width, generator=gen)
        for _ in range(args.warmup):
            for way in WAYS:
                step(way, models[way], opts[way], x)
        times: dict[str, list[float]] = {way: [] for way in WAYS}
        for _ in range(args.steps):
            for way in WAYS:
                dist.barrier()
                start = time.perf_counter()
                step(way, models[way], opts[way], x)
                elapsed = torch.tensor(time.perf_counter() - start)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank
                times[way].append(elapsed.item())
        counts = {}
        for way in WAYS:
            with count_collectives() as c:
                step(way, models[way], opts[way], x)
            counts[way] = (c.all_gather, c.reduce_scatter)
        if rank == 0:
            print(render(args, times, counts), flush=True)
        if args.profile:
            way = args.profile_way
            profile(args, way, models[way], opts[way], x, rank)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def render(args, times: dict[str, list[float]], counts: dict) -> str:
    lines = [f"FSDP2, {args.blocks} residual MLP blocks of width {args.width} + head "
             f"({args.blocks + 1} units), batch {args.batch}, {args.world} CPU ranks (gloo), "
             f"{args.steps} interleaved steps after {args.warmup} warm-up",
             "", f"{'way':<18} {'all-gathers':>11} {'reduce-scatters':>15} {'median ms':>10}"]
    for way in WAYS:
        ag, rs = counts[way]
        lines.append(f"{way:<18} {ag:>11} {rs:>15} {1e3 * statistics.median(times[way]):>10.2f}")
    lines.append("")
    for lib, recipe in PAIRS:
        of_medians = statistics.median(times[lib]) / statistics.median(times[recipe])
        per_round = statistics.median(a / b for a, b in zip(times[lib], times[recipe]))
        extra = statistics.median(a - b for a, b in zip(times[lib], times[recipe]))
        lines.append(f"{lib} / {recipe}: {of_medians:.3f}x (ratio of medians), "
                     f"{per_round:.3f}x (median of per-round ratios), "
                     f"{1e3 * extra:+.2f} ms (median of per-round differences)")
    return "\n".join(lines)


def profile(args, way: str, model, opt, x, rank: int) -> None:
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        step(way, model, opt, x)
    prof.disable()
    if rank == 0:
        os.makedirs(args.profile, exist_ok=True)
        path = os.path.join(args.profile, f"{way}_rank0.prof")
        prof.dump_stats(path)
        stats = pstats.Stats(prof).sort_stats("cumulative")
        print(f"\ncProfile of rank 0, {args.steps} {way} steps ({path}):", flush=True)
        stats.print_stats("fsdp_retain", 30)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2, help="ranks (not under torchrun)")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64, help="rows per rank")
    parser.add_argument("--profile", default=None,
                        help="folder for a cProfile of rank 0's steps of --profile-way")
    parser.add_argument("--profile-way", choices=WAYS, default="library")
    args = parser.parse_args(argv)
    args.world = int(os.environ.get("WORLD_SIZE", args.nproc))
    return args


def main() -> int:
    args = parse_args()
    if "RANK" in os.environ:
        run_rank(args)
        return 0
    from _ranks import launch

    return launch(__file__, args.nproc)


if __name__ == "__main__":  # gloo's exit-time abort: see [Note: the report leaves
    # without the interpreter's teardown] (fsdp_retain/report/_launch.py)
    from fsdp_retain.report._launch import leave

    leave(main())
