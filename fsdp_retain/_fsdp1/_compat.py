"""FSDP1 (``FullyShardedDataParallel``) internals the block uses, checked at install.

Part of the FSDP1 backend with ``_block.py``: the private functions of
``torch.distributed.fsdp._runtime_utils`` the block calls (``internals()``,
each checked by name: a missing one raises, naming the torch version) and the
small readers of a ``FlatParamHandle`` that the backend and the test readers
(``_inspect.py``) share.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch
import torch.nn as nn

from .._common import missing_internal, require_attr, require_attrs

FLAVOUR = "FSDP1"
# Where FSDP1 keeps a flat parameter's (AccumulateGrad, hook handle).
HOOK_STATE = "_post_backward_hook_state"
# Names of torch.distributed.fsdp._runtime_utils internals the block calls.
_RUNTIME_FUNCTIONS = (
    "_lazy_init",
    "_post_backward_hook",
    "_post_backward_final_callback",
    "_post_backward_reshard",
    "_prefetch_handle",
    "_PrefetchMode",
    "_register_post_backward_final_callback",
    "_reset_flat_param_grad_info_if_needed",
    "_reshard",
    "_unshard",
)


# What the block reads or writes on FSDP1's objects besides those functions.
_ROOT_ATTRS = ("_all_fsdp_states", "_exec_order_data")
_STATE_ATTRS = (
    "_handle",
    "_sync_gradients",
    "_fsdp_wrapped_module",
    "training_state",
    "_unshard_stream",
    "_pre_unshard_stream",
    "_device_handle",
)
_HANDLE_ATTRS = (
    "flat_param",
    "reshard",
    "pre_unshard",
    "needs_unshard",
    "uses_sharded_strategy",
    "prepare_gradient_for_backward",
    "_use_sharded_grad_views",
    "_use_unsharded_grad_views",
    "_training_state",
    "_needs_pre_backward_unshard",
    "_prefetched",
    "_use_orig_params",
)  # _ran_pre_backward_hook, _post_forward_index: FSDP1 sets them in each forward


def check_installable(root: Any, states: list[Any]) -> None:
    """Probes, at install, every FSDP1 attribute the block touches later."""
    require_attrs(root, _ROOT_ATTRS, FLAVOUR)
    for state in states:
        require_attrs(state, _STATE_ATTRS, FLAVOUR)
        if state._handle is not None:
            require_attrs(state._handle, _HANDLE_ATTRS, FLAVOUR)


@functools.cache
def internals() -> types.SimpleNamespace:
    """The private FSDP1 pieces the block uses, or an error naming the torch version."""
    try:
        from torch.distributed.fsdp import _runtime_utils
        from torch.distributed.fsdp._common_utils import (
            HandleTrainingState,
            TrainingState,
        )
    except ImportError as exc:
        raise missing_internal(str(exc), FLAVOUR) from None
    found = {
        name: require_attr(_runtime_utils, name, FLAVOUR) for name in _RUNTIME_FUNCTIONS
    }
    return types.SimpleNamespace(
        TrainingState=TrainingState,
        HandleTrainingState=HandleTrainingState,
        **{name.lstrip("_"): fn for name, fn in found.items()},
    )


def graph_task_id() -> int:
    """The running backward's id, -1 outside backward (``_pass_start`` checked it exists)."""
    return torch._C._current_graph_task_id()


def acc_grad_node(flat_param: torch.Tensor) -> Any:
    """The ``AccumulateGrad`` node a graph built now would use, as FSDP1 finds it."""
    with torch.enable_grad():
        return flat_param.expand_as(flat_param).grad_fn.next_functions[0][0]


def hooked_node(handle: Any) -> Any:
    """The ``AccumulateGrad`` node FSDP1's post-backward hook is on, if any.

    A flat parameter that needs no gradient has a reshard-only hook instead,
    stored as a 1-tuple.
    """
    hook_state = getattr(handle.flat_param, HOOK_STATE, None)
    return hook_state[0] if hook_state is not None and len(hook_state) == 2 else None


def orig_params(flat_param: Any) -> list[tuple[int, torch.Tensor]]:
    """``(index, parameter)`` for each original parameter of ``flat_param``
    (``use_orig_params=True``) and each tied duplicate (the index of its primary)."""
    params = list(enumerate(getattr(flat_param, "_params", None) or ()))
    shared = getattr(flat_param, "_shared_params", None) or ()
    for info, param in zip(getattr(flat_param, "_shared_param_infos", ()), shared):
        for index, prim in enumerate(flat_param._param_infos):
            if prim.module is info.prim_module and prim.param_name == info.prim_param_name:
                params.append((index, param))
    return params


def param_segments(flat_param: Any) -> list[tuple[int, int]]:
    """Each original parameter's ``(start, end)`` in the unsharded flat parameter
    (and its gradient): ``_numels_with_padding`` less the alignment padding."""
    numels = require_attr(flat_param, "_numels_with_padding", FLAVOUR)
    padding = require_attr(flat_param, "_is_padding_mask", FLAVOUR)
    segments, start = [], 0
    for numel, is_padding in zip(numels, padding):
        if not is_padding:
            segments.append((start, start + numel))
        start += numel
    return segments


def storage_ptrs(flat_param: Any) -> set[int]:
    """Data pointers of every storage a flat parameter's views may point into."""
    tensors = [flat_param] + [
        getattr(flat_param, name, None) for name in ("_local_shard", "_full_param_padded")
    ]
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor)}


def unsharded_bytes(handle: Any) -> int:
    """Bytes of the unit's unsharded flat parameter (0 for ``NO_SHARD``)."""
    if not handle.uses_sharded_strategy:
        return 0
    padded = require_attr(handle.flat_param, "_full_param_padded", FLAVOUR)
    return padded.numel() * padded.element_size()


def frees_after_forward(state: Any, handle: Any) -> bool:
    """Whether FSDP1 frees the unit's unsharded flat parameter after its forward (as
    ``_post_forward_reshard`` decides: not the root's; FULL_SHARD and HYBRID_SHARD)."""
    from torch.distributed.fsdp import _runtime_utils

    strategies = getattr(_runtime_utils, "RESHARD_AFTER_FORWARD_HANDLE_STRATEGIES", None)
    if strategies is None:  # only orders a byte budget: assume FSDP's default
        return not state._is_root
    return not state._is_root and handle._sharding_strategy in strategies


def is_fsdp1_unit(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return isinstance(module, FullyShardedDataParallel)
