"""The GPU kit's cases beyond FSDP (``scripts/gpu_validate.py``, stage ``stacks``; run inside
ranks, NCCL on one GPU each, ``--dry-run``: CPU, gloo): DDP, DeepSpeed ZeRO-2 and ZeRO-3,
each against the unsharded reference of ``tests/support/parity.py`` (the suite's model, losses
and seeds; reference gradients averaged over ranks), 3 passes over one forward, 3
SGD-momentum steps, ``sync_grads`` "every" and "last". Registered for world sizes 1 to 8.

The DeepSpeed cases need deepspeed in the ranks' interpreter (the kit installs it from
``wheelhouse/`` into a throwaway venv over the machine's torch where it is missing): a
rank without it skips them, saying so.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tests.repo.cases_device import PASSES, WORLD_SIZES
from tests.support.harness import Registry, skip_case
from tests.support.parity import (
    LOSSES, Adapter, Scenario, averaged_grads, batch, block_options, device, make_net,
    reference_copy, run_parity, sgd, assert_close_dicts,
)

registry = Registry()


# DDP #
def _ddp(model: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [device().index] if device().type == "cuda" else None
    return DDP(model, device_ids=ids)


_DDP = Adapter(
    full_params=lambda m: {n: p.detach() for n, p in m.module.named_parameters()},
    full_grads=lambda m: {n: p.grad.detach().clone() for n, p in m.module.named_parameters()
                          if p.grad is not None},
)


def _ddp_case(sync: str):
    def run() -> None:
        model = make_net()
        ref = reference_copy(model)
        scenario = Scenario(passes=PASSES, options=block_options(True, sync, PASSES),
                            check_between=sync == "every")
        run_parity(_ddp(model), ref, scenario, _DDP)

    return run


# DeepSpeed ZeRO-2 and ZeRO-3 #
def _deepspeed():
    try:
        import deepspeed
    except ImportError:
        skip_case("deepspeed is not installed in this interpreter (the kit installs it "
                  "from wheelhouse/: bash scripts/gpu_wheelhouse.sh)")
    return deepspeed


def _engine(stage: int, model: nn.Module):
    deepspeed = _deepspeed()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "gradient_clipping": 0.0,  # DeepSpeed's default clips at 1.0; the reference does not
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=sgd(model), config=config)
    return engine


def _full_params(engine) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).detach().float()
            for n, p in engine.module.named_parameters()}


def _zero_case(stage: int, sync: str):
    def run() -> None:
        from fsdp_retain import no_reshard_between_backwards

        model = make_net()
        ref = reference_copy(model)
        engine = _engine(stage, model)
        ref_opt = sgd(ref)
        for step in range(3):
            x = batch(step)
            out = ref(x)
            for i in range(PASSES):
                LOSSES[i](out).backward(retain_graph=i < PASSES - 1)
            grads = averaged_grads(ref)
            for name, param in ref.named_parameters():
                param.grad = grads[name].clone()
            ref_opt.step()
            ref_opt.zero_grad()
            with no_reshard_between_backwards(engine, **block_options(True, sync, PASSES)):
                out = engine(x)
                for i in range(PASSES):
                    engine.backward(LOSSES[i](out), retain_graph=i < PASSES - 1)
            engine.step()
            ref_params = {n: p.detach() for n, p in ref.named_parameters()}
            assert_close_dicts(_full_params(engine), ref_params,
                               f"ZeRO-{stage} {sync} step {step}: params")

    return run


for _sync in ("every", "last"):
    registry.add(f"ddp_fp32_parity_{_sync}", _ddp_case(_sync), world_sizes=WORLD_SIZES)
    for _stage in (2, 3):
        registry.add(f"zero{_stage}_fp32_parity_{_sync}", _zero_case(_stage, _sync),
                     world_sizes=WORLD_SIZES)
