#!/usr/bin/env python
"""Benchmark: per-loss gradients for k = 2, 4, 8 losses, ``block.grads`` over one
forward against the k-forward way, side by side in one run.

    torchrun --standalone --nproc_per_node 2 scripts/bench_loss_grads.py             # FSDP2
    torchrun --standalone --nproc_per_node 2 scripts/bench_loss_grads.py --fsdp 1    # FSDP1

The model is ``examples/multi_objective.py``'s: a shared trunk (``--layers`` residual
MLP blocks of width ``--dim``, one FSDP unit each) and k linear heads in the root
unit, fp32, PCGrad on the Gramian. Per k, the two ways alternate step by step (the
same machine load) for ``--steps`` after ``--warmup``; the table gives each way's
median step time, the ratio, and the all-gathers / reduce-scatters / all-reduces of
one step counted in a separate, untimed step (``count_collectives``). On CPU ranks
the times are ratios only; absolute times come from a GPU.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp_retain._measure import count_collectives

ROOT = Path(__file__).resolve().parent.parent


def _example():
    spec = importlib.util.spec_from_file_location("multi_objective", ROOT / "examples" / "multi_objective.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _counts_k_forwards(ex, model, x, targets) -> dict[str, int]:
    """One k-forward step's collectives, each forward counted apart and added up, plus
    the Gramian's all-reduce."""
    totals = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 1}
    for i in range(len(targets)):
        with count_collectives() as counts:
            ex.task_losses(model(x), targets)[i].backward()
        for kind in totals:
            totals[kind] += getattr(counts, kind)
    model.zero_grad()
    return totals


def _counts_block_grads(ex, model, optimizer, x, targets) -> dict[str, int]:
    with count_collectives() as counts:
        ex.step_one_forward(model, optimizer, x, targets, ex.pcgrad_weights)
    return {kind: getattr(counts, kind) for kind in ("all_gather", "reduce_scatter", "all_reduce")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fsdp", type=int, choices=(1, 2), default=2)
    parser.add_argument("--losses", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32, help="per rank")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ex = _example()
    device = torch.device("cpu")
    shard = ex.shard_fsdp2 if args.fsdp == 2 else ex.shard_fsdp1
    rows = []
    for k in args.losses:
        torch.manual_seed(0)
        base = ex.MultiTask(args.dim, args.layers, k)
        models = {"k_forwards": shard(copy.deepcopy(base), device), "block_grads": shard(base, device)}
        opts = {n: torch.optim.SGD(m.parameters(), lr=1e-3) for n, m in models.items()}
        steps = {"k_forwards": ex.step_k_forwards, "block_grads": ex.step_one_forward}
        times: dict[str, list[float]] = {n: [] for n in models}
        gen = torch.Generator().manual_seed(1 + rank)
        for step in range(args.warmup + args.steps):
            x = torch.randn(args.batch, args.dim, generator=gen)
            targets = [torch.randn(args.batch, args.dim, generator=gen) for _ in range(k)]
            for name in models:
                start = time.perf_counter()
                steps[name](models[name], opts[name], x, targets, ex.pcgrad_weights)
                if step >= args.warmup:
                    times[name].append(time.perf_counter() - start)
        x = torch.randn(args.batch, args.dim, generator=gen)
        targets = [torch.randn(args.batch, args.dim, generator=gen) for _ in range(k)]
        counts = {
            "k_forwards": _counts_k_forwards(ex, models["k_forwards"], x, targets),
            "block_grads": _counts_block_grads(ex, models["block_grads"], opts["block_grads"], x, targets),
        }
        t_old = statistics.median(times["k_forwards"])
        t_new = statistics.median(times["block_grads"])
        rows.append((k, t_old, t_new, counts))
    if rank == 0:
        print(
            f"FSDP{args.fsdp}, {dist.get_world_size()} CPU ranks, {args.layers} blocks of dim "
            f"{args.dim} + k heads, batch {args.batch}/rank, PCGrad, median of {args.steps} steps"
        )
        print("| k | k forwards (ms) | block.grads (ms) | ratio | AG / RS / AR, k forwards | AG / RS / AR, block.grads |")
        print("|--:|--:|--:|--:|--:|--:|")
        for k, t_old, t_new, counts in rows:
            fmt = lambda c: f"{c['all_gather']} / {c['reduce_scatter']} / {c['all_reduce']}"  # noqa: E731
            print(
                f"| {k} | {t_old * 1e3:.1f} | {t_new * 1e3:.1f} | {t_new / t_old:.2f}x | "
                f"{fmt(counts['k_forwards'])} | {fmt(counts['block_grads'])} |"
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":  # gloo's exit-time abort: see [Note: the report leaves
    # without the interpreter's teardown] (fsdp_retain/report/_launch.py)
    from fsdp_retain.report._launch import leave

    main()
    leave(0)
