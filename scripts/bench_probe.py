#!/usr/bin/env python
"""Benchmark: a probe pass (``block.backward(loss, param_grads=False)``) against a
full backward of the same loss, and the RL step this projects to.

    python scripts/bench_probe.py                         # 2 CPU ranks, FSDP2 and FSDP1
    python scripts/bench_probe.py --backend fsdp2 --steps 20 --out bench_out
    torchrun --nproc_per_node 2 scripts/bench_probe.py    # as ranks of torchrun
    python scripts/bench_probe.py --device cuda --dtype bf16 --size 1.5b --batch 4   # NCCL, all GPUs

The model is the report's Qwen2-shaped causal LM (``Qwen2Config``: 4 layers,
hidden 256, intermediate 704, 8 heads, 2 KV heads, vocab 8192; random weights),
one FSDP unit per decoder layer plus the root, fp32, batch 4 x 128 tokens per
rank (``--size``, ``--dtype``, ``--batch``, ``--seq-len`` and ``--device cuda``, NCCL
with one GPU per rank, change that). Each step runs one forward inside ``no_reshard_between_backwards`` and
times backward 1 on the log-prob loss (``-mean log p``), then runs the policy
loss backward untimed. The three ways of backward 1 alternate step by step, so
they see the same machine load:

- ``full_every``: ``loss.backward(retain_graph=True)``, reduce-scattered
  (``sync_grads="every"``): the log-prob backward of the two-forward way;
- ``full_last``: the same without communication (``sync_grads="last"``): the
  compute of a full backward alone;
- ``probe``: ``block.backward(loss, param_grads=False, retain_graph=True)``.

It prints the median of each (``--steps`` after ``--warmup``), the probe's
ratio to each full backward, and the RL step that ratio projects to from the
seed's phase profile on one H200 (forward 0.576 s, log-prob backward 0.880 s,
second forward 0.566 s, loss backward 1.033 s):
``(F1 + r * B1 + B2) / (F1 + B1 + F2 + B2)``, next to 0.81x for removing the
second forward alone. ``--out`` also gets ``bench_probe.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fsdp_retain.report._config import DTYPES, SIZES  # noqa: E402 - the report's presets

DIMS = dict(SIZES["small"])  # --size, --batch and --seq-len replace it in parse_args
# The seed's phase profile on one H200, seconds.
H200 = dict(forward_1=0.576, logp_backward=0.880, forward_2=0.566, loss_backward=1.033)
WAYS = {  # name: (param_grads, sync_grads)
    "full_every": (True, "every"),
    "full_last": (True, "last"),
    "probe": (False, "every"),
}


def projected_step(ratio: float) -> float:
    """The RL step with backward 1 ``ratio`` times as long and no second forward,
    relative to the two-forward step, on the H200 profile."""
    p = H200
    total = p["forward_1"] + p["logp_backward"] + p["forward_2"] + p["loss_backward"]
    return (p["forward_1"] + ratio * p["logp_backward"] + p["loss_backward"]) / total


def no_second_forward_step() -> float:
    return projected_step(1.0)


def build_model(device):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=DIMS["vocab"], hidden_size=DIMS["hidden"],
        intermediate_size=DIMS["intermediate"], num_hidden_layers=DIMS["layers"],
        num_attention_heads=DIMS["heads"], num_key_value_heads=DIMS["kv_heads"],
        max_position_embeddings=max(32768, DIMS["seq_len"]), tie_word_embeddings=DIMS["tie"],
        use_cache=False,
    )
    torch.manual_seed(0)
    with torch.device(device):
        return Qwen2ForCausalLM(config).to(DIMS["torch_dtype"])


def wrap(model, backend: str, device):
    layers = model.model.layers
    if backend == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in layers:
            fully_shard(layer)
        fully_shard(model)
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FullyShardedDataParallel(
        model, auto_wrap_policy=ModuleWrapPolicy({type(layers[0])}), device_id=device
    )


def token_logprobs(model, ids):
    import torch

    logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def time_backends(args) -> dict:
    """Runs on every rank; returns the medians (rank 0 prints them)."""
    import torch
    import torch.distributed as dist

    from fsdp_retain import no_reshard_between_backwards

    cuda = args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank + 1)
    ids = torch.randint(0, DIMS["vocab"], (DIMS["batch"], DIMS["seq_len"]), generator=gen)
    advantages = torch.randn(DIMS["batch"], generator=gen)
    ids, advantages = ids.to(device), advantages.to(device)
    results = {}
    for backend in args.backend:
        model = wrap(build_model(device), backend, device)
        times = {way: [] for way in WAYS}
        for step in range(args.warmup + args.steps):
            for way, (param_grads, sync_grads) in WAYS.items():
                with no_reshard_between_backwards(model, sync_grads=sync_grads) as block:
                    logp = token_logprobs(model, ids)
                    if cuda:
                        torch.cuda.synchronize()
                    dist.barrier()
                    start = time.perf_counter()
                    block.backward(-logp.mean(), param_grads=param_grads, retain_graph=True)
                    if cuda:
                        torch.cuda.synchronize()
                    elapsed = time.perf_counter() - start
                    (-(advantages[:, None] * logp).mean()).backward()
                model.zero_grad()
                if step >= args.warmup:
                    times[way].append(elapsed)
        medians = {way: statistics.median(t) for way, t in times.items()}
        # The slowest rank decides a collective step.
        packed = torch.tensor([medians[w] for w in WAYS], dtype=torch.float64, device=device)
        dist.all_reduce(packed, op=dist.ReduceOp.MAX)
        medians = dict(zip(WAYS, packed.tolist()))
        ratios = {
            "probe_vs_full_every": medians["probe"] / medians["full_every"],
            "probe_vs_full_last": medians["probe"] / medians["full_last"],
        }
        results[backend] = dict(
            median_s=medians,
            ratios=ratios,
            projected_step=projected_step(ratios["probe_vs_full_last"]),
        )
        del model
        if cuda:
            torch.cuda.empty_cache()
    return results


def report(results: dict, args, world: int) -> str:
    lines = [
        f"Qwen2-shaped LM ({DIMS['layers']} layers, hidden {DIMS['hidden']}), {args.dtype}, "
        f"{world} {args.device} ranks ({'nccl' if args.device == 'cuda' else 'gloo'}), batch {DIMS['batch']} x {DIMS['seq_len']} per rank; median of "
        f"{args.steps} steps after {args.warmup} warm-up, slowest rank",
        f"{'backward 1 (ms)':<18}" + "".join(f"{b:>10}" for b in results),
    ]
    for way in WAYS:
        lines.append(
            f"{way:<18}" + "".join(f"{r['median_s'][way] * 1e3:10.1f}" for r in results.values())
        )
    for key, label in (("probe_vs_full_last", "probe / full_last"),
                       ("probe_vs_full_every", "probe / full_every")):
        lines.append(f"{label:<18}" + "".join(f"{r['ratios'][key]:9.2f}x" for r in results.values()))
    lines.append(
        "projected RL step vs two-forward on the H200 profile (F1 + r*B1 + B2)/(F1+B1+F2+B2), "
        "r = probe / full_last:"
    )
    for backend, r in results.items():
        lines.append(
            f"  {backend}: {r['projected_step']:.2f}x (r = {r['ratios']['probe_vs_full_last']:.2f}),"
            f" against {no_second_forward_step():.2f}x for removing the second forward alone"
        )
    return "\n".join(lines)


def run_rank(args) -> None:
    import torch.distributed as dist

    if args.device == "cuda":
        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        results = time_backends(args)
        if dist.get_rank() == 0:
            print(report(results, args, dist.get_world_size()), flush=True)
            if args.out:
                out = Path(args.out)
                out.mkdir(parents=True, exist_ok=True)
                import torch

                dims = {k: v for k, v in DIMS.items() if k != "torch_dtype"}
                payload = dict(dims=dims, dtype=args.dtype, device=args.device,
                               torch=torch.__version__, h200_profile_s=H200, steps=args.steps,
                               warmup=args.warmup, world=dist.get_world_size(),
                               command="python scripts/bench_probe.py " + " ".join(sys.argv[1:]),
                               results=results)
                (out / "bench_probe.json").write_text(json.dumps(payload, indent=2))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def launch(args) -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    if args.nproc is None:
        import torch

        args.nproc = max(torch.cuda.device_count(), 1) if args.device == "cuda" else 2
    if args.nproc == 1:  # one rank runs in this process: a child would only add its start
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if "OMP_NUM_THREADS" not in os.environ:  # as a launched rank gets it
            import torch

            torch.set_num_threads(1)
        run_rank(args)
        return 0
    procs = []
    for rank in range(args.nproc):
        env = dict(os.environ)
        env.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.nproc),
            LOCAL_WORLD_SIZE=str(args.nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
        )
        procs.append(subprocess.Popen([sys.executable, __file__, *sys.argv[1:]], env=env))
    return max(p.wait() for p in procs)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", nargs="+", choices=("fsdp2", "fsdp1"),
                        default=["fsdp2", "fsdp1"])
    parser.add_argument("--steps", type=int, default=12, help="timed steps (at least 10)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=None,
                        help="ranks to launch (not under torchrun; cpu: 2, cuda: all GPUs)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: gloo; cuda: NCCL, one GPU per rank")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--size", choices=list(SIZES), default="small",
                        help="the report's Qwen2.5-shaped preset (default: small)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--out", default=None, help="folder for bench_probe.json")
    args = parser.parse_args(argv)
    if args.steps < 10:
        parser.error("--steps must be at least 10")
    import torch

    DIMS.clear()
    DIMS.update(SIZES[args.size], torch_dtype=getattr(torch, DTYPES[args.dtype]))
    DIMS.update({k: v for k, v in (("batch", args.batch), ("seq_len", args.seq_len)) if v})
    return args


def main() -> int:
    args = parse_args()
    if "RANK" in os.environ:
        run_rank(args)
        return 0
    return launch(args)


if __name__ == "__main__":  # gloo's exit-time abort: see [Note: the report leaves
    # without the interpreter's teardown] (fsdp_retain/report/_launch.py)
    from fsdp_retain.report._launch import leave

    leave(main())
