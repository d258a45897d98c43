"""SFT's loss and an entropy bonus over one forward, in TRL's `SFTTrainer`, under DDP or DeepSpeed.

Run (2 processes; CPU with gloo, or one GPU per process):

    torchrun --nproc_per_node 2 examples/trl_sft_aux.py --ddp                       # DDP
    torchrun --nproc_per_node 2 examples/trl_sft_aux.py --ddp --no-library          # wrong
    torchrun --nproc_per_node 2 examples/trl_sft_aux.py --deepspeed 2               # ZeRO-2
    torchrun --nproc_per_node 2 examples/trl_sft_aux.py --deepspeed 2 --no-library  # wrong
    torchrun --nproc_per_node 2 examples/trl_sft_aux.py --deepspeed 3               # ZeRO-3
    torchrun --nproc_per_node 2 examples/trl_sft_aux.py --deepspeed 3 --no-library  # fails
    torchrun --nproc_per_node 2 examples/trl_sft_aux.py --ddp --fp32                # no bf16

An `SFTTrainer` subclass whose `training_step` runs SFT's own `compute_loss` (one forward
through TRL's fused, chunked LM head: per-token log-probabilities and entropies, never the
full logits) and backpropagates two losses over that forward, one after the other: SFT's
loss (`self.accelerator.backward(sft, retain_graph=True)`), then an entropy bonus on the
completion tokens from the same head's differentiable `entropy` output (a forward hook
keeps the head's outputs, which `compute_loss` does not return). Everything else is TRL
1.16's defaults: `SFTConfig`'s gradient checkpointing (non-reentrant), bf16 and clipping
(1.0), its data collator (padding, `attention_mask`), its labels built from a
pre-tokenized prompt-completion dataset (`completion_mask`, `completion_only_loss=True`).
The optimizer is SGD with momentum at a constant rate, in place of AdamW, so that a
gradient wrong in scale shows. The model is a tiny Qwen2 and the tokenizer a word-level
one, both built in code (nothing is downloaded). With `--ddp` the Trainer wraps the model
in DDP (on a CPU-only machine with `use_cpu=True`, which also lets bf16 run there); with
`--deepspeed STAGE` its own `deepspeed=` argument sets up a ZeRO engine (bf16 weights, fp32
master weights). What fsdp_retain adds is marked `# New code #`: the Trainer integration
(`retaining_trainer(...)`) puts the block around every `training_step`, and under
DeepSpeed steps the engine after it. Guide: docs/integrations/transformers_trainer.md (TRL).

The two losses are divided as TRL and the Trainer divide them. SFT's loss comes from
`compute_loss` already divided by `num_items_in_batch` (the completion tokens of the whole
accumulation window, all ranks) and multiplied by the world size (DDP averages), so it is
not divided again. The bonus is a mean over this micro-batch's completion tokens, divided
by `self.current_gradient_accumulation_steps` as the Trainer's convention says.

At the end the script replays the same global micro-batches on an unwrapped copy in each
process, with the plain math in place of TRL's fused head (`log_softmax` of the full
logits, under bf16 autocast unless `--fp32`, the same labels, the same divisions), one
clipped SGD-momentum step per window. It prints `PARITY max_diff=...` (every parameter
against the replay) and `RANKS max_diff=...` (every rank's parameters against rank 0's),
and exits 1 unless the parameters agree within 3% of the largest update (1e-5 with
`--fp32`) and the ranks agree exactly.

On a CPU-only machine, DeepSpeed runs through `examples/accelerate_cpu_fsdp.py` (the
`cpu_state_as_accelerator(deepspeed=True)` call below); leave that out on GPUs. Without
the block, DDP all-reduces only the first backward over a forward (pytorch/pytorch#47260),
so each rank keeps its own entropy gradient; accelerate steps the DeepSpeed engine after
the first backward (ZeRO-3's second pass then finds its parameters released).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile

# TRL's trainers send a telemetry request from rank 0; this example downloads nothing.
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from _deps import require  # noqa: E402  (checking, not the point)

require("trl", "transformers", "accelerate", "datasets", why="examples/trl_sft_aux.py",
        pip="trl==1.16.0")

from accelerate.utils import DistributedType  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

# New code #
from fsdp_retain.integrations.transformers import retaining_trainer  # noqa: E402

VOCAB, MAX_LEN = 64, 16
PAD, EOS = 0, 1


class EntropyBonusSFTTrainer(SFTTrainer):
    """SFT's loss and an entropy bonus over one forward, one backward pass each."""

    entropy_coef = 0.5

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # SFT's compute_loss keeps the fused head's outputs to itself: keep them here.
        self.model.register_forward_hook(self._keep_outputs)
        self.fused_outputs = None
        self.seen: list[dict] = []  # for the check at the end

    def _keep_outputs(self, module, args, output) -> None:
        self.fused_outputs = output

    def training_step(self, model, inputs, num_items_in_batch=None):
        # As SFTTrainer.training_step: in its activation-offloading context (off by default).
        with self.maybe_activation_offload_context:
            model.train()
            inputs = self._prepare_inputs(inputs)
            with self.compute_loss_context_manager():
                # Divided by num_items_in_batch: scaled for accumulation already.
                sft = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
            out = self.fused_outputs  # entropy: zero off the completion tokens
            entropy = out.entropy.sum() / out.label_mask.sum().clamp(min=1)
            aux = -self.entropy_coef * entropy / self.current_gradient_accumulation_steps
            # As Trainer.training_step: under DeepSpeed the engine must not divide again.
            kwargs = ({"scale_wrt_gas": False}
                      if self.accelerator.distributed_type == DistributedType.DEEPSPEED else {})
            self.accelerator.backward(sft, retain_graph=True, **kwargs)
            self.accelerator.backward(aux, **kwargs)
        loss = (sft + aux).detach()
        self.seen.append(record(self.accelerator, inputs, loss))
        return loss


# New code #
RetainingEntropyBonusSFTTrainer = retaining_trainer(EntropyBonusSFTTrainer)


def record(accelerator, inputs: dict, loss: torch.Tensor) -> dict:
    """This micro-batch of every rank (padded to one length), for the replay."""
    def every_rank(x: torch.Tensor, pad: int) -> torch.Tensor:
        return accelerator.gather(accelerator.pad_across_processes(x, dim=1, pad_index=pad)).cpu()

    return {"input_ids": every_rank(inputs["input_ids"], PAD),
            "attention_mask": every_rank(inputs["attention_mask"], 0),
            "labels": every_rank(inputs["labels"], -100),
            "loss": accelerator.reduce(loss, "mean").item()}


def word_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": PAD, "<eos>": EOS, **{f"w{i}": i for i in range(2, VOCAB)}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, "w2")),
                                   pad_token="<pad>", eos_token="<eos>")


def prompt_completion(n: int) -> Dataset:
    """Pre-tokenized prompt-completion rows of different lengths, each ending in EOS."""
    g = torch.Generator().manual_seed(1)
    rows = {"input_ids": [], "completion_mask": []}
    for _ in range(n):
        prompt, completion = (int(torch.randint(lo, hi, (), generator=g)) for lo, hi in
                              ((3, 7), (4, 10)))
        ids = torch.randint(2, VOCAB, (prompt + completion - 1,), generator=g).tolist() + [EOS]
        rows["input_ids"].append(ids)
        rows["completion_mask"].append([0] * prompt + [1] * completion)
    return Dataset.from_dict(rows)


def tiny_qwen2() -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_LEN,
        tie_word_embeddings=False, attn_implementation="eager", pad_token_id=PAD,
        eos_token_id=EOS,
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


def full_parameters(trainer, wrapped) -> dict[str, torch.Tensor]:
    """Every parameter, whole, by name (a ZeRO engine's fp32 master copy)."""
    if trainer.is_deepspeed_enabled:
        from deepspeed.utils import safe_get_full_fp32_param

        return {n: safe_get_full_fp32_param(p).detach()
                for n, p in wrapped.module.named_parameters()}
    return {n: p.detach() for n, p in trainer.accelerator.unwrap_model(wrapped).named_parameters()}


def replay(model, seen: list[dict], lr: float, accumulation: int, world: int,
           coef: float, max_grad_norm: float, bf16: bool) -> tuple[list[float], list[float]]:
    """The same training in one process, unwrapped, the plain math of TRL's fused head:
    SFT's loss is the completion tokens' negative log-likelihood summed over the window's
    micro-batches and ranks and divided by their count (what `num_items_in_batch` is);
    the bonus is each rank's mean entropy over its completion tokens, averaged over ranks
    (as DDP and ZeRO average gradients) and divided by the accumulation steps; clipped as
    the Trainer clips. Returns each micro-batch's loss (the ranks' mean of what
    training_step returned) and each step's gradient norm before clipping."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses, norms = [], []
    for start in range(0, len(seen), accumulation):
        window = seen[start:start + accumulation]
        tokens = sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in window)
        for mb in window:
            with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
                logits = model(input_ids=mb["input_ids"],
                               attention_mask=mb["attention_mask"]).logits.float()
            logp = F.log_softmax(logits[:, :-1], dim=-1)
            labels = mb["labels"][:, 1:]
            mask = labels != -100
            nll = -logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)[mask].sum()
            entropy = -(logp.exp() * logp).sum(-1) * mask
            per_rank = [e.sum() / m.sum() for e, m in zip(entropy.chunk(world), mask.chunk(world))]
            bonus = -coef * torch.stack(per_rank).mean() / len(window)
            loss = nll / tokens + bonus
            loss.backward()
            losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm).item())
        optimizer.step()
        optimizer.zero_grad()
    return losses, norms


def describe(trainer, model) -> str:
    """What ran: the wrapper, TRL's defaults as the model got them, the fused head's output."""
    acc, args = trainer.accelerator, trainer.args
    kind = (f"DeepSpeed ZeRO-{model.zero_optimization_stage()}" if trainer.is_deepspeed_enabled
            else "DDP" if isinstance(model, torch.nn.parallel.DistributedDataParallel)
            else acc.distributed_type.value)
    checkpointed = [m for m in trainer.model.modules() if getattr(m, "gradient_checkpointing", False)]
    func = getattr(checkpointed[0], "_gradient_checkpointing_func", None) if checkpointed else None
    reentrant = getattr(func, "keywords", {}).get("use_reentrant")
    return (f"{type(trainer).__name__}: {kind}, {acc.num_processes} processes on "
            f"{acc.device.type}, bf16 {args.bf16}, gradient checkpointing on "
            f"{len(checkpointed)} modules (use_reentrant={reentrant}), outputs "
            f"{type(trainer.fused_outputs).__name__}, gradient_accumulation_steps "
            f"{args.gradient_accumulation_steps}; model {type(model).__name__}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ddp", action="store_true",
                        help="the Trainer wraps the model in DDP (use_cpu=True on a CPU-only machine)")
    parser.add_argument("--deepspeed", type=int, choices=(2, 3), default=None, metavar="STAGE",
                        help="the Trainer's deepspeed= config, ZeRO STAGE (2 or 3)")
    parser.add_argument("--no-library", action="store_true",
                        help="the same step without the block")
    parser.add_argument("--gradient-accumulation-steps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=4, help="per process")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--fp32", action="store_true",
                        help="bf16=False in place of SFTConfig's default: the replay agrees to 1e-5")
    args = parser.parse_args()
    if args.ddp == (args.deepspeed is not None):
        parser.error("give one of --ddp and --deepspeed STAGE")

    on_cpu = {}
    if not torch.cuda.is_available():
        on_cpu = {"use_cpu": True}  # also what lets SFTConfig's bf16 default run on a CPU
        if args.deepspeed is not None:  # accelerate's DeepSpeed setup on gloo, kept by the Trainer
            from accelerate_cpu_fsdp import cpu_state_as_accelerator

            cpu_state_as_accelerator(deepspeed=True)
            on_cpu["accelerator_config"] = {"use_configured_state": True}
    wrapper = deepspeed_arguments(args.deepspeed) if args.deepspeed is not None else {}
    model = tiny_qwen2()
    reference = copy.deepcopy(model)  # for the check at the end
    initial = copy.deepcopy(model.state_dict())
    accumulation = args.gradient_accumulation_steps
    world = int(os.environ.get("WORLD_SIZE", "1"))
    with tempfile.TemporaryDirectory() as output_dir:
        # TRL's defaults (gradient checkpointing, bf16, clipping at 1.0, its collator and
        # loss); SGD with momentum at a constant rate in place of AdamW at 2e-5, so that
        # the check sees a gradient wrong in scale.
        config = SFTConfig(
            output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch,
            gradient_accumulation_steps=accumulation, learning_rate=args.lr,
            lr_scheduler_type="constant", optim="sgd", optim_args="momentum=0.9",
            completion_only_loss=True, bf16=not args.fp32, report_to="none",
            save_strategy="no", logging_strategy="no", disable_tqdm=True,
            dataloader_pin_memory=False, seed=42, **wrapper, **on_cpu,
        )
        # New code #
        trainer_class = (EntropyBonusSFTTrainer if args.no_library
                         else RetainingEntropyBonusSFTTrainer)
        trainer = trainer_class(
            model=model, args=config, processing_class=word_tokenizer(),
            train_dataset=prompt_completion(args.steps * accumulation * args.batch * world))
        trainer.train()
    wrapped = trainer.model_wrapped
    trainer.accelerator.print(describe(trainer, wrapped))

    reference_losses, norms = replay(reference, trainer.seen, args.lr, accumulation, world,
                              trainer.entropy_coef, config.max_grad_norm, bf16=config.bf16)
    losses = [mb["loss"] for mb in trainer.seen]
    for step in range(args.steps):
        window = slice(step * accumulation, (step + 1) * accumulation)
        trainer.accelerator.print(
            f"step {step + 1}: loss {sum(losses[window]):.6f}, unwrapped replay "
            f"{sum(reference_losses[window]):.6f} (its gradient norm {norms[step]:.3g}, "
            f"clipped to {config.max_grad_norm})")
    trained = full_parameters(trainer, wrapped)
    expected = reference.state_dict()
    max_diff = max((trained[k].float().cpu() - v).abs().max().item() for k, v in expected.items())
    update = max((v - initial[k]).abs().max().item() for k, v in expected.items())
    loss_diff = max(abs(a - b) for a, b in zip(losses, reference_losses))
    trainer.accelerator.print(
        f"PARITY max_diff={max_diff:.3g} (every parameter after {args.steps} optimizer steps "
        f"against an unwrapped one-process replay, largest update {update:.3g}; losses: "
        f"{loss_diff:.3g})")
    # Every rank applies the same reduced gradient, so the ranks' parameters are equal,
    # bit for bit; a pass DDP did not all-reduce leaves each rank its own gradient.
    flat = torch.cat([trained[k].float().flatten().cpu() for k in expected])
    every = trainer.accelerator.gather(flat.to(trainer.accelerator.device).unsqueeze(0)).cpu()
    ranks_diff = (every - every[0]).abs().max().item()
    trainer.accelerator.print(f"RANKS max_diff={ranks_diff:.3g} (every rank's parameters "
                              "against rank 0's)")
    # bf16 (TRL's default) rounds the training and the replay differently: TRL's head
    # multiplies in bf16 tiles and accumulates in fp32, the replay's log_softmax runs on
    # bf16 logits, and DeepSpeed keeps bf16 weights beside its fp32 master copy. 3% of the
    # largest update bounds that rounding (the tolerance hf_trainer.py gives bf16). An
    # engine step between the passes is far outside it; the entropy pass that plain DDP
    # leaves unreduced is not (it shows in the ranks, and with --fp32 in the replay too).
    if config.bf16:
        ok = max_diff <= 0.03 * update and loss_diff <= 0.05
    else:  # fp32: the fused head and log_softmax differ in summation order only
        ok = max_diff <= 1e-5 and loss_diff <= 1e-5
    ok = ok and ranks_diff == 0
    trainer.accelerator.print("agreement: OK" if ok else "agreement: FAILED")
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
