"""Which training stack handed the block its model, for refusals that name the fix there.

accelerate, transformers' ``Trainer`` and Lightning each decide what the model is
(DDP, FSDP, or no wrapper at all for one process or accelerate's CPU default, the module
``accelerator.prepare`` returned, ``self.trainer.strategy.model``), so the fix for a
refused model depends on the stack. Each is recognised by what it leaves behind:
accelerate's shared state, a ``Trainer`` method on the call stack, a Lightning class in
the model's type. Nothing is imported: a stack that is in use has been imported already
(``sys.modules``).
"""

from __future__ import annotations

import dataclasses
import sys
from types import FrameType

import torch.nn as nn

_FSDP_ARGS = ('TrainingArguments(fsdp=True, fsdp_config={"version": 2, '
              '"transformer_layer_cls_to_wrap": [<decoder layer class>]})')
_FSDP_ACCELERATE = ("accelerate launch --config_file <a config with distributed_type: FSDP>, "
                    "or Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(...))")
# How each gets DDP: 2 or more processes (accelerate wraps in DDP only then).
_DDP_ACCELERATE = ("accelerate launch --multi_gpu --num_processes <N>, with "
                   "ACCELERATE_USE_CPU=1 in the environment on CPU")
_DDP_TRAINER = ("torchrun --nproc_per_node <N> (or accelerate launch --multi_gpu "
                "--num_processes <N>), with TrainingArguments(use_cpu=True) on CPU")
_CPU_NOTE = ("On CPU accelerate sets up DDP only with use_cpu / ACCELERATE_USE_CPU=1 and "
             "FSDP never: {shim} from examples/accelerate_cpu_fsdp.py in fsdp-retain's "
             "repository sets up accelerate's own FSDP on gloo. ")


@dataclasses.dataclass(frozen=True)
class _Accelerate:
    distributed_type: str  # accelerate's DistributedType value: "FSDP", "MULTI_CPU", "NO", ...
    num_processes: int
    device: str
    trainer: bool  # inside a transformers Trainer method

    def setup(self) -> str:
        who = "the Trainer's Accelerator" if self.trainer else "the Accelerator"
        processes = "process" if self.num_processes == 1 else "processes"
        return (f"{who} set up {self.distributed_type} with {self.num_processes} {processes} "
                f"on {self.device}")

    def wraps(self) -> bool:
        """Whether ``accelerator.prepare`` wraps the model in something the block takes:
        FSDP, a DeepSpeed engine, or DDP (``MULTI_CPU``, ``MULTI_GPU``, ... with 2 or
        more processes)."""
        if self.distributed_type in ("FSDP", "DEEPSPEED"):
            return True
        return self.distributed_type.startswith("MULTI_") and self.num_processes > 1

    def prepared(self) -> str:
        """Which object to pass."""
        if self.trainer:
            return ("the model your training_step receives (what accelerator.prepare "
                    "returned), not self.accelerator.unwrap_model(model)")
        return ("what accelerator.prepare returned, not accelerator.unwrap_model(model) "
                "nor the model before prepare")

    def configure(self) -> str:
        """Why accelerate left the model unwrapped and how to get DDP or FSDP."""
        who = "the Trainer" if self.trainer else "accelerate"
        ddp = _DDP_TRAINER if self.trainer else _DDP_ACCELERATE
        fsdp = _FSDP_ARGS if self.trainer else _FSDP_ACCELERATE
        shim = ("cpu_state_as_accelerator() (docs/integrations/hf_trainer.md)" if self.trainer
                else "the launcher")
        note = _CPU_NOTE.format(shim=shim) if self.device.startswith("cpu") else ""
        return (f"{_capital(self.setup())}, which leaves the model unwrapped: the block needs "
                f"the model {who} wraps in DDP or FSDP (or a DeepSpeed engine). For DDP start "
                f"2 or more processes: {ddp}. For FSDP: {fsdp}. {note}Then pass "
                f"{self.prepared()}.")


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]


def _accelerate() -> _Accelerate | None:
    state = sys.modules.get("accelerate.state")
    if state is None:
        return None
    shared = state.AcceleratorState._shared_state or state.PartialState._shared_state
    if not shared or "distributed_type" not in shared:
        return None
    kind = shared["distributed_type"]
    return _Accelerate(
        distributed_type=str(getattr(kind, "value", kind)),
        num_processes=int(shared.get("num_processes", 1)),
        device=str(shared.get("device", "?")),
        trainer=_in_hf_trainer(),
    )


def _in_hf_trainer() -> bool:
    trainer = sys.modules.get("transformers.trainer")
    if trainer is None:
        return False
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if isinstance(frame.f_locals.get("self"), trainer.Trainer):
            return True
        frame = frame.f_back
    return False


def _lightning(model: object) -> bool:
    return any(cls.__module__.split(".")[0] in ("lightning", "pytorch_lightning",
                                                 "lightning_fabric")
               for cls in type(model).__mro__)


_LIGHTNING_ROOT = ("self.trainer.strategy.model (Lightning's Trainer) or the module "
                   "fabric.setup returned (Fabric)")


_LIGHTNING_FIX = (f"Pass the model the strategy wrapped: {_LIGHTNING_ROOT}, under DDPStrategy, "
                  "FSDPStrategy or ModelParallelStrategy; under a strategy that wraps nothing "
                  "(one process, SingleDeviceStrategy), switch to one of them.")


def not_wrapped_fix(model: nn.Module) -> str:
    """The fix for a module with no DDP, FSDP or DeepSpeed wrapper around it."""
    if _lightning(model):
        return _LIGHTNING_FIX
    stack = _accelerate()
    if stack is not None and stack.wraps():
        ddp = " (DDP)" if stack.distributed_type.startswith("MULTI_") else ""
        return f"{_capital(stack.setup())}{ddp}; pass {stack.prepared()}."
    if stack is not None:
        return stack.configure()
    return ("Wrap it with DistributedDataParallel(...), replicate(...), fully_shard(...) or "
            "FullyShardedDataParallel(...) and pass the wrapper (the module replicate was "
            "applied to; the root module with FSDP; with DeepSpeed, pass the engine "
            "deepspeed.initialize returns).")


def wrapper_fix(model: nn.Module) -> str:
    """The fix for a module that holds FSDP units but is not the FSDP root."""
    if _lightning(model):
        return f"Pass the FSDP root: {_LIGHTNING_ROOT}."
    stack = _accelerate()
    if stack is not None and stack.distributed_type == "FSDP":
        return f"Pass {stack.prepared()}: that is the FSDP root."
    return ("Wrap the root too (fully_shard(model) or FullyShardedDataParallel(model)) "
            "and pass it.")
