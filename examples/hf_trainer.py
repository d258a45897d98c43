"""Two losses, one forward, in a `transformers.Trainer` under FSDP2, FSDP1, DDP or DeepSpeed.

Run (2 processes; CPU with gloo, or one GPU per process):

    torchrun --nproc_per_node 2 examples/hf_trainer.py                  # FSDP2
    torchrun --nproc_per_node 2 examples/hf_trainer.py --fsdp 1         # FSDP1
    torchrun --nproc_per_node 2 examples/hf_trainer.py --fsdp 1 --no-library   # fails
    torchrun --nproc_per_node 2 examples/hf_trainer.py --ddp            # DDP
    torchrun --nproc_per_node 2 examples/hf_trainer.py --ddp --no-library      # wrong
    torchrun --nproc_per_node 2 examples/hf_trainer.py --deepspeed 2    # ZeRO-2 (0-3)
    torchrun --nproc_per_node 2 examples/hf_trainer.py --deepspeed 2 --no-library  # fails

A `Trainer` subclass whose `training_step` runs one forward of a tiny Qwen2 (built in
code, no download) and backpropagates two losses, the language-model loss and a z-loss
on the logits, one after the other (`self.accelerator.backward(loss, retain_graph=True)`,
then the second). FSDP comes from the Trainer's own arguments
(`TrainingArguments(fsdp=..., fsdp_config={"version": 2, ...})`, accelerate's FSDP
plugin); with `--ddp` there are none and the Trainer wraps the model in DDP itself
(on a CPU-only machine with `use_cpu=True`); with `--deepspeed STAGE` the Trainer's own
`deepspeed=` argument sets up a ZeRO engine. What fsdp_retain adds is marked
`# New code #`: the Trainer integration (`RetainTrainerMixin`) puts the block around
every `training_step`, and under DeepSpeed steps the engine after it. Guide:
docs/integrations/hf_trainer.md.

Gradient accumulation: the Trainer tells accelerate to accumulate 1 step and divides the
loss by `self.current_gradient_accumulation_steps` in its own `training_step`; an
override must divide each loss itself.

At the end the script replays the same global batches on an unwrapped copy of the model
in each process (a plain PyTorch loop: one summed loss divided by the accumulation
steps, one SGD-momentum step per window, clipped as `--max-grad-norm` tells the Trainer,
under bf16 autocast with `--bf16`), prints `PARITY max_diff=...` and exits 1 unless every
parameter agrees (within 3% of the largest update under bf16, whose rounding the fp32
replay does not share; `--one-backward`, the two losses summed in one pass, shows that
rounding alone).

On a CPU-only machine accelerate never selects FSDP: the Trainer falls back to
independent processes (or to DDP with `use_cpu=True`). For FSDP this script then lets
accelerate's own FSDP setup run on gloo through `examples/accelerate_cpu_fsdp.py` (the
`cpu_state_as_accelerator()` call below); leave that out on GPUs. Under DDP, DDP itself
all-reduces only the first backward over a forward (pytorch/pytorch#47260): with
`--no-library` the parameters end away from the replay; the block all-reduces every pass.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile

import torch
import torch.nn.functional as F

from _deps import require  # checking, not the point

require("transformers", "accelerate", extra="examples", why="examples/hf_trainer.py")

from accelerate.utils import DistributedType  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_model_state_dict,
)
from transformers import Qwen2Config, Qwen2ForCausalLM, Trainer, TrainingArguments  # noqa: E402

# New code #
from fsdp_retain.integrations.transformers import RetainTrainerMixin  # noqa: E402

VOCAB, SEQ = 64, 16


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """PaLM's auxiliary loss: keeps the softmax normalizer near 1."""
    return 1e-2 * torch.logsumexp(logits, dim=-1).pow(2).mean()


class TwoLossTrainer(Trainer):
    one_backward = False  # --one-backward

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[torch.Tensor, float, bool]] = []  # for the check at the end

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        inputs = self._prepare_inputs(inputs)
        # The Trainer's own training_step divides by this; an override must too.
        steps = self.current_gradient_accumulation_steps
        logits = model(input_ids=inputs["input_ids"]).logits
        task, aux = lm_loss(logits, inputs["labels"]), z_loss(logits)
        if self.one_backward:  # the baseline: one backward of the sum
            self.accelerator.backward((task + aux) / steps)
        else:
            self.accelerator.backward(task / steps, retain_graph=True)
            self.accelerator.backward(aux / steps)
        loss = (task + aux).detach()
        self.seen.append((self.accelerator.gather(inputs["input_ids"]),
                          self.accelerator.reduce(loss, "mean").item(),
                          self.accelerator.sync_gradients))
        return loss / steps


# New code #
class RetainingTwoLossTrainer(RetainTrainerMixin, TwoLossTrainer):
    """The same training_step, in one block (the integration wraps it)."""


class Sequences(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.ids = torch.randint(VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_qwen2() -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        tie_word_embeddings=False, attn_implementation="eager",
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def deepspeed_arguments(stage: int) -> dict:
    """The Trainer's `deepspeed=` config: ZeRO `stage`, the Trainer's SGD ("auto" takes
    batch size, accumulation, clipping and bf16 from the training arguments)."""
    return {"deepspeed": {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
    }}


def full_parameters(trainer: Trainer, wrapped) -> dict[str, torch.Tensor]:
    """Every parameter, whole, by name (a ZeRO-3 engine's gathered from its partitions)."""
    if trainer.is_deepspeed_enabled:
        from deepspeed.utils import safe_get_full_fp32_param

        stage = wrapped.zero_optimization_stage()
        return {n: (safe_get_full_fp32_param(p) if stage else p).detach()
                for n, p in wrapped.module.named_parameters()}
    return get_model_state_dict(wrapped, options=StateDictOptions(full_state_dict=True))


def fsdp_arguments(version: int) -> dict:
    config = {"version": version, "transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"]}
    if version == 1:
        config |= {"use_orig_params": True, "sync_module_states": False}
    return {"fsdp": True, "fsdp_config": config}


def replay_unsharded(model, seen, lr: float, accumulation: int, max_grad_norm: float,
                     bf16: bool) -> list[float]:
    """The same training in one process, unwrapped, the reference for the check: the
    global micro-batches, one SGD-momentum step per window (clipped and under bf16
    autocast as the Trainer was told). Returns their losses."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for ids, _, sync in seen:
        with torch.autocast(ids.device.type, torch.bfloat16, enabled=bf16):
            logits = model(input_ids=ids).logits.float()  # as accelerate returns them
        loss = lm_loss(logits, ids) + z_loss(logits)
        (loss / accumulation).backward()
        losses.append(loss.item())
        if sync:
            if max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            optimizer.zero_grad()
    return losses


def describe(trainer: Trainer, model) -> str:
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    acc = trainer.accelerator
    units = sum(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in model.modules())
    kind = acc.distributed_type.value
    if acc.distributed_type == DistributedType.FSDP:
        kind += f" (fsdp_version {acc.state.fsdp_plugin.fsdp_version})"
    if trainer.is_deepspeed_enabled:
        return (f"Trainer: DeepSpeed ZeRO-{model.zero_optimization_stage()} ({kind}), "
                f"{acc.num_processes} processes on {acc.device.type}, "
                f"gradient_accumulation_steps {trainer.args.gradient_accumulation_steps}; "
                f"model {type(model).__name__}")
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return (f"Trainer: DDP ({kind}), {acc.num_processes} processes on {acc.device.type}, "
                f"gradient_accumulation_steps {trainer.args.gradient_accumulation_steps}; "
                f"model {type(model).__name__} around {type(model.module).__name__}")
    return (f"Trainer: {kind}, {acc.num_processes} processes on {acc.device.type}, "
            f"gradient_accumulation_steps {trainer.args.gradient_accumulation_steps}; "
            f"model {type(model).__name__} with {units} FSDP modules")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fsdp", type=int, choices=(1, 2), default=2)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=4, help="per process")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--no-library", action="store_true",
                        help="the same step without the block")
    parser.add_argument("--ddp", action="store_true",
                        help="no fsdp arguments: the Trainer wraps the model in DDP "
                             "(use_cpu=True on a CPU-only machine)")
    parser.add_argument("--deepspeed", type=int, choices=(0, 1, 2, 3), default=None,
                        metavar="STAGE", help="the Trainer's deepspeed= config, ZeRO STAGE")
    parser.add_argument("--max-grad-norm", type=float, default=0.0,
                        help="the Trainer's gradient clipping (0: none)")
    parser.add_argument("--bf16", action="store_true", help="the Trainer's bf16 mixed precision")
    parser.add_argument("--one-backward", action="store_true",
                        help="the baseline: the two losses summed, one backward")
    args = parser.parse_args()

    wrapper = ({} if args.ddp else deepspeed_arguments(args.deepspeed)
               if args.deepspeed is not None else fsdp_arguments(args.fsdp))
    on_cpu = {}
    if not torch.cuda.is_available():
        if args.ddp:
            on_cpu = {"use_cpu": True}
        else:  # CPU only: accelerate's FSDP (DeepSpeed) setup on gloo, kept by the Trainer
            from accelerate_cpu_fsdp import cpu_state_as_accelerator

            cpu_state_as_accelerator(deepspeed=args.deepspeed is not None)
            on_cpu = {"accelerator_config": {"use_configured_state": True}}
            if args.bf16:  # the Trainer's check for bf16 on a CPU-only machine
                on_cpu["use_cpu"] = True
    model = tiny_qwen2()
    reference = copy.deepcopy(model)  # for the check at the end
    initial = copy.deepcopy(model.state_dict())
    accumulation = args.gradient_accumulation_steps
    samples = args.steps * accumulation * args.batch * int(os.environ.get("WORLD_SIZE", "1"))
    with tempfile.TemporaryDirectory() as output_dir:
        training = TrainingArguments(
            output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch,
            gradient_accumulation_steps=accumulation, learning_rate=args.lr,
            lr_scheduler_type="constant", optim="sgd", optim_args="momentum=0.9",
            max_grad_norm=args.max_grad_norm, bf16=args.bf16, report_to="none",
            save_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_pin_memory=False, seed=42,
            **wrapper, **on_cpu,
        )
        # New code #
        trainer_class = TwoLossTrainer if args.no_library else RetainingTwoLossTrainer
        trainer = trainer_class(model=model, args=training, train_dataset=Sequences(samples))
        trainer.one_backward = args.one_backward
        trainer.train()
    wrapped = trainer.model_wrapped
    trainer.accelerator.print(describe(trainer, wrapped))

    reference.to(training.device)
    reference_losses = replay_unsharded(reference, trainer.seen, args.lr, accumulation,
                                        args.max_grad_norm, args.bf16)
    losses = [loss for _, loss, _ in trainer.seen]
    for step in range(args.steps):
        window = slice(step * accumulation, (step + 1) * accumulation)
        trainer.accelerator.print(
            f"step {step + 1}: loss {sum(losses[window]) / accumulation:.6f}, unsharded "
            f"replay {sum(reference_losses[window]) / accumulation:.6f}")
    trained = full_parameters(trainer, wrapped)
    expected = reference.state_dict()
    max_diff = max((trained[k].to(v.device) - v).abs().max().item() for k, v in expected.items())
    update = max((v - initial[k].to(v.device)).abs().max().item() for k, v in expected.items())
    loss_diff = max(abs(a - b) for a, b in zip(losses, reference_losses))
    trainer.accelerator.print(
        f"PARITY max_diff={max_diff:.3g} (every parameter after {args.steps} optimizer steps "
        f"against an unwrapped one-process replay, largest update {update:.3g}; losses: "
        f"{loss_diff:.3g})")
    if args.bf16:  # bf16 rounding against an fp32 replay; a pass missed is ~10x this
        ok = max_diff <= 0.03 * update and loss_diff <= 0.05
    else:
        ok = max_diff <= 1e-5 and loss_diff <= 1e-5
    trainer.accelerator.print("agreement: OK" if ok else "agreement: FAILED")
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
