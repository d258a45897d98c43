"""The report's ``deepspeed`` backend: a ZeRO-3 engine in place of an FSDP-wrapped model."""

from __future__ import annotations

from typing import Any


def _ds_config(dtype: str, params: int) -> dict[str, Any]:
    if dtype == "fp16":
        raise ValueError("the report's deepspeed backend runs fp32 or bf16, not fp16")
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {
            "stage": 3,
            # Shard every parameter, as FSDP does (the default keeps small ones resident).
            "stage3_param_persistence_threshold": 0,
            # One gradient bucket of the model's size, not DeepSpeed's 5e8 elements
            # (a 1.9 GiB fp32 buffer that would be most of a small model's peak).
            "reduce_bucket_size": params,
        },
        "bf16": {"enabled": dtype == "bf16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }


class EngineOptimizer:
    """What ``train_step`` and the memory tracker use as the optimizer of a ZeRO-3 engine."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def step(self) -> None:
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``engine.step()`` already cleared the gradients."""

    @property
    def state(self) -> dict[Any, Any]:
        """Registered up front by the tracker: the shards ZeRO-3 keeps and the optimizer state."""
        zero = self.engine.optimizer
        shards = {
            "params": [p.ds_tensor for p in self.engine.module.parameters()],
            "fp32": list(zero.fp32_partitioned_groups_flat),
        }
        return {"zero3": shards, **{id(k): v for k, v in zero.optimizer.state.items()}}


def build_engine(model, dtype: str):
    """``(engine, optimizer)``: ``model`` under ZeRO-3 with SGD (as the FSDP backends)."""
    import deepspeed
    import torch

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
    config = _ds_config(dtype, sum(p.numel() for p in model.parameters()))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine, EngineOptimizer(engine)


def gathered_units(engine) -> int:
    """Modules ZeRO-3 gathers one by one: those that own parameters."""
    return sum(
        1 for m in engine.module.modules() if next(m.parameters(recurse=False), None) is not None
    )
