"""HF Qwen2 under DDP (part of ``tests/real_stacks/cases_real_stacks.py``): what HF ``Trainer`` and
accelerate set up by default on several GPUs.

- HF reentrant, non-reentrant and no gradient checkpointing, every ``sync_grads``, a probe
  pass first or the log-prob loss as a real pass; peft LoRA (frozen base and embedding)
  with a probe pass; ``static_graph=True`` (what HF sets for reentrant checkpointing under
  DDP) and ``find_unused_parameters=True``. Parity with the unwrapped model over 3 steps
  (``tests/support/real_stacks_hf.py``'s RL step and check).
- The same RL step on plain DDP is wrong or refused by DDP's reducer.
"""

from __future__ import annotations

import functools
import itertools

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.support.harness import Registry
from tests.support.parity import Adapter
from tests.support.real_stacks_hf import (
    hf_rl_parity,
    logp_loss,
    lora_qwen2,
    tiny_qwen2,
    token_logp,
    tokens,
    weighted_loss,
)

registry = Registry()


def _named(model: DDP, what: str) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in model.module.named_parameters():
        value = param.detach() if what == "params" else param.grad
        if value is not None:
            out[name] = value.detach()
    return out


ADAPTER = Adapter(full_params=functools.partial(_named, what="params"),
                  full_grads=functools.partial(_named, what="grads"))


def wrap_ddp(model: nn.Module, **ddp: object) -> DDP:
    return DDP(model, **ddp)


def _add_hf_cases() -> None:
    settings = {"default": {}, "static": dict(static_graph=True),
                "unused": dict(find_unused_parameters=True)}
    for ckpt, sync, (setting, ddp), probe in itertools.product(
            ("reentrant", "nonreentrant", "none"), ("every", "last"), settings.items(),
            (False, True)):
        if probe and ckpt == "reentrant":
            continue  # a probe pass over reentrant checkpoints is refused (tested for FSDP)
        if setting == "unused" and (probe or sync == "last"):
            continue  # a cover, not the product
        wrap = functools.partial(wrap_ddp, **ddp)
        fn = functools.partial(hf_rl_parity, wrap, ADAPTER, ckpt, True, sync, probe)
        registry.add(f"hf_qwen2_{ckpt}_ddp_{setting}_{sync}{'_probe' if probe else ''}", fn)
    for ckpt, sync in itertools.product(("none", "nonreentrant"), ("every", "last")):
        fn = functools.partial(hf_rl_parity, wrap_ddp, ADAPTER, ckpt, True, sync, True,
                               lora_qwen2)
        registry.add(f"peft_lora_qwen2_ddp_{ckpt}_{sync}_probe", fn)


_add_hf_cases()


@registry.case()
def hf_qwen2_ddp_without_block_is_wrong() -> None:
    """The RL step on plain DDP (no checkpointing, static_graph and not): the second
    pass is never all-reduced, so the ranks' gradients differ, or DDP refuses it."""
    import torch.distributed as dist

    for ddp in ({}, dict(static_graph=True)):
        model = DDP(tiny_qwen2("none"), **ddp)
        try:
            logp = token_logp(model, tokens(0))
            logp_loss(logp).backward(retain_graph=True)
            for param in model.parameters():
                param.grad = None
            weighted_loss(logp).backward()
        except RuntimeError as exc:
            assert "DDP" in str(exc) or "static_graph" in str(exc), exc
            continue
        grad = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
        others = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
        dist.all_gather(others, grad)
        assert not torch.equal(others[0], others[1]), "plain DDP reduced the second pass"
