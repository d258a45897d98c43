"""Readers of FSDP2 state for tests and the report (private FSDP2 access).

Part of the FSDP2 backend; the block itself never calls these.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from .._common import ACTIVE_ATTR
from ._compat import GROUP_FLAGS, PASS_START_HOOK, is_fsdp2_module, param_groups


def fsdp2_param_groups(model: nn.Module) -> list[Any]:
    """The FSDP parameter groups (one per unit with parameters) under ``model``."""
    groups = []
    for module in model.modules():
        if is_fsdp2_module(module):
            state = module._get_fsdp_state()
            groups.extend(g for g in param_groups(state) if g.fsdp_params)
    return groups


def fsdp2_snapshot(model: nn.Module) -> dict[str, Any]:
    """FSDP2 state the block may touch, for tests: flags, sharded state, hooks."""
    snap: dict[str, Any] = {}
    for name, module in model.named_modules():
        snap[f"{name}:hooks"] = (
            len(module._forward_pre_hooks),
            len(module._forward_hooks),
            len(module._backward_hooks),
        )
        if not is_fsdp2_module(module):
            continue
        state = module._get_fsdp_state()
        snap[f"{name}:state"] = (
            str(state._training_state),
            PASS_START_HOOK in state.__dict__,
            state._auto_reshard_after_forward,
        )
        for i, group in enumerate(param_groups(state)):
            snap[f"{name}:group{i}"] = tuple(
                repr(getattr(group, flag)) for flag in GROUP_FLAGS
            ) + (str(group._sharded_state), str(group._training_state))
    snap["active"] = getattr(model, ACTIVE_ATTR, False)
    return snap


def fsdp2_all_sharded(model: nn.Module) -> bool:
    """True if every unit is sharded and no unsharded parameter owns memory."""
    for group in fsdp2_param_groups(model):
        if not group.is_sharded:
            return False
        for fsdp_param in group.fsdp_params:
            for tensor in fsdp_param.all_gather_outputs:
                if tensor.untyped_storage().size() != 0:
                    return False
    return True
