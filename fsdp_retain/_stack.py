"""Which training stack handed the block its model, for refusals that name the fix there.

accelerate, transformers' ``Trainer`` and Lightning each decide what the model is
(DDP, FSDP, or no wrapper at all for one process or accelerate's CPU default, the module
``accelerator.prepare`` returned, ``self.trainer.strategy.model``), so the fix for a
refused model depends on the stack. Each is recognised by what it leaves behind:
accelerate's shared state, a ``Trainer`` method on the call stack, a Lightning class in
the model's type (or, for a plain module, a LightningModule's method or Fabric's objects
on the call stack). Nothing is imported: a stack that is in use has been imported already
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


_LIGHTNING_PACKAGES = ("lightning", "pytorch_lightning", "lightning_fabric")
_FABRIC_MODULES = ("lightning.fabric", "lightning_fabric")


def _lightning(model: object) -> str | None:
    """Which Lightning API set the model up: ``"trainer"``, ``"fabric"``, ``"lightning"``
    (one of them, not known which) or ``None``. A Lightning class in the model's type (a
    LightningModule, Fabric's wrapper) says Lightning; a LightningModule knows the Trainer
    or the Fabric it is attached to. The user's own module under Fabric has neither, so
    the call stack is read for what drives it (``_lightning_on_stack``)."""
    if _lightning_class(model):
        if type(model).__name__ == "_FabricModule" or getattr(model, "_fabric", None) is not None:
            return "fabric"
        return "trainer" if getattr(model, "_trainer", None) is not None else "lightning"
    if not any(name in sys.modules for name in _FABRIC_MODULES):
        return None  # the Trainer imports Fabric too
    return _lightning_on_stack(model)


def _lightning_class(obj: object) -> bool:
    return any(cls.__module__.split(".")[0] in _LIGHTNING_PACKAGES for cls in type(obj).__mro__)


def _lightning_on_stack(model: object) -> str | None:
    """``"trainer"`` where a frame runs a method of a LightningModule attached to a Trainer
    (``training_step``); ``"fabric"`` where a frame holds Fabric's wrapper around ``model``
    or a ``Fabric`` (the user's loop), or runs a LightningModule attached to a Fabric;
    ``None`` where no frame does (Lightning imported, not driving this model)."""
    frame: FrameType | None = sys._getframe(1)
    seen: set[int] = set()
    while frame is not None:
        owner = frame.f_locals.get("self")
        if _lightning_class(owner) and hasattr(owner, "_trainer"):  # a LightningModule
            if getattr(owner, "_fabric", None) is not None:
                return "fabric"
            if getattr(owner, "_trainer", None) is not None:
                return "trainer"
        namespaces = [frame.f_locals]
        if id(frame.f_globals) not in seen and frame.f_globals is not frame.f_locals:
            seen.add(id(frame.f_globals))
            namespaces.append(frame.f_globals)
        if any(_is_fabric(value, model) for names in namespaces for value in names.values()):
            return "fabric"
        frame = frame.f_back
    return None


def _is_fabric(value: object, model: object) -> bool:
    """A ``Fabric``, or Fabric's wrapper around ``model`` (what ``fabric.setup`` returned)."""
    cls = type(value)
    if cls.__module__.split(".")[0] not in _LIGHTNING_PACKAGES:
        return False
    if cls.__name__ == "_FabricModule":
        return model in (value.__dict__.get("_modules", {}).get("_original_module"),
                         getattr(value, "_forward_module", None))
    return any(c.__name__ == "Fabric" for c in cls.__mro__)


_LIGHTNING_ROOT = {
    "trainer": "self.trainer.strategy.model (what Lightning's Trainer wrapped, not self nor "
               "a module inside it)",
    "fabric": "the module fabric.setup(model) returned (or fabric.setup_module(model)), not "
              "the model you gave it",
    "lightning": "self.trainer.strategy.model (Lightning's Trainer) or the module "
                 "fabric.setup returned (Fabric)",
}
# A module that holds FSDP units but is not the root (wrapper_fix).
_FSDP_ROOT = dict(
    _LIGHTNING_ROOT,
    trainer="self.trainer.strategy.model where the strategy wrapped the LightningModule "
            "(FSDPStrategy); where configure_model shards it, put every parameter under one "
            "outermost unit",
)
_STRATEGIES = "DDPStrategy, FSDPStrategy or ModelParallelStrategy"
_WRAPPING_STRATEGIES = {
    "trainer": f"{_STRATEGIES} (with DeepSpeedStrategy it is the DeepSpeed engine)",
    "fabric": _STRATEGIES,
    "lightning": f"{_STRATEGIES} (with the Trainer's DeepSpeedStrategy, the DeepSpeed "
                 "engine: self.trainer.strategy.model)",
}


def _lightning_fix(api: str) -> str:
    return (f"Pass the model the strategy wrapped: {_LIGHTNING_ROOT[api]}, under "
            f"{_WRAPPING_STRATEGIES[api]}; under a strategy that wraps nothing (one process, "
            "SingleDeviceStrategy), switch to one of them.")


def not_wrapped_fix(model: nn.Module) -> str:
    """The fix for a module with no DDP, FSDP or DeepSpeed wrapper around it."""
    lightning = _lightning(model)
    if lightning is not None:
        return _lightning_fix(lightning)
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
    lightning = _lightning(model)
    if lightning is not None:
        return f"Pass the FSDP root: {_FSDP_ROOT[lightning]}."
    stack = _accelerate()
    if stack is not None and stack.distributed_type == "FSDP":
        return f"Pass {stack.prepared()}: that is the FSDP root."
    return ("Wrap the root too (fully_shard(model) or FullyShardedDataParallel(model)) "
            "and pass it.")
