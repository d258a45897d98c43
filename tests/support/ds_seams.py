"""The frameworks that drive a DeepSpeed engine, for the seams grid
(``tests/deepspeed/cases_deepspeed_seams.py``; run inside ranks, CPU, gloo).

Each driver trains the tiny Qwen2 of ``cases_deepspeed_common`` for ``STEPS`` optimizer
steps of ``gas`` micro-batches the way its framework does, every gradient made through
one entry (``ENTRIES``), and records each micro-batch's tokens of every rank; ``replay``
trains an unsharded copy on them in one process. See [Note: who steps and who scales on
DeepSpeed] in ``fsdp_retain/_deepspeed/_step.py`` for the contract they check:

- ``engine``: a plain loop, ``engine.step()`` after every micro-batch, the engine divides.
- ``accelerate``: ``Accelerator`` with a ``DeepSpeedPlugin``, its own loop with
  ``accumulate()`` around each micro-batch (``accelerate_no_accumulate``: without it, so
  that accelerate syncs, and DeepSpeed steps, every micro-batch),
  ``fsdp_retain.integrations.accelerate.retaining``; the engine divides.
- ``trainer``: transformers' ``Trainer`` with ``RetainTrainerMixin`` and a
  ``training_step`` of its own that divides each loss by
  ``current_gradient_accumulation_steps``, as the Trainer's convention says.

Without the block (``use_block=False``) the same code runs with nothing of the library.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile

import torch
import torch.distributed as dist

import fsdp_retain
from fsdp_retain import no_reshard_between_backwards
from tests.deepspeed.cases_deepspeed_common import BATCH, SEQ, VOCAB, make_model, setup
from tests.support.harness import ROOT
from tests.support.parity import LOSSES, rank, world

STEPS = 2
LR = 0.05
ENTRIES = (
    "loss.backward", "engine.backward", "engine.backward(scale_wrt_gas=False)",
    "accelerator.backward", "block.backward", "block.grads",
)
PLAIN_ENTRIES = ENTRIES[:4]  # those that exist without the block


@dataclasses.dataclass(frozen=True)
class Seams:
    driver: str  # "engine", "accelerate", "accelerate_no_accumulate", "trainer"
    stage: int
    gas: int
    entry: str
    use_block: bool = True

    def config(self) -> dict:
        return {
            "train_micro_batch_size_per_gpu": BATCH,
            "gradient_accumulation_steps": self.gas,
            "zero_optimization": {"stage": self.stage, "stage3_param_persistence_threshold": 0},
            "gradient_clipping": 0.0,
            "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False,
            "steps_per_print": 10**9,
        }

    def divisor(self) -> int:
        """What the caller divides each loss by before its entry: the Trainer divides by
        its accumulation steps; elsewhere the engine does, except where told not to."""
        divides = self.driver == "trainer" or self.entry == "engine.backward(scale_wrt_gas=False)"
        return self.gas if divides else 1


def losses(logits: torch.Tensor) -> list[torch.Tensor]:
    """Two losses over one forward: the first the larger, so a lost pass shows."""
    return [LOSSES[1](logits.float()), LOSSES[2](logits.float())]


def tokens(step: int, micro: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(42 + rank() + 1 + 1000 * step + 100 * micro)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)


def gathered(x: torch.Tensor) -> torch.Tensor:
    """Every rank's ``x`` stacked, rank order."""
    out = [torch.empty_like(x) for _ in range(world())]
    dist.all_gather(out, x.contiguous())
    return torch.stack(out)


def passes(case: Seams, logits: torch.Tensor, block, engine, accelerator=None) -> None:
    """The two passes of one micro-batch, through ``case.entry``."""
    fed = [loss / case.divisor() for loss in losses(logits)]
    if case.entry == "block.grads":
        grads = [block.grads(loss, retain_graph=i == 0) for i, loss in enumerate(fed)]
        fsdp_retain.apply_grads(fsdp_retain.combine(grads, [1.0, 1.0]))
        return
    for i, loss in enumerate(fed):
        retain = i == 0
        if case.entry == "loss.backward":
            loss.backward(retain_graph=retain)
        elif case.entry == "engine.backward":
            engine.backward(loss, retain_graph=retain)
        elif case.entry == "engine.backward(scale_wrt_gas=False)":
            engine.backward(loss, retain_graph=retain, scale_wrt_gas=False)
        elif case.entry == "accelerator.backward":
            accelerator.backward(loss, retain_graph=retain)
        else:
            block.backward(loss, retain_graph=retain)


def replay(seen: list[tuple[torch.Tensor, bool]], gas: int) -> torch.nn.Module:
    """The reference: the recorded micro-batches (every rank's tokens, and whether the
    optimizer stepped after it) on an unsharded copy, each rank's loss averaged over the
    ranks and divided by ``gas``, SGD with momentum at each step."""
    ref = make_model()
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    for ids, stepped in seen:
        for rank_ids in ids:
            for loss in losses(ref(rank_ids).logits):
                (loss / (len(ids) * gas)).backward(retain_graph=True)
        if stepped:
            opt.step()
            opt.zero_grad()
    return ref


def parameters(engine) -> dict[str, torch.Tensor]:
    if engine.zero_optimization_stage() == 0:
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).detach().clone()
            for n, p in engine.module.named_parameters()}


@dataclasses.dataclass
class Outcome:
    error: float  # largest parameter difference to the replay / largest update
    steps: int  # the engine's optimizer steps
    raised: str = ""  # the exception's text, if the run failed


def outcome(case: Seams) -> Outcome:
    """Runs ``case``; compares the engine's parameters with the replay's."""
    seen: list[tuple[torch.Tensor, bool]] = []
    initial = {n: p.detach().clone() for n, p in make_model().named_parameters()}
    try:
        engine = DRIVERS[case.driver](case, seen)
    except Exception as exc:  # noqa: BLE001 - the plain runs that fail are outcomes
        if case.use_block and "RetainError" not in type(exc).__name__:
            raise
        return Outcome(float("nan"), 0, f"{type(exc).__name__}: {exc}")
    finally:
        _reset_accelerate()
    ref = dict(replay(seen, case.gas).named_parameters())
    got = parameters(engine)
    update = max((ref[n].detach() - initial[n]).abs().max().item() for n in ref)
    error = max((got[n] - ref[n].detach()).abs().max().item() for n in ref)
    return Outcome(error / update, int(engine.global_steps))


# The drivers #
def engine_loop(case: Seams, seen: list) -> object:
    import deepspeed

    setup()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=case.config())
    for step in range(STEPS):
        for micro in range(case.gas):
            x = tokens(step, micro)
            block = (no_reshard_between_backwards(engine) if case.use_block
                     else contextlib.nullcontext())
            with block as b:
                passes(case, engine(x).logits, b, engine)
            engine.step()
            seen.append((gathered(x), micro == case.gas - 1))
    return engine


def accelerate_loop(case: Seams, seen: list) -> object:
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    from fsdp_retain.integrations.accelerate import retaining

    _cpu_state()
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=case.config()),
                              gradient_accumulation_steps=case.gas)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    engine, opt = accelerator.prepare(model, opt)
    for step in range(STEPS):
        for micro in range(case.gas):
            x = tokens(step, micro)
            window = (accelerator.accumulate(engine) if case.driver == "accelerate"
                      else contextlib.nullcontext())
            with window:
                block = (retaining(accelerator, engine) if case.use_block
                         else contextlib.nullcontext())
                with block as b:
                    passes(case, engine(x).logits, b, engine, accelerator)
                opt.step()
                opt.zero_grad()
            seen.append((gathered(x), accelerator.sync_gradients))
    return engine


def trainer_loop(case: Seams, seen: list) -> object:
    from transformers import Trainer, TrainingArguments

    from fsdp_retain.integrations.transformers import RetainTrainerMixin

    class Seeded(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return STEPS * case.gas * BATCH

        def __getitem__(self, i: int) -> dict:
            step, micro, row = i // (case.gas * BATCH), (i // BATCH) % case.gas, i % BATCH
            return {"input_ids": tokens(step, micro)[row]}

    class Plain(Trainer):
        def _get_train_sampler(self, *args, **kwargs):  # this rank's rows, in order
            return range(len(self.train_dataset))

        def training_step(self, model, inputs, num_items_in_batch=None):
            model.train()
            ids = inputs["input_ids"]
            block = getattr(self, "retain_block", None)
            passes(case, model(input_ids=ids).logits, block, model, self.accelerator)
            seen.append((gathered(ids), self.accelerator.sync_gradients))
            return torch.zeros(())

    class Retaining(RetainTrainerMixin, Plain):
        pass

    _cpu_state()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, max_steps=STEPS, per_device_train_batch_size=BATCH,
            gradient_accumulation_steps=case.gas, learning_rate=LR,
            lr_scheduler_type="constant", optim="sgd", optim_args="momentum=0.9",
            max_grad_norm=0.0, report_to="none", save_strategy="no", logging_strategy="no",
            disable_tqdm=True, dataloader_pin_memory=False, deepspeed=_trainer_config(case),
            accelerator_config={"use_configured_state": True},
        )
        trainer = (Retaining if case.use_block else Plain)(
            model=make_model(), args=args, train_dataset=Seeded())
        trainer.train()
    return trainer.model_wrapped


DRIVERS = {"engine": engine_loop, "accelerate": accelerate_loop,
           "accelerate_no_accumulate": accelerate_loop, "trainer": trainer_loop}


def _trainer_config(case: Seams) -> dict:
    return dict(case.config(), train_micro_batch_size_per_gpu="auto",
                gradient_accumulation_steps="auto", gradient_clipping="auto")


def _cpu_state() -> None:
    """accelerate's DeepSpeed setup on the ranks' gloo group (examples/accelerate_cpu_fsdp.py)."""
    setup()
    sys.path.insert(0, str(ROOT / "examples"))
    from accelerate_cpu_fsdp import cpu_state_as_accelerator

    os.environ.setdefault("ACCELERATE_USE_DEEPSPEED", "false")
    cpu_state_as_accelerator(deepspeed=True)


def _reset_accelerate() -> None:
    """Each case builds its own Accelerator: accelerate keeps one state per process."""
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()

