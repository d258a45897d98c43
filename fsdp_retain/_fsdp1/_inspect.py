"""Readers of FSDP1 state for tests and the report (private FSDP1 access).

Part of the FSDP1 backend; the block itself never calls these.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from .._common import ACTIVE_ATTR, require_attr
from ._compat import FLAVOUR as _FLAVOUR
from ._compat import HOOK_STATE
_STORAGES = ("_full_param_padded", "_mp_shard", "_full_prec_full_param_padded")


def fsdp1_handles(model: nn.Module) -> list[Any]:
    """The ``FlatParamHandle`` of every FSDP1 unit under ``model`` that has parameters."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    handles = []
    for module in FullyShardedDataParallel.fsdp_modules(model):
        handle = require_attr(module, "_handle", _FLAVOUR)
        if handle is not None:
            handles.append(handle)
    return handles


def unsharded_storage_bytes(model: nn.Module) -> int:
    """Bytes held by the unsharded flat parameters of ``model`` (0 when all are freed)."""
    total = 0
    for handle in fsdp1_handles(model):
        if handle.uses_sharded_strategy:
            padded = require_attr(handle.flat_param, "_full_param_padded", _FLAVOUR)
            total += padded.untyped_storage().nbytes()
    return total



def fsdp1_snapshot(model: nn.Module) -> dict[str, Any]:
    """FSDP1 state the block may touch, for tests: flags, hooks, storage, gradients.

    Two snapshots taken between steps (outside any forward and backward) are
    equal when the block left nothing behind. Gradients appear only as "none
    or reduced", so a pass that was reduced before an exception does not count.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.modules import module as module_globals

    snap: dict[str, Any] = {
        "global_hooks": tuple(
            len(getattr(module_globals, name, ()))
            for name in (
                "_global_forward_pre_hooks",
                "_global_forward_hooks",
                "_global_backward_hooks",
                "_global_backward_pre_hooks",
            )
        ),
        "active": ACTIVE_ATTR in model.__dict__,
    }
    for name, module in model.named_modules():
        snap[f"{name}:hooks"] = (
            len(module._forward_pre_hooks),
            len(module._forward_hooks),
            len(module._backward_pre_hooks),
            len(module._backward_hooks),
        )
        if not isinstance(module, FullyShardedDataParallel):
            continue
        snap[f"{name}:state"] = (
            str(module.training_state),
            module._sync_gradients,
            module._is_root,
            getattr(module, "_post_backward_callback_queued", None),
            ACTIVE_ATTR in module.__dict__,
        )
        if module._is_root:
            order = module._exec_order_data
            snap[f"{name}:exec_order"] = len(order.handles_post_forward_order)
        handle = module._handle
        if handle is None:
            continue
        flat_param = handle.flat_param
        grad = flat_param.grad
        tensors = flat_param._tensors if handle._use_orig_params else None
        snap[f"{name}:handle"] = (
            str(handle._training_state),
            handle._needs_pre_backward_unshard,
            handle._ran_pre_backward_hook,
            handle._prefetched,
            handle._post_forward_index,
            tuple(sorted(k for k in ("reshard", "pre_unshard") if k in handle.__dict__)),
        )
        snap[f"{name}:flat_param"] = (
            tuple(flat_param.shape),
            flat_param.dtype,
            hasattr(flat_param, HOOK_STATE),
            hasattr(flat_param, "_saved_grad_shard"),
            len(flat_param._backward_hooks or {}),
            len(getattr(flat_param, "_post_accumulate_grad_hooks", None) or {}),
            grad is None or grad.shape == flat_param.shape,
            None if tensors is None else tuple(t is None for t in tensors),
            tuple(
                getattr(flat_param, attr).untyped_storage().nbytes()
                for attr in _STORAGES
                if hasattr(flat_param, attr)
            ),
        )
    return snap
