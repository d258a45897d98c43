#!/usr/bin/env python
"""Benchmark: the block's host cost per unit, on every backend, side by side in one run.

    python scripts/bench_host_cost.py                       # 2 CPU ranks (gloo)
    python scripts/bench_host_cost.py --backends ddp --models 64 --steps 30
    python scripts/bench_host_cost.py --json docs/bench/host_cost.json   # record it

On a GPU each unit's kernels take microseconds, so the host time the block spends per
unit per pass (hooks, bookkeeping, bucket handling) is what a step pays; on a CPU it shows
once units are tiny. Models: ``--units`` residual ``Linear(16, 16)`` units and a head
(``x + fc(x)``; one FSDP unit each; ``--batch`` rows), and 8 x ``Linear(512, 512)``
(``wide``, ``--wide-batch`` rows: compute and communication more than host work). Backends: DDP, FSDP1 (FULL_SHARD, original parameters),
FSDP2, and DeepSpeed ZeRO-0..3 where ``deepspeed`` imports (run it in the DeepSpeed venv:
``scripts/venv_ci.sh deepspeed install``). Each backend has a copy of the model per way,
the same weights; every round runs every way once (interleaved, so load changes hit them
alike), a step lasts until its slowest rank is done. Ways:

- ``plain1``: one forward, one backward, the optimizer step, without the library;
- ``block1``: the same inside ``no_reshard_between_backwards`` (the defaults);
- ``best2``: two losses without the library, the best plain way: FSDP2's recipe
  (``set_reshard_after_backward(False)`` over one forward, ``reshard()`` after), two
  forwards elsewhere;
- ``block2``: one forward, two backward passes in the block (``sync_grads="every"``);
- ``block2_last``: the same with ``sync_grads="last", backwards=2``;
- ``forward``: one forward under ``no_grad`` (a part, for ``ideal2``);
- ``ideal2``: the ideal from measured parts, per round: one forward and two of plain
  code's backward-with-reduction, ``2 x plain1 - forward`` (its one optimizer step is
  counted twice, a little in the block's favour; ``forward`` builds no graph, a little
  against it).

Each model runs at least ``--steps`` rounds, and more (up to ``--max-steps``) until its
timed steps add up to ``--min-seconds``: a small model's steps last milliseconds, and
its per-round ratios scatter widely.

Printed per backend and model: the median step of each way, the rounds, and the ratios
``block1/plain1``, ``block2/best2`` and ``block2/ideal2`` as the median of the per-round
ratios with their spread (the 25th to 75th percentile), and the block's extra host time
per unit per pass: ``(block1 - plain1) / units`` (the median of the per-round
differences), and per unit added from one residual model to the next (``8->64``,
``64->256``: flat when the cost per unit does not grow). The last line is this
machine's calibration (``python -m fsdp_retain.report calibrate``); ``--json`` writes
everything.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import time

BACKENDS = ("ddp", "fsdp1", "fsdp2", "zero0", "zero1", "zero2", "zero3")
WAYS = ("plain1", "block1", "best2", "block2", "block2_last", "forward")


def build(kind: str):
    import torch
    import torch.nn as nn

    class Residual(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.fc = nn.Linear(width, width)

        def forward(self, x):
            return x + self.fc(x)

    torch.manual_seed(0)
    if kind == "wide":
        return nn.Sequential(*[Residual(512) for _ in range(8)], nn.Linear(512, 1)), 512
    return nn.Sequential(*[Residual(16) for _ in range(int(kind))], nn.Linear(16, 1)), 16


def wrap(backend: str, net):
    """``(model, step)``: ``step()`` runs the optimizer step of this backend."""
    import torch

    if backend.startswith("zero"):
        import deepspeed

        opt = torch.optim.SGD(net.parameters(), lr=1e-4)
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": int(backend[-1]),
                                        "stage3_param_persistence_threshold": 0},
                  "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
        engine, *_ = deepspeed.initialize(model=net, optimizer=opt, config=config)
        return engine, engine.step
    if backend == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(net)
    elif backend == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        cpu = {"device_id": torch.device("cpu")} if not torch.cuda.is_available() else {}
        for i, unit in enumerate(net):
            net[i] = FSDP(unit, use_orig_params=True, **cpu)
        model = FSDP(net, use_orig_params=True, **cpu)
    else:
        from torch.distributed.fsdp import fully_shard

        for unit in net:
            fully_shard(unit)
        model = fully_shard(net)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, step


def losses(out):
    return [out.pow(2).mean(), out.mean()]


def backward(model, loss, retain_graph: bool = False) -> None:
    """``loss.backward``; a DeepSpeed engine's own ``backward`` (ZeRO-0 takes no other)."""
    if hasattr(model, "zero_optimization_stage"):
        model.backward(loss, retain_graph=retain_graph)
    else:
        loss.backward(retain_graph=retain_graph)


def run_way(way: str, backend: str, model, step, x) -> None:
    import torch

    from fsdp_retain import no_reshard_between_backwards

    if way == "plain1":
        backward(model, losses(model(x))[0])
    elif way == "block1":
        with no_reshard_between_backwards(model):
            backward(model, losses(model(x))[0])
    elif way in ("block2", "block2_last"):
        options = {"sync_grads": "last", "backwards": 2} if way == "block2_last" else {}
        with no_reshard_between_backwards(model, **options):
            first, second = losses(model(x))
            backward(model, first, retain_graph=True)
            backward(model, second)
    elif way == "best2" and backend == "fsdp2":
        model.set_reshard_after_backward(False)
        try:
            first, second = losses(model(x))
            first.backward(retain_graph=True)
            second.backward()
        finally:
            model.set_reshard_after_backward(True)
            for unit in model.modules():
                if hasattr(unit, "reshard"):
                    unit.reshard()
    elif way == "best2":
        for i in range(2):
            backward(model, losses(model(x))[i])
    elif way == "forward":
        with torch.no_grad():
            losses(model(x))
        return
    step()


def run_rank(args) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict = {}
    try:
        for backend in args.backends:
            for kind in args.models:
                results.setdefault(backend, {})[kind] = measure(args, backend, kind)
                if rank == 0:
                    print(render_one(backend, kind, results[backend][kind]), flush=True)
            results[backend]["marginal_us_per_unit"] = marginal(results[backend])
            if rank == 0 and results[backend]["marginal_us_per_unit"]:
                print(f"{backend:<6} block1's extra time per added unit (us): " + ", ".join(
                    f"{k} {v:+.1f}" for k, v in results[backend]["marginal_us_per_unit"].items()),
                    flush=True)
        if rank == 0:
            from fsdp_retain.report._calibrate import calibration

            payload = {"calibration": calibration(), "world": world, "steps": args.steps,
                       "results": results}
            print(calibration_line(payload["calibration"]), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(payload, f, indent=1, sort_keys=True)
                    f.write("\n")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure(args, backend: str, kind: str) -> dict:
    import torch
    import torch.distributed as dist

    net, width = build(kind)
    units = len(net)
    models = {way: wrap(backend, copy.deepcopy(net)) for way in WAYS}
    gen = torch.Generator().manual_seed(43 + dist.get_rank())
    x = torch.randn(args.wide_batch if kind == "wide" else args.batch, width, generator=gen)

    def once(way: str) -> None:
        model, step = models[way]
        run_way(way, backend, model, step, x)

    for _ in range(args.warmup):
        for way in WAYS:
            once(way)
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    rounds = 0
    # At least --steps rounds, more (up to --max-steps) until --min-seconds: a cheap model's
    # steps last milliseconds, and their ratios scatter. Every rank has the same times
    # (all-reduced), so every rank stops at the same round.
    while rounds < args.steps or (rounds < args.max_steps
                                  and sum(map(sum, times.values())) < args.min_seconds):
        rounds += 1
        for way in WAYS:
            dist.barrier()
            start = time.perf_counter()
            once(way)
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[way].append(elapsed.item())
    times["ideal2"] = [2 * a - b for a, b in zip(times["plain1"], times["forward"])]
    return {"units": units, "rounds": rounds, "times_s": times, "ratios": ratios(times, units)}


def ratios(times: dict[str, list[float]], units: int) -> dict:
    def rounds(a: str, b: str) -> dict:
        per = sorted(x / y for x, y in zip(times[a], times[b]))
        q = statistics.quantiles(per, n=4)
        return {"median": statistics.median(per), "p25": q[0], "p75": q[2]}

    out = {"block1_vs_plain1": rounds("block1", "plain1"),
           "block2_vs_best2": rounds("block2", "best2"),
           "block2_last_vs_best2": rounds("block2_last", "best2"),
           "block2_vs_ideal2": rounds("block2", "ideal2")}
    extra = statistics.median(a - b for a, b in zip(times["block1"], times["plain1"]))
    out["block1_extra_us_per_unit"] = 1e6 * extra / units
    return out


def marginal(results: dict) -> dict:
    """The block's extra time per unit added between two residual models, ``8->64`` and
    ``64->256``: flat when the cost per unit does not grow with the units."""
    sizes = sorted(int(k) for k in results if k.isdigit())
    out = {}
    for a, b in zip(sizes, sizes[1:]):
        ra, rb = results[str(a)], results[str(b)]
        extra = (rb["ratios"]["block1_extra_us_per_unit"] * rb["units"]
                 - ra["ratios"]["block1_extra_us_per_unit"] * ra["units"])
        out[f"{a}->{b}"] = extra / (rb["units"] - ra["units"])
    return out


def render_one(backend: str, kind: str, result: dict) -> str:
    model = ("8 x Linear(512, 512) + head" if kind == "wide"
             else f"{kind} x Linear(16, 16) + head")
    medians = "  ".join(f"{way} {1e3 * statistics.median(v):.2f}"
                        for way, v in result["times_s"].items())
    r = result["ratios"]
    parts = [f"{name.replace('_vs_', '/')} {v['median']:.3f} [{v['p25']:.3f}-{v['p75']:.3f}]"
             for name, v in r.items() if isinstance(v, dict)]
    return (f"{backend:<6} {model:<28} ms: {medians}  ({result['rounds']} rounds)\n{'':<6} {'':<28} "
            + "  ".join(parts) + f"  block1 extra {r['block1_extra_us_per_unit']:+.1f} us/unit")


def calibration_line(cal: dict) -> str:
    return f"# machine: calibration: python {cal['python_s']:.3f} s, torch {cal['torch_s']:.3f} s"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=None,
                        help="default: every one that imports")
    parser.add_argument("--models", nargs="+", default=["8", "64", "256", "wide"],
                        help="residual units (a number) or 'wide'")
    parser.add_argument("--steps", type=int, default=24, help="timed rounds, at least")
    parser.add_argument("--min-seconds", type=float, default=8.0,
                        help="more rounds (up to --max-steps) until the timed steps add up to this")
    parser.add_argument("--max-steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="rows per rank")
    parser.add_argument("--wide-batch", type=int, default=64, help="rows per rank, wide model")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (not under torchrun)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    if args.backends is None:
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            args.backends = ["ddp", "fsdp1", "fsdp2"]
        else:
            args.backends = list(BACKENDS)
    return args


def main() -> int:
    args = parse_args()
    if "RANK" in os.environ:
        with contextlib.suppress(KeyboardInterrupt):
            run_rank(args)
        return 0
    from _ranks import launch

    return launch(__file__, args.nproc)


if __name__ == "__main__":  # gloo's exit-time abort: see [Note: the report leaves
    # without the interpreter's teardown] (fsdp_retain/report/_launch.py)
    from fsdp_retain.report._launch import leave

    leave(main())
