"""What every DeepSpeed block shares: recognizing an engine, its ZeRO stage and the checks
that hold for every stage (private DeepSpeed access, as in the rest of the package; the
step and the division by the accumulation steps: ``_step.py``). Never imports deepspeed
itself."""

from __future__ import annotations

import sys
from typing import Any

from .._common import require_attr


def flavour(stage: int | str = 3) -> str:
    ds = sys.modules.get("deepspeed")
    version = getattr(ds, "__version__", "?")
    return f"DeepSpeed {version} ZeRO-{stage}"


def is_deepspeed_engine(model: object) -> bool:
    """True for a ``DeepSpeedEngine``; False (without importing it) if deepspeed is not loaded."""
    if "deepspeed" not in sys.modules:
        return False
    engine_module = sys.modules.get("deepspeed.runtime.engine")
    cls = getattr(engine_module, "DeepSpeedEngine", None)
    return cls is not None and isinstance(model, cls)


def zero_stage(engine: Any) -> int:
    """The engine's ZeRO stage (0 to 3)."""
    return int(require_attr(engine, "zero_optimization_stage", flavour("?"))())


def check_engine_common(engine: Any, stage: int) -> None:
    """``ValueError`` for what no DeepSpeed block handles, whatever the stage."""
    if getattr(engine, "pipeline_parallelism", False):
        raise ValueError(
            "no_reshard_between_backwards does not support DeepSpeed pipeline "
            f"parallelism (PipelineEngine); use a plain ZeRO-{stage} engine."
        )
    active = getattr(engine, "is_deepcompile_active", None)
    if active is not None and active():
        raise ValueError(
            f"no_reshard_between_backwards does not support DeepCompile: it replaces "
            f"ZeRO-{stage}'s hooks. Disable compile.deepcompile in the DeepSpeed config."
        )
