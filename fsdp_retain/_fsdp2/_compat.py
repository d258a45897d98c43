"""FSDP2 (``fully_shard``) internals the block uses, across torch versions.

Part of the FSDP2 backend with ``_block.py``: every version difference and
every private FSDP2 name the block reads or calls outside its per-unit flags
lives here, checked when a block installs (``require_attr``: a missing
internal raises, naming the torch version).

The block writes the flags of each ``FSDPParamGroup`` (``GROUP_FLAGS``)
directly, not through ``FSDPModule.set_reshard_after_backward`` /
``set_requires_gradient_sync``: those act on every group of a module at once
and recompute the value, while a byte budget keeps or frees one group at a
time and the block's exit puts back the exact objects it found (a
``post_forward_mesh_info`` of the user's choice).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn as nn

from .._common import missing_internal, require_attr, require_attrs

FLAVOUR = "FSDP2"
PASS_START_HOOK = "_register_root_post_backward_final_callback"
GROUP_FLAGS = (
    "post_forward_mesh_info",
    "reshard_after_backward",
    "reduce_grads",
    "all_reduce_grads",
)

# What the block reads, writes or calls on FSDP2's objects besides GROUP_FLAGS.
_ROOT_ATTRS = ("_comm_ctx", "_root_post_backward_final_callback")
_STATE_ATTRS = ("_pre_backward", "_modules", PASS_START_HOOK)
_GROUP_ATTRS = GROUP_FLAGS + (
    "fsdp_params",
    "modules",
    "_post_forward_indices",
    "is_sharded",
    "is_unsharded",
    "is_sharded_post_forward",
    "use_training_state",
    "reshard",
)
_PARAM_ATTRS = ("sharded_param", "_setattr_on_modules", "_module_info", "_orig_size",
                "orig_dtype", "param_dtype")


# (type, names) already probed: the attributes are this torch's, the same for every
# object of a type, so a block probes each type once per process, not every
# parameter at every entry.
_probed: set[tuple[type, tuple[str, ...]]] = set()


def _require_once(obj: Any, names: tuple[str, ...]) -> None:
    key = (type(obj), names)
    if key not in _probed:
        require_attrs(obj, names, FLAVOUR)
        _probed.add(key)


def forget_probes() -> None:
    """Probes every type again at the next install (for tests that remove an attribute)."""
    _probed.clear()


def check_installable(root_state: Any, states: list[Any], groups: list[Any]) -> None:
    """Probes, at install, every FSDP2 attribute the block touches later."""
    _require_once(root_state, _ROOT_ATTRS)
    _require_once(root_state._comm_ctx, ("post_forward_order",))
    for state in states:
        _require_once(state, _STATE_ATTRS)
    for group in groups:
        _require_once(group, _GROUP_ATTRS)
        if group.fsdp_params:
            _require_once(group.fsdp_params[0], _PARAM_ATTRS)


def _fsdp_module_class() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import FSDPModule
        except ImportError:
            return None
    return FSDPModule


def is_fsdp2_module(module: nn.Module) -> bool:
    cls = _fsdp_module_class()
    return cls is not None and isinstance(module, cls)


def training_state_enum():
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    except ImportError:
        try:
            from torch.distributed._composable.fsdp._fsdp_common import TrainingState
        except ImportError:
            raise missing_internal("TrainingState", FLAVOUR) from None
    return TrainingState


def post_forward_mesh_info(ranks: int, mesh_info: Any) -> Any:
    """The mesh info FSDP2 gives a group built with ``reshard_after_forward=ranks``
    (its ``post_forward_mesh_info``), made for ``mesh_info``."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_init import _get_post_forward_mesh_info
    except ImportError:
        try:
            from torch.distributed._composable.fsdp._fsdp_init import (
                _get_post_forward_mesh_info,
            )
        except ImportError:
            raise missing_internal("_get_post_forward_mesh_info", FLAVOUR) from None
    with _real_tensors():
        return _get_post_forward_mesh_info(ranks, mesh_info)


def _real_tensors() -> Any:
    """Outside any ``FakeTensorMode``: a ``DeviceMesh`` is made from real tensors of rank
    ids, which fake tensors cannot stand in for (FSDP2 itself fails there, e.g. under
    ``fully_shard(reshard_after_forward=<int>)`` in a fake-tensor memory estimate)."""
    try:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
    except ImportError:  # no fake tensors to leave
        return contextlib.nullcontext()
    return unset_fake_temporarily()


def forward_running(state: Any) -> bool:
    """Whether ``state``'s forward started and has not returned."""
    return require_attr(state, "_training_state", FLAVOUR) == training_state_enum().FORWARD


def grad_version(grad: torch.Tensor) -> tuple[int, int]:
    # In-place ops on a DTensor bump the DTensor's counter, not the local one's.
    local = getattr(grad, "_local_tensor", grad)
    return grad._version, local._version


def param_groups(state: Any) -> list[Any]:
    """An FSDP2 state's parameter groups."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    # torch 2.9-2.11: at most one group per state.
    group = require_attr(state, "_fsdp_param_group", FLAVOUR)
    return [] if group is None else [group]


def backward_order(states: list[Any]) -> list[tuple[Any, int, bool]]:
    """Parameter groups with their unsharded bytes and whether FSDP2 frees them after
    forward (a ``post_forward_mesh_info``; the root has none), the root's first, then
    the others in reverse module order (the order their backward runs; ``kept_units``)."""
    root, rest = param_groups(states[0]), []
    for state in states[1:]:
        rest.extend(param_groups(state))
    return [
        (group, unsharded_bytes(group), group.post_forward_mesh_info is not None)
        for group in root + rest[::-1]
    ]


# On a group: (id of its fsdp_params list, their count, their unsharded bytes). Sizes
# and dtypes are fixed at fully_shard, so a block entry need not sum over every
# parameter; kept on the group (plain ints), so it goes with the model.
_BYTES_ATTR = "_fsdp_retain_unsharded_bytes"


def unsharded_bytes(group: Any) -> int:
    """Bytes of a parameter group's unsharded parameters on one rank."""
    params = group.fsdp_params
    cached = getattr(group, _BYTES_ATTR, None)
    if cached is not None and cached[:2] == (id(params), len(params)):
        return cached[2]
    total = sum(
        fsdp_param._orig_size.numel()
        * (fsdp_param.param_dtype or fsdp_param.orig_dtype).itemsize
        for fsdp_param in params
    )
    setattr(group, _BYTES_ATTR, (id(params), len(params), total))
    return total


def clear_unsharded_grad(fsdp_param: Any) -> None:
    """Drops the gradients a parameter holds unreduced (``reduce_grads=False``)."""
    unsharded = getattr(fsdp_param, "_unsharded_param", None)
    if unsharded is not None:
        unsharded.grad = None
    # torch <= 2.14 accumulates in a separate buffer; in 2.15 the name is a
    # read-only alias of the unsharded parameter's .grad.
    alias = getattr(type(fsdp_param), "unsharded_accumulated_grad", None)
    if not (isinstance(alias, property) and alias.fset is None):
        fsdp_param.unsharded_accumulated_grad = None


def run_root_final_callback(root_state: Any) -> None:
    """FSDP2's end-of-backward callback, run outside a backward."""
    ctx = root_state._state_ctx
    # torch 2.15: the callback reads the finalization mode its registration sets.
    if getattr(ctx, "manual_backward_finalization_active", False) is None:
        ctx.manual_backward_finalization_active = ctx.manual_backward_finalization
    require_attr(root_state, "_root_post_backward_final_callback", FLAVOUR)()


def reset_iteration(root_state: Any) -> None:
    """Reshards everything and clears per-iteration state, without collectives."""
    reset = getattr(root_state, "_reset_iter_state", None)
    if reset is not None:
        reset()
        return
    state_enum = training_state_enum()  # torch 2.9-2.12: no _reset_iter_state
    ctx = require_attr(root_state, "_state_ctx", FLAVOUR)
    for state in ctx.all_states:
        state._training_state = state_enum.IDLE
        getattr(state, "_modules_to_run_forward", set()).clear()
        for group in param_groups(state):
            group._training_state = state_enum.IDLE
            group._post_forward_indices.clear()
            group._all_gather_result = None
            group._to_sharded()
    ctx.post_backward_final_callback_queued = False
    ctx.iter_forward_root = None
    root_state._comm_ctx.post_forward_order.clear()


def has_pending_grad(fsdp_param: Any) -> bool:
    unsharded = getattr(fsdp_param, "_unsharded_param", None)
    return (unsharded is not None and unsharded.grad is not None) or (
        fsdp_param.unsharded_accumulated_grad is not None
    )


def shard_group(param: Any) -> Any:
    """The process group whose ranks hold disjoint shards of ``param`` (a DTensor):
    its mesh dimension placed ``Shard``; ``None`` when more than one is (TP)."""
    from torch.distributed.tensor import Shard

    dims = [i for i, p in enumerate(param.placements) if isinstance(p, Shard)]
    if len(dims) != 1:
        return None
    return param.device_mesh.get_group(dims[0])


def replica_weights(params: list[Any]) -> list[float]:
    """Per DTensor parameter: 1 / the ranks of the default group that hold the same
    shard of it (its mesh dimensions placed ``Replicate``, and the ranks outside its
    mesh when it lives on a sub-mesh, e.g. FSDP's ``dp`` mesh beside TP's 2-D one).
    Summing ``weight * local value`` over all ranks counts each element once. A
    ``ValueError`` says why where that sum is not the model's: a ``Partial``
    placement, or meshes that do not span the default group (pipeline stages)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    spanned: set[int] = set()
    weights = []
    for param in params:
        mesh = param.device_mesh
        spanned.update(mesh.mesh.flatten().tolist())
        shards = 1
        for size, placement in zip(mesh.shape, param.placements):
            if placement.is_partial():
                raise ValueError(
                    f"block.grads() got a gradient placed {placement} (a pending sum): it "
                    "needs each gradient reduced. Not supported for this parallelism."
                )
            if not placement.is_replicate():
                shards *= size
        if world % shards:
            raise ValueError(f"block.grads(): {shards} shards do not divide {world} ranks")
        weights.append(shards / world)
    if spanned != set(range(world)):
        raise ValueError(
            "block.grads() sums its Gramian over every rank of the default process group, "
            f"but this model's meshes span ranks {sorted(spanned)} of {world} (pipeline "
            "stages?): not supported. Run it on a model whose meshes span all ranks."
        )
    return weights


def local_storage(param: Any) -> Any:
    """The storage that holds ``param``'s data on this rank: a DTensor's (tensor
    parallelism composed with FSDP2) is its local tensor's; the wrapper's own
    storage is a placeholder that never frees."""
    return getattr(param, "_local_tensor", param).untyped_storage()
