"""What examples/chunked_ce.py and examples/mtp_heads.py share to check and count, not
what they show: the unsharded parameters for the parity check, and a collective counter
that works where ``CommDebugMode`` does not."""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, unsharded, under its unwrapped name (collective: every rank calls)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if not isinstance(model, FullyShardedDataParallel):  # FSDP2: DTensor parameters
        return {name: p.full_tensor().detach() for name, p in model.named_parameters()}
    with FullyShardedDataParallel.summon_full_params(model):
        return {
            name.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
            for name, p in model.named_parameters()
        }


class CollectiveCounter(TorchDispatchMode):
    """Counts all-gathers and reduce-scatters as torch's ``CommDebugMode`` does (a dispatch
    mode that sees the c10d ops FSDP1 and FSDP2 call). ``CommDebugMode`` itself fails on
    this loop (torch 2.13: its per-module tracker raises ``IndexError`` when a module runs
    its forward twice inside one mode, as the lm_head of chunked_ce.py does once per chunk). ``units`` maps
    a name to a unit's parameter count: a collective whose unsharded side has that size
    also counts as ``<name>_<kind>`` (here no other unit has that size; FSDP pads a
    size that does not divide by the world size, which the default sizes do)."""

    def __init__(self, units: dict[str, int]) -> None:
        super().__init__()
        self.units = units
        kinds = ("all_gather", "reduce_scatter")
        self.counts: Counter[str] = Counter(
            {key: 0 for key in [*kinds, *(f"{name}_{kind}" for name in units for kind in kinds)]}
        )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor desugar first, as CommDebugMode does
        out = func(*args, **(kwargs or {}))
        kind = _collective_kind(func)
        if kind:
            self.counts[kind] += 1
            numel = _unsharded_numel([*args, *(kwargs or {}).values()])
            for name, size in self.units.items():
                self.counts[f"{name}_{kind}"] += numel == size
        return out

    def line(self) -> str:
        return " ".join(f"{key}={n}" for key, n in self.counts.items())


def _collective_kind(func) -> str | None:
    if func.namespace not in ("c10d", "_c10d_functional"):
        return None
    name = func._overloadpacket.__name__
    if "allgather" in name or "all_gather" in name:
        return "all_gather"
    return "reduce_scatter" if "reduce_scatter" in name else None


def _unsharded_numel(values) -> int:
    """The largest tensor or tensor list among a collective's arguments: the all-gather's
    output, the reduce-scatter's input."""

    def numel(value) -> int:
        if isinstance(value, torch.Tensor):
            return value.numel()
        if isinstance(value, (list, tuple)):
            return sum(numel(v) for v in value)
        return 0

    return max((numel(v) for v in values), default=0)
