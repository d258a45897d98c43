"""``torch.utils.checkpoint(..., use_reentrant=True)`` inside each unit and around
each FSDP1 unit (part of ``tests/real_stacks/cases_real_stacks.py``).

FSDP1 FULL_SHARD (both use_orig_params), SHARD_GRAD_OP and NO_SHARD, every option,
2 passes and 3 with zero_grad between, and ``backwards=3``; FSDP2 inside only
(``fully_shard``'s hooks are module hooks). Parity via ``tests.support.parity.run_parity``.
"""

from __future__ import annotations

import functools
import itertools

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.utils.checkpoint import checkpoint

from tests.support import fsdp1_utils as f1
from tests.support import fsdp2_utils as f2
from tests.support.case_parts import covering
from tests.support.harness import Registry
from tests.support.parity import Block, Scenario, block_options, make_net, reference_copy, run_parity, world
from tests.support.real_stacks_hf import OPTIONS, STEPS, _opt_tag

registry = Registry()


# --- torch.utils.checkpoint(use_reentrant=True) around and inside units -------


class Reentrant(nn.Module):
    """``checkpoint(module, x, use_reentrant=True)``: around an FSDP1 unit when
    ``module`` is one."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.module, x, use_reentrant=True)


class ReentrantBlock(Block):
    """A ``Block`` whose body is reentrant-checkpointed inside the unit."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(super().forward, x, use_reentrant=True)


def _checkpointed(where: str, backend: str, strategy, uop: bool):
    model = make_net()
    if where == "inside":
        for block in model.blocks:
            block.__class__ = ReentrantBlock
    ref = reference_copy(model)
    if where == "around":
        for i, block in enumerate(ref.blocks):
            ref.blocks[i] = Reentrant(block)
    if backend == "fsdp2":
        mesh = init_device_mesh("cpu", (world(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped, adapter = model, f2.ADAPTER
    else:
        policy = ModuleWrapPolicy({ReentrantBlock if where == "inside" else Block})
        wrapped = FSDP(
            model, auto_wrap_policy=policy, sharding_strategy=strategy,
            use_orig_params=uop, device_id=torch.device("cpu"),
        )
        adapter = f1.ADAPTER
    if where == "around":
        for i, block in enumerate(wrapped.blocks):
            wrapped.blocks[i] = Reentrant(block)
    return wrapped, ref, adapter


def _torch_reentrant_case(
    where, backend, strategy, uop, keep, sync, passes, zero_between, backwards=None
):
    model, ref, adapter = _checkpointed(where, backend, strategy, uop)
    scenario = Scenario(
        passes=passes,
        zero_between=zero_between,
        steps=STEPS,
        options=block_options(keep, sync, backwards),
        check_between=sync == "every",
    )
    run_parity(model, ref, scenario, adapter)


def _add_torch_reentrant_cases() -> None:
    fsdp1 = [(f1.FULL, uop) for uop in (True, False)] + [
        (f1.GRAD_OP, True), (f1.NO_SHARD, True), (f1.NO_SHARD, False)
    ]
    # Every 3 of (FSDP1 flavour, keep, sync, passes) meet in each combination of their
    # values: 20 of the 40 per place.
    grid = covering(dict(flavour=fsdp1, keep=(True, False), sync=("every", "last"),
                         run=((2, False), (3, True))), strength=3)
    for where in ("inside", "around"):
        for row in grid:
            (strategy, uop), keep, sync = row["flavour"], row["keep"], row["sync"]
            passes, zero_between = row["run"]
            name = (
                f"torch_reentrant_{where}_fsdp1_{f1.STRATEGY_NAMES[strategy]}_"
                f"{'orig' if uop else 'flat'}_{_opt_tag(keep, sync)}_p{passes}"
                f"{'_zero' if zero_between else ''}"
            )
            fn = functools.partial(
                _torch_reentrant_case, where, "fsdp1", strategy, uop, keep, sync,
                passes, zero_between,
            )
            registry.add(name, fn)
        # backwards=N: the last pass reduces what it accumulates into, the rest is
        # reduced at exit; reentrant units accumulate only inside the recompute.
        for uop, keep in itertools.product((True, False), (True, False)):
            name = (
                f"torch_reentrant_{where}_fsdp1_full_{'orig' if uop else 'flat'}_"
                f"{_opt_tag(keep, 'last')}_backwards3"
            )
            fn = functools.partial(
                _torch_reentrant_case, where, "fsdp1", f1.FULL, uop, keep, "last", 3, True, 3
            )
            registry.add(name, fn)
        if where == "around":
            continue  # fully_shard's hooks are module hooks: no "around" for FSDP2
        for keep, sync in OPTIONS:
            name = f"torch_reentrant_{where}_fsdp2_{_opt_tag(keep, sync)}"
            fn = functools.partial(
                _torch_reentrant_case, where, "fsdp2", None, False, keep, sync, 2, False
            )
            registry.add(name, fn)


_add_torch_reentrant_cases()
