"""FSDP1 wrapping, readers and collective-count formulas for the parity harness (in ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from fsdp_retain._fsdp1._inspect import fsdp1_handles, unsharded_storage_bytes
from tests.support.parity import Adapter, Block, device, world

FULL = ShardingStrategy.FULL_SHARD
GRAD_OP = ShardingStrategy.SHARD_GRAD_OP
HYBRID = ShardingStrategy.HYBRID_SHARD
HYBRID_ZERO2 = ShardingStrategy._HYBRID_SHARD_ZERO2
NO_SHARD = ShardingStrategy.NO_SHARD
STRATEGY_NAMES = {FULL: "full", GRAD_OP: "gradop", HYBRID: "hybrid", NO_SHARD: "noshard"}
_RESHARD_AFTER_FORWARD = (FULL, HYBRID)

__all__ = [
    "ADAPTER",
    "expected_all_gathers",
    "expected_all_reduces",
    "expected_reduce_scatters",
    "unsharded_storage_bytes",
    "units",
    "wrap",
]


def wrap(
    model: nn.Module, strategy: ShardingStrategy = FULL, use_orig_params: bool = False, **kwargs
) -> FSDP:
    """Auto-wraps each ``Block`` in its own FSDP1 unit, then the root (nested units).

    ``HYBRID_SHARD`` and ``_HYBRID_SHARD_ZERO2`` use a (replicate=world/2, shard=2) CPU mesh.
    """
    if strategy in (HYBRID, HYBRID_ZERO2):
        kwargs["device_mesh"] = init_device_mesh(
            "cpu", (world() // 2, 2), mesh_dim_names=("replicate", "shard")
        )
    return FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=strategy,
        use_orig_params=use_orig_params,
        device_id=device(),
        **kwargs,
    )


def _clean(name: str) -> str:
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    return clean_tensor_name(name)


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    with FSDP.summon_full_params(model, writeback=False):
        return {_clean(n): p.detach().clone() for n, p in model.named_parameters()}


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """All-gathers each unit's sharded flat gradient and splits it by parameter.

    Reads ``FlatParameter`` metadata (test-only private access); works for
    both ``use_orig_params`` settings and reads exactly what FSDP's optimizer
    step would use.
    """
    grads: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        if not isinstance(module, FSDP) or module._handle is None:
            continue
        handle = module._handle
        flat = handle.flat_param
        if flat.grad is None:
            continue
        grad = flat.grad.detach()
        if handle.uses_sharded_strategy:
            group = handle.process_group
            parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, grad.contiguous(), group=group)
            grad = torch.cat(parts)[: flat._unpadded_unsharded_size.numel()]
        pieces = [
            piece
            for piece, is_padding in zip(
                grad.split(flat._numels_with_padding), flat._is_padding_mask
            )
            if not is_padding
        ]
        for fqn, piece, shape in zip(flat._fqns, pieces, flat._shapes):
            grads[_clean(f"{prefix}.{fqn}" if prefix else fqn)] = piece.view(shape).clone()
    return grads


ADAPTER = Adapter(full_params=full_params, full_grads=full_grads)


def units(model: nn.Module) -> int:
    """FSDP1 units that manage parameters (the root and each ``Block``)."""
    return len(fsdp1_handles(model))


def expected_all_gathers(
    model: nn.Module, passes: int, keep_unsharded: bool, strategy: ShardingStrategy
) -> int:
    """All-gathers per step, from FSDP1's rules and the block's.

    NO_SHARD: none. Forward: one per unit. ``keep_unsharded``: nothing more
    (every backward uses the forward's). Otherwise pass 1 re-gathers the units
    FSDP freed after forward (all but the root for FULL_SHARD and
    HYBRID_SHARD, none for SHARD_GRAD_OP) and each later pass re-gathers
    every unit.
    """
    if strategy == NO_SHARD or world() == 1:
        return 0
    n = units(model)
    if keep_unsharded:
        return n
    first = n - 1 if strategy in _RESHARD_AFTER_FORWARD else 0
    return n + first + (passes - 1) * n


def reductions(model: nn.Module, passes: int, sync_grads: str) -> int:
    """Gradient reductions per step: one per unit per pass ("every") or per unit ("last")."""
    return units(model) * (passes if sync_grads == "every" else 1)


def expected_reduce_scatters(
    model: nn.Module, passes: int, sync_grads: str, strategy: ShardingStrategy
) -> int:
    """One per reduction for the sharded strategies, none for NO_SHARD."""
    if strategy == NO_SHARD or world() == 1:
        return 0
    return reductions(model, passes, sync_grads)


def expected_all_reduces(
    model: nn.Module, passes: int, sync_grads: str, strategy: ShardingStrategy
) -> int:
    """One per reduction for NO_SHARD (all-reduce) and HYBRID_SHARD (across replicas)."""
    if strategy in (NO_SHARD, HYBRID) or world() == 1:
        return reductions(model, passes, sync_grads)
    return 0
