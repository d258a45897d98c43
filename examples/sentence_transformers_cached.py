"""sentence-transformers' cached (GradCache) loss in a `SentenceTransformerTrainer` under FSDP, DDP or DeepSpeed.

Run (2 processes; CPU with gloo, or one GPU per process):

    torchrun --nproc_per_node 2 examples/sentence_transformers_cached.py               # FSDP2
    torchrun --nproc_per_node 2 examples/sentence_transformers_cached.py --fsdp 1      # FSDP1
    torchrun --nproc_per_node 2 examples/sentence_transformers_cached.py --no-library  # plain FSDP
    torchrun --nproc_per_node 2 examples/sentence_transformers_cached.py --ddp         # DDP
    torchrun --nproc_per_node 2 examples/sentence_transformers_cached.py --deepspeed 2 # ZeRO-2

`CachedMultipleNegativesRankingLoss` embeds every mini-batch under `no_grad`, computes the
loss on the detached embeddings, caches their gradients, and returns a loss whose hook,
when the Trainer's one `loss.backward()` reaches it, replays each mini-batch: a forward
with grad and `backward(cached gradient)`, a backward pass inside a backward pass. Plain
FSDP gathers every unit for every one of those forwards and backward passes; plain
DeepSpeed ZeRO-2 fails on the replays ("Gradient computed twice for this partition",
sentence-transformers#3173). With fsdp-retain's Trainer integration (the `# New code #`
below: `RetainTrainerMixin` puts each `training_step` inside `no_reshard_between_backwards`,
and under DeepSpeed steps the engine after it) each FSDP unit is gathered once per step,
and ZeRO-1/2/3 and DDP reduce once per replayed mini-batch (`sync_grads="every"`) or once
per step (`"last"`). FSDP comes from the Trainer's own arguments (accelerate's FSDP
plugin), DeepSpeed from its `deepspeed=` config, as in examples/hf_trainer.py. Guide:
docs/integrations/transformers_trainer.md.

A tiny BERT (2 layers, hidden size 32, float64, no dropout) and its WordPiece vocabulary
are written to a temporary folder and loaded as a SentenceTransformer (Transformer + mean
Pooling): nothing is downloaded. The data are random (anchor, positive) word sequences.

At the end the script replays the same global batches on an unsharded copy of the model
in each process with the plain `MultipleNegativesRankingLoss` (no caching: one forward
and one backward per rank's batch, the ranks' losses averaged, one SGD-momentum step per
batch), prints `PARITY max_diff=...` and the all-gathers per training step, and exits 1
unless every parameter agrees.

On a CPU-only machine accelerate never selects FSDP; the script then lets accelerate's
own FSDP set-up run on gloo through examples/accelerate_cpu_fsdp.py, as
examples/hf_trainer.py does. Leave that out on GPUs (the script does so when CUDA is there).
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import random
import sys
import tempfile

import torch
import torch.distributed as dist

from _deps import require  # checking, not the point

require("sentence_transformers", "datasets", "transformers", "accelerate", extra="st",
        why="examples/sentence_transformers_cached.py")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is built here; nothing to fetch

import transformers  # noqa: E402
from datasets import Dataset  # noqa: E402
from sentence_transformers import (  # noqa: E402
    SentenceTransformer,
    SentenceTransformerTrainer,
    SentenceTransformerTrainingArguments,
)
from sentence_transformers.sentence_transformer import losses, modules  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_model_state_dict,
)
from transformers import BertConfig, BertModel, BertTokenizerFast  # noqa: E402

from fsdp_retain._measure import count_collectives  # noqa: E402

# New code #
from fsdp_retain.integrations.transformers import RetainTrainerMixin  # noqa: E402

WORDS = [f"w{i}" for i in range(59)]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
HIDDEN = 32


class CachedLossTrainer(SentenceTransformerTrainer):
    """Records what the check at the end needs; the training itself is the Trainer's."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[list[list[dict[str, torch.Tensor]]]] = []  # per step, per rank
        self.losses: list[float] = []
        self.counts: list[dict[str, int]] = []  # collectives per step
        self._counting = None
        # Counting around the whole step, the block's entry and exit included.
        self.training_step = functools.partial(self._counted_step, self.training_step)

    def compute_loss(self, *args, **kwargs):  # counting only, not the point
        loss = super().compute_loss(*args, **kwargs)  # the mini-batches' no-grad forwards
        if self._counting is not None:
            self._counting.mark("backward")  # from here: the Trainer's backward, the replays
        return loss

    def _counted_step(self, step, model, inputs, num_items_in_batch=None):
        features, _ = self.collect_features(dict(inputs))
        with count_collectives(modules=False) as counts:
            counts.mark("forward")
            self._counting = counts
            loss = step(model, inputs, num_items_in_batch)
        self._counting = None
        self.counts.append({
            "all_gather": counts.all_gather, "reduce_scatter": counts.reduce_scatter,
            "all_reduce": counts.all_reduce,
            "forward_all_gather": sum(counts.groups("all_gather", "forward").values()),
            "backward_all_gather": sum(counts.groups("all_gather", "backward").values()),
        })
        gathered = [None] * dist.get_world_size()  # for the check at the end
        features = [{k: v.cpu() if torch.is_tensor(v) else v for k, v in f.items()}
                    for f in features]
        dist.all_gather_object(gathered, features)
        self.seen.append(gathered)
        self.losses.append(self.accelerator.reduce(loss.detach(), "mean").item())
        return loss


# New code #
# The whole step in one block: the no-grad forwards of the mini-batches, the loss, and the
# replays the loss's hook runs inside the Trainer's backward.
class RetainingCachedLossTrainer(RetainTrainerMixin, CachedLossTrainer):
    pass


def tiny_bert(folder: str, dtype: torch.dtype) -> SentenceTransformer:
    """A 2-layer BERT and its vocabulary written to `folder`, loaded as a SentenceTransformer."""
    with open(os.path.join(folder, "vocab.txt"), "w") as f:
        f.write("\n".join(SPECIAL + WORDS) + "\n")
    config = BertConfig(
        vocab_size=len(SPECIAL) + len(WORDS), hidden_size=HIDDEN, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=64, max_position_embeddings=32,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,  # parity with the replay
    )
    torch.manual_seed(42)
    BertModel(config, add_pooling_layer=False).save_pretrained(folder)
    BertTokenizerFast(vocab_file=os.path.join(folder, "vocab.txt")).save_pretrained(folder)
    transformer = modules.Transformer(folder, max_seq_length=16,
                                      model_kwargs={"add_pooling_layer": False})
    model = SentenceTransformer(modules=[transformer, modules.Pooling(HIDDEN, "mean")],
                                device="cpu")
    return model.to(dtype)


def pairs(n: int) -> Dataset:
    """(anchor, positive) pairs of random words; the positive shares half the anchor's."""
    rng = random.Random(1)
    anchors, positives = [], []
    for _ in range(n):
        words = rng.choices(WORDS, k=rng.randint(3, 10))
        anchors.append(" ".join(words))
        positives.append(" ".join(words[: len(words) // 2] + rng.choices(WORDS, k=3)))
    return Dataset.from_dict({"anchor": anchors, "positive": positives})


def fsdp_arguments(version: int) -> dict:
    config = {"version": version, "transformer_layer_cls_to_wrap": ["BertLayer"]}
    if version == 1:
        config |= {"use_orig_params": True, "sync_module_states": False}
    return {"fsdp": True, "fsdp_config": config}


def replay_unsharded(model: SentenceTransformer, seen, lr: float) -> list[float]:
    """The reference: the same global batches in one process without FSDP and without
    caching (`MultipleNegativesRankingLoss`), each rank's loss over its own batch, as the
    cached loss computes it, averaged over the ranks. Returns the step losses."""
    loss_fn = losses.MultipleNegativesRankingLoss(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    step_losses = []
    for ranks in seen:
        loss = sum(loss_fn(features, None) for features in ranks) / len(ranks)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        step_losses.append(loss.item())
    return step_losses


def deepspeed_arguments(stage: int) -> dict:
    """The Trainer's `deepspeed=` config: ZeRO `stage`, fp32, the Trainer's SGD."""
    return {"deepspeed": {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
    }}


def full_parameters(trainer, wrapped) -> dict[str, torch.Tensor]:
    """Every parameter, whole, by name (a ZeRO-3 engine's gathered from its partitions)."""
    if trainer.is_deepspeed_enabled:
        from deepspeed.utils import safe_get_full_fp32_param

        stage = wrapped.zero_optimization_stage()
        return {n: (safe_get_full_fp32_param(p) if stage else p).detach()
                for n, p in wrapped.module.named_parameters()}
    return get_model_state_dict(wrapped, options=StateDictOptions(full_state_dict=True))


def fsdp_units(model) -> int:
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return sum(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in model.modules())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fsdp", type=int, choices=(1, 2), default=2)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=8, help="pairs per process per step")
    parser.add_argument("--mini-batch", type=int, default=2, help="the loss's mini_batch_size")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--sync-grads", choices=("every", "last"), default="every",
                        help="the block's sync_grads: last reduce-scatters once per step, "
                        "not once per replayed mini-batch")
    parser.add_argument("--no-library", action="store_true",
                        help="the same step without the block")
    parser.add_argument("--ddp", action="store_true",
                        help="no fsdp arguments: the Trainer's DDP (use_cpu=True on CPU)")
    parser.add_argument("--deepspeed", type=int, choices=(0, 1, 2, 3), default=None,
                        metavar="STAGE", help="the Trainer's deepspeed= config, ZeRO STAGE")
    args = parser.parse_args()
    backend = ("DDP" if args.ddp else f"DeepSpeed ZeRO-{args.deepspeed}"
               if args.deepspeed is not None else f"FSDP{args.fsdp}")
    wrapper = ({} if args.ddp else deepspeed_arguments(args.deepspeed)
               if args.deepspeed is not None else fsdp_arguments(args.fsdp))

    transformers.logging.set_verbosity_error()
    # Before any process group: save_pretrained writes config.json on rank 0 only.
    # FSDP1's clip_grad_norm_ (the Trainer calls it for the logged norm) takes the norm
    # in float32 and refuses float64 gradients; ZeRO refuses float64 too.
    dtype = (torch.float32 if args.deepspeed is not None or (args.fsdp == 1 and not args.ddp)
             else torch.float64)
    tolerance = 1e-10 if dtype == torch.float64 else 1e-5
    with tempfile.TemporaryDirectory() as folder:
        model = tiny_bert(folder, dtype)
    on_cpu = {}
    if not torch.cuda.is_available() and args.ddp:
        on_cpu = {"use_cpu": True}  # else each rank trains alone, with no DDP
    elif not torch.cuda.is_available():  # CPU only: accelerate's FSDP / DeepSpeed on gloo
        from accelerate_cpu_fsdp import cpu_state_as_accelerator

        cpu_state_as_accelerator(deepspeed=args.deepspeed is not None)
        on_cpu = {"accelerator_config": {"use_configured_state": True}}
    world = int(os.environ.get("WORLD_SIZE", "1"))
    reference = copy.deepcopy(model)  # for the check at the end
    initial = copy.deepcopy(model.state_dict())
    loss = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=args.mini_batch)
    with tempfile.TemporaryDirectory() as output_dir:
        training = SentenceTransformerTrainingArguments(
            output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch,
            learning_rate=args.lr, lr_scheduler_type="constant", optim="sgd",
            optim_args="momentum=0.9", max_grad_norm=0.0, report_to="none",
            save_strategy="no", logging_strategy="no", disable_tqdm=True,
            dataloader_pin_memory=False, seed=42, **wrapper, **on_cpu,
        )
        data = pairs(args.steps * args.batch * world)
        if args.no_library:
            trainer = CachedLossTrainer(model=model, args=training, train_dataset=data, loss=loss)
        else:  # New code #
            trainer = RetainingCachedLossTrainer(
                model=model, args=training, train_dataset=data, loss=loss,
                retain_options={"sync_grads": args.sync_grads})
        trainer.train()
    wrapped = trainer.model_wrapped
    say = trainer.accelerator.print
    mode = "plain (no block)" if args.no_library else f"block (sync_grads={args.sync_grads!r})"
    units = fsdp_units(wrapped)
    say(f"SentenceTransformerTrainer: {backend}, {world} processes on "
        f"{trainer.accelerator.device.type}, {mode}; model {type(wrapped).__name__} with "
        f"{units} FSDP units; CachedMultipleNegativesRankingLoss, {args.batch} pairs per "
        f"process, mini_batch_size {args.mini_batch}")

    reference.to(training.device)
    reference_losses = replay_unsharded(reference, trainer.seen, args.lr)
    for step, (counts, loss_value, expected) in enumerate(
            zip(trainer.counts, trainer.losses, reference_losses), start=1):
        say(f"step {step}: loss {loss_value:.9f}, uncached replay {expected:.9f}, "
            f"all_gather={counts['all_gather']} reduce_scatter={counts['reduce_scatter']} "
            f"all_reduce={counts['all_reduce']} "
            f"forward_all_gather={counts['forward_all_gather']} "
            f"backward_all_gather={counts['backward_all_gather']}")
    trained = full_parameters(trainer, wrapped)
    expected = {k: v for k, v in reference.state_dict().items() if k in trained}
    max_diff = max((trained[k].to(v.device) - v).abs().max().item() for k, v in expected.items())
    update = max((v - initial[k].to(v.device)).abs().max().item() for k, v in expected.items())
    loss_diff = max(abs(a - b) for a, b in zip(trainer.losses, reference_losses))
    say(f"PARITY max_diff={max_diff:.3g} ({str(dtype)[6:]}, every parameter after {args.steps} "
        f"optimizer steps against an uncached unsharded replay, largest update {update:.3g}; "
        f"losses: {loss_diff:.3g})")
    per_step = [c["all_gather"] for c in trainer.counts]
    say(f"all-gathers per step: {per_step} ({units} FSDP units, {mode})")
    ok = max_diff <= tolerance and loss_diff <= tolerance and update > 0
    say("agreement: OK" if ok else "agreement: FAILED")
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
