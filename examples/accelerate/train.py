"""Two losses, one forward, under `accelerate launch` with FSDP, DeepSpeed or DDP and
gradient accumulation.

Run on GPUs (set num_processes in the config to your GPU count):

    accelerate launch --config_file examples/accelerate/fsdp2.yaml examples/accelerate/train.py
    accelerate launch --config_file examples/accelerate/fsdp1.yaml examples/accelerate/train.py
    accelerate launch --config_file examples/accelerate/zero3.yaml examples/accelerate/train.py
    accelerate launch --config_file examples/accelerate/zero1.yaml examples/accelerate/train.py
    accelerate launch --config_file examples/accelerate/ddp.yaml examples/accelerate/train.py

Run on CPU (2 ranks, gloo), from a clone, through the launcher shim that lets
accelerate's own FSDP setup run on gloo (examples/accelerate_cpu_fsdp.py); DDP needs
no shim, only ACCELERATE_USE_CPU=1:

    accelerate launch --config_file examples/accelerate/fsdp2.yaml examples/accelerate_cpu_fsdp.py examples/accelerate/train.py
    ACCELERATE_USE_CPU=1 accelerate launch --config_file examples/accelerate/ddp.yaml examples/accelerate/train.py

Under DeepSpeed (zero3.yaml, zero1.yaml) the prepared model is the ``DeepSpeedEngine``,
and ``accelerator.backward`` steps the engine at the accumulation boundary, which must
not happen between two passes: ``retaining(accelerator, model)`` (fsdp_retain's
accelerate integration) is the block with accelerate's backward that does not step; the
engine steps once, after the block, at the boundary. ``optimizer.step()`` is a no-op
under DeepSpeed, and clipping is the DeepSpeed config's ``gradient_clipping``
(zero1_ds_config.json clips; ``accelerator.clip_grad_norm_`` clips nothing there).

A plain accelerate training loop that backpropagates two losses one after the
other over one forward (`accelerator.backward(loss, retain_graph=True)`, then
the second loss). What fsdp_retain adds is marked `# New code #`.

At the end the script replays the same global batches on an unwrapped copy of
the model in each process (a plain PyTorch loop: one summed loss divided by the
accumulation steps, one optimizer step per accumulation window) and exits with
status 1 unless the parameters agree. That checks the whole chain: the block,
`accelerator.backward` dividing each loss by `gradient_accumulation_steps`, and
`accelerator.accumulate` skipping the gradient sync on all but the last
micro-batch of a window.

Under DDP (ddp.yaml, or accelerate's fallback from an FSDP config with
`ACCELERATE_USE_CPU=1`) DDP itself all-reduces only the first backward over a
forward; the block all-reduces every pass (pytorch/pytorch#47260).

accelerate sets up FSDP and DeepSpeed only on accelerator backends (GPU, XPU, ...). Launched
any other way (no GPU, plain `python`) it silently falls back to independent processes,
each training its own copy of the model; `accelerate launch --cpu --num_processes 2`
starts one process only. This script stops with an error instead, naming the commands
that work.
"""

import argparse
import copy
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _deps import require  # noqa: E402  (checking, not the point)

require("accelerate", why="examples/accelerate/train.py", extra="examples")

from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_model_state_dict,
)
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

# New code #
from fsdp_retain.integrations.accelerate import retaining  # noqa: E402


class Block(nn.Module):  # the unit named by fsdp_transformer_layer_cls_to_wrap
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def task_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def aux_loss(out: torch.Tensor) -> torch.Tensor:
    return 0.1 * out.pow(2).mean()


COMMANDS = (
    "  On GPUs: accelerate launch --config_file examples/accelerate/fsdp2.yaml "
    "examples/accelerate/train.py\n"
    "  On CPU (a shim from this repository that lets accelerate's own FSDP setup run on "
    "gloo): accelerate launch --config_file examples/accelerate/fsdp2.yaml "
    "examples/accelerate_cpu_fsdp.py examples/accelerate/train.py\n"
    "  DDP on CPU (no shim): ACCELERATE_USE_CPU=1 accelerate launch --config_file "
    "examples/accelerate/ddp.yaml examples/accelerate/train.py"
)


def is_ddp(accelerator: Accelerator) -> bool:
    """accelerate wraps the model in DDP: MULTI_GPU, MULTI_CPU, ... with 2+ processes."""
    return (accelerator.distributed_type.value.startswith("MULTI_")
            and accelerator.num_processes > 1)


# New code #
def require_wrapped(accelerator: Accelerator) -> None:
    """Stops unless accelerate really set up FSDP, DeepSpeed or DDP over every launched
    process (see the module docstring)."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    wrapped = (accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
               or is_ddp(accelerator))
    if wrapped and accelerator.num_processes == launched:  # DeepSpeed on CPU: each rank alone
        return
    if os.environ.get("RANK", "0") != "0":
        time.sleep(5)  # rank 0 says why, once; the launcher then stops this rank
        sys.exit(1)
    if "WORLD_SIZE" not in os.environ:  # no distributed launcher started this process
        how = ("accelerate launch started 1 process: with --cpu (or use_cpu, or a config "
               "whose distributed_type is not FSDP, DEEPSPEED or MULTI_GPU) it runs the "
               "script once, whatever --num_processes says"
               if "ACCELERATE_MIXED_PRECISION" in os.environ  # set by every accelerate launch
               else "started as 1 process, not by accelerate launch")
        sys.exit(f"error: {how}; this example needs 2 or more FSDP, DeepSpeed or DDP "
                 f"processes.\n{COMMANDS}")
    sys.exit(
        f"error: accelerate set up {accelerator.distributed_type.value} with "
        f"{accelerator.num_processes} process(es) on {accelerator.device}, not FSDP, "
        "DeepSpeed or DDP over the launched processes. accelerate selects FSDP only on "
        "accelerator backends (and DeepSpeed without one leaves each rank a 1-process "
        "accelerator); without one it falls back to independent processes, each "
        "training its own copy, unless ACCELERATE_USE_CPU=1 (or use_cpu) gives it DDP."
        f"\n{COMMANDS}"
    )


def describe(accelerator: Accelerator, model: nn.Module) -> str:
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        stage = model.zero_optimization_stage()
        return f"DEEPSPEED (zero_stage {stage}), {accelerator.num_processes} processes " + (
            f"on {accelerator.device.type}, gradient_accumulation_steps "
            f"{model.gradient_accumulation_steps()}; model {type(model.module).__name__}"
        )
    if is_ddp(accelerator):
        return (f"DDP ({accelerator.distributed_type.value}), {accelerator.num_processes} "
                f"processes on {accelerator.device.type}, gradient_accumulation_steps "
                f"{accelerator.gradient_accumulation_steps}; model {type(model).__name__} "
                f"around {type(model.module).__name__}")
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    units = sum(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in model.modules())
    return (
        f"FSDP (fsdp_version {accelerator.state.fsdp_plugin.fsdp_version}), "
        f"{accelerator.num_processes} processes on {accelerator.device.type}, "
        f"gradient_accumulation_steps {accelerator.gradient_accumulation_steps}; "
        f"model {type(model).__name__} with {units} FSDP units"
    )


def full_parameters(accelerator: Accelerator, model) -> dict:
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        from deepspeed.utils import safe_get_full_fp32_param

        return {n: safe_get_full_fp32_param(p) for n, p in model.module.named_parameters()}
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def replay_unsharded(model: nn.Module, seen, lr: float, accumulation: int,
                     clip: float) -> nn.Module:
    """The same training on one process, unwrapped: the reference for the check."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for x, target, sync in seen:
        out = model(x)
        ((task_loss(out, target) + aux_loss(out)) / accumulation).backward()
        if sync:
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gradient-accumulation-steps", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="per process")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    # New code #
    require_wrapped(accelerator)

    torch.manual_seed(0)
    model = Net(args.dim, args.layers)
    reference = copy.deepcopy(model).to(accelerator.device)  # for the check at the end
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    data = torch.Generator().manual_seed(1)
    dataset = TensorDataset(
        torch.randn(args.samples, args.dim, generator=data),
        torch.randn(args.samples, args.dim, generator=data),
    )
    loader = DataLoader(dataset, batch_size=args.batch)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    accelerator.print(f"accelerate: {describe(accelerator, model)}")

    seen = []  # (global inputs, global targets, optimizer stepped) for the check
    for epoch in range(args.epochs):
        for x, target in loader:
            with accelerator.accumulate(model):
                # New code #
                with retaining(accelerator, model):
                    out = model(x)
                    task, aux = task_loss(out, target), aux_loss(out)
                    accelerator.backward(task, retain_graph=True)
                    accelerator.backward(aux)
                optimizer.step()
                optimizer.zero_grad()
            global_batch = accelerator.gather(x), accelerator.gather(target)
            seen.append((*global_batch, accelerator.sync_gradients))
        losses = accelerator.reduce(torch.stack([task.detach(), aux.detach()]), "mean")
        accelerator.print(f"epoch {epoch}: task loss {losses[0]:.4f}, aux loss {losses[1]:.4f}")

    deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
    clip = float(model.gradient_clipping()) if deepspeed else 0.0  # the config's, DeepSpeed's step
    replay_unsharded(reference, seen, args.lr, args.gradient_accumulation_steps, clip)
    trained = full_parameters(accelerator, model)
    expected = reference.state_dict()
    max_diff = max((trained[k].to(v.device) - v).abs().max().item() for k, v in expected.items())
    steps = sum(sync for _, _, sync in seen)
    clipped = f", clipped to {clip:g}" if clip > 0 else ""
    accelerator.print(
        f"max |param difference| vs unwrapped single-process replay after {steps} "
        f"optimizer steps{clipped}: {max_diff:.3g}"
    )
    ok = max_diff <= 1e-4
    accelerator.print("agreement: OK" if ok else "agreement: FAILED")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
