#!/usr/bin/env python
"""Step time with ``check_saved_tensors=True`` against without, side by side.

    python scripts/bench_saved_tensor_check.py                 # FSDP2, 2 CPU ranks (gloo)
    python scripts/bench_saved_tensor_check.py --fsdp 1        # FSDP1
    torchrun --nproc_per_node 8 scripts/bench_saved_tensor_check.py --device cuda --size 1.5b

The model is the report's Qwen2-shaped causal LM (``transformers`` ``Qwen2Config``,
random weights; preset ``small``: 4 layers, hidden 256, vocab 8192, 7.0M params,
batch 4 x 128 tokens per rank), one FSDP unit per decoder layer plus the root.
One step: one forward inside ``no_reshard_between_backwards(model, backwards=2)``,
the token log-prob loss backward, ``zero_grad``, the policy loss backward, an SGD
step. Two identical models train in alternating order, one with the check and one
without; after ``--warmup`` steps each, ``--steps`` steps each are timed (medians;
a barrier before every step). Prints a table and the ratio; ``--out`` writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fsdp_retain.report._config import DTYPES, SIZES  # noqa: E402 - the report's presets


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fsdp", type=int, choices=(1, 2), default=2)
    parser.add_argument("--size", choices=list(SIZES), default="small")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                        help="parameter (and gradient) dtype")
    parser.add_argument("--batch", type=int, default=None, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--nproc", type=int, default=2, help="ranks to launch (ignored under torchrun)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12, help="timed steps per variant (>= 10)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.steps < 10:
        parser.error("--steps must be at least 10 (medians over fewer steps are noise)")
    return args


def dims_of(args) -> dict:
    dims = dict(SIZES[args.size])
    dims.update({k: v for k, v in (("batch", args.batch), ("seq_len", args.seq_len)) if v})
    return dims


def build(args, device):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    dims = dims_of(args)
    config = Qwen2Config(
        vocab_size=dims["vocab"], hidden_size=dims["hidden"],
        intermediate_size=dims["intermediate"], num_hidden_layers=dims["layers"],
        num_attention_heads=dims["heads"], num_key_value_heads=dims["kv_heads"],
        max_position_embeddings=max(32768, dims["seq_len"]),
        tie_word_embeddings=dims["tie"], use_cache=False,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(getattr(torch, DTYPES[args.dtype]))
    layers = model.model.layers
    if args.fsdp == 2:
        from torch.distributed.fsdp import fully_shard

        for layer in layers:
            fully_shard(layer)
        return fully_shard(model)
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FullyShardedDataParallel(
        model, auto_wrap_policy=ModuleWrapPolicy({type(layers[0])}), device_id=device
    )


def token_logprobs(model, ids):
    import torch

    logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
    picked = logits.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return picked.float() - torch.logsumexp(logits, dim=-1).float()


def step(model, optimizer, ids, advantages, check: bool) -> None:
    from fsdp_retain import no_reshard_between_backwards

    with no_reshard_between_backwards(model, backwards=2, check_saved_tensors=check):
        logp = token_logprobs(model, ids)
        (-logp.mean()).backward(retain_graph=True)
        optimizer.zero_grad()
        (-(advantages[:, None] * logp).mean()).backward()
    optimizer.step()
    optimizer.zero_grad()


def saved_per_forward(model, ids) -> tuple[int, int]:
    """Tensors (and bytes) the forward saves for backward outside checkpointed regions."""
    import torch

    seen = []

    def pack(t):
        seen.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp = token_logprobs(model, ids)
    del logp
    return len(seen), sum(seen)


def run_rank(args) -> dict | None:
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
        backend = "nccl"
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=600))
    dims = dims_of(args)
    gen = torch.Generator().manual_seed(1 + rank)
    ids = torch.randint(0, dims["vocab"], (dims["batch"], dims["seq_len"]), generator=gen).to(device)
    advantages = torch.randn(dims["batch"], generator=gen).to(device)
    models = {check: build(args, device) for check in (False, True)}
    optimizers = {c: torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9) for c, m in models.items()}
    times: dict[bool, list[float]] = {False: [], True: []}

    def sync() -> None:
        if args.device == "cuda":
            torch.cuda.synchronize()
        dist.barrier()

    for i in range(args.warmup + args.steps):
        order = (False, True) if i % 2 == 0 else (True, False)
        for check in order:
            sync()
            start = time.perf_counter()
            step(models[check], optimizers[check], ids, advantages, check)
            sync()
            if i >= args.warmup:
                times[check].append(time.perf_counter() - start)
    diff = max(
        (a.detach() - b.detach()).abs().max().item()
        for a, b in zip(models[False].parameters(), models[True].parameters())
    )
    count, nbytes = saved_per_forward(models[False], ids)  # last: leaves it unsharded
    dist.destroy_process_group()
    if rank != 0:
        return None
    without, with_check = (statistics.median(times[c]) * 1e3 for c in (False, True))
    return dict(
        command="python scripts/bench_saved_tensor_check.py " + " ".join(sys.argv[1:]),
        fsdp=args.fsdp, size=args.size, dtype=args.dtype, device=args.device,
        batch=dims["batch"], seq_len=dims["seq_len"],
        world_size=int(os.environ["WORLD_SIZE"]), torch=torch.__version__,
        warmup=args.warmup, steps=args.steps,
        median_ms_without=round(without, 2), median_ms_with=round(with_check, 2),
        ratio=round(with_check / without, 3),
        saved_tensors_per_forward=count, saved_mib_per_forward=round(nbytes / 2**20, 1),
        max_param_difference=diff,
    )


def report(result: dict) -> None:
    print(
        f"FSDP{result['fsdp']}, {result['world_size']} ranks, {result['device']}, "
        f"size {result['size']}, {result['dtype']}, batch {result['batch']} x "
        f"{result['seq_len']}, torch {result['torch']}; {result['steps']} timed steps "
        f"each after {result['warmup']} warm-up; {result['saved_tensors_per_forward']} saved "
        f"tensors ({result['saved_mib_per_forward']} MiB) per forward"
    )
    print("median step ms   without check   with check")
    print(f"                 {result['median_ms_without']:13.1f}   {result['median_ms_with']:10.1f}")
    print(f"step time with the check: {result['ratio']:.2f}x")
    print(f"max |param difference| between the two models: {result['max_param_difference']:.3g}")


def _spawned(rank: int, world: int, port: int, args) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    _rank_main(args)
    if world > 1:  # a spawned child: it would exit through the interpreter's teardown
        from fsdp_retain.report._launch import leave

        leave(0)


def _rank_main(args) -> None:
    result = run_rank(args)
    if result is not None:
        report(result)
        if args.out is not None:
            args.out.write_text(json.dumps(result, indent=2) + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ:  # under torchrun
        _rank_main(args)
        return 0
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    if args.nproc == 1:  # one rank runs in this process: a child would only add its start
        _spawned(0, 1, port, args)
        return 0
    mp.spawn(_spawned, args=(args.nproc, port, args), nprocs=args.nproc)
    return 0


if __name__ == "__main__":  # gloo's exit-time abort: see [Note: the report leaves
    # without the interpreter's teardown] (fsdp_retain/report/_launch.py)
    from fsdp_retain.report._launch import leave

    leave(main())
