"""FSDP2 with tensor parallelism, and the user's own FSDP2 reshard settings (part of
``tests/cases_api.py``).

- **FSDP2 x TP on a 2 x 2 mesh** (world size 4): ``parallelize_module`` with
  ``ColwiseParallel`` / ``RowwiseParallel`` on each block's MLP over ``mesh["tp"]``,
  ``fully_shard(..., mesh=mesh["dp"])`` per block and the root. The unsharded
  parameters are DTensors over the tp dimension, whose wrapper reports a storage of
  its own: the block read that instead of the local tensor's, and with
  ``keep_unsharded=False`` or a budget the forward crashed (``setStorage``). Every
  option, a probe pass, and loss parallel (``loss_parallel()`` over a
  ``ColwiseParallel(use_local_output=False)`` head); parity with an unsharded
  reference (each dp rank's batch, gradients averaged over ranks) over 3 steps.
- **The user's ``set_reshard_after_backward(False)``** (the accumulation recipe: keep
  the parameters gathered across micro-batches, with ``reshard_after_forward=False``):
  the block used to reshard every group at exit, so the next micro-batch gathered
  everything again. Now a group its owner keeps gathered stays gathered (showing its
  unsharded parameters, as after a plain backward): over 2 micro-batches of 2 passes
  each, one all-gather per unit in all, as plain FSDP2; parity over 3 steps.
"""

from __future__ import annotations

import copy
import itertools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from fsdp_retain import no_reshard_between_backwards
from fsdp_retain._fsdp2_inspect import fsdp2_param_groups
from fsdp_retain._measure import count_collectives
from tests import fsdp2_utils as f2
from tests.harness import Registry
from tests.parity import LOSSES, assert_close_dicts, averaged_grads, batch, make_net, sgd

registry = Registry()
DIM = 12
STEPS = 3


class MLPBlock(nn.Module):
    """Residual MLP whose hidden width (4 x DIM) splits evenly over tp ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 4 * DIM)
        self.fc2 = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


class TPNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(42)
        self.blocks = nn.ModuleList(MLPBlock() for _ in range(3))
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _tp_fsdp(loss_parallel: bool):
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    net = TPNet()
    ref = copy.deepcopy(net)
    for block in net.blocks:
        parallelize_module(block, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    if loss_parallel:
        parallelize_module(net, mesh["tp"], {"out": ColwiseParallel(use_local_output=False)})
    for block in net.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(net, mesh=mesh["dp"])
    return net, ref, mesh


def _dp_batch(mesh, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The dp rank's batch: the tp ranks of one dp group see the same data."""
    dp = mesh["dp"].get_local_rank()
    gen = torch.Generator().manual_seed(42 + dp + 1 + 1000 * step)
    return torch.randn(6, DIM, generator=gen), torch.randint(0, DIM, (6,), generator=gen)


def _ce_losses(out, labels) -> list:
    return [F.cross_entropy(out, labels), F.cross_entropy(out * 0.5, labels.flip(0))]


def _tp_parity(options: dict, probe: bool = False, loss_parallel: bool = False) -> None:
    model, ref, mesh = _tp_fsdp(loss_parallel)
    opt, ref_opt = sgd(model), sgd(ref)
    if loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel as loss_ctx
    else:
        import contextlib

        loss_ctx = contextlib.nullcontext
    for step in range(STEPS):
        x, labels = _dp_batch(mesh, step)
        out = ref(x)
        losses = _ce_losses(out, labels) if loss_parallel else [LOSSES[0](out), LOSSES[1](out)]
        (losses[1] if probe else losses[0] + losses[1]).backward()
        grads = averaged_grads(ref)
        for name, param in ref.named_parameters():
            param.grad = grads[name]
        ref_opt.step()
        ref_opt.zero_grad()
        with no_reshard_between_backwards(model, **options) as block:
            out = model(x)
            with loss_ctx():
                if loss_parallel:
                    losses = _ce_losses(out, labels)
                else:
                    losses = [LOSSES[0](out), LOSSES[1](out)]
                if probe:
                    block.backward(losses[0], param_grads=False, retain_graph=True)
                else:
                    losses[0].backward(retain_graph=True)
                losses[1].backward()
            assert block.backward_passes == 2
        opt.step()
        opt.zero_grad()
        ref_params = {n: p.detach() for n, p in ref.named_parameters()}
        assert_close_dicts(f2.ADAPTER.full_params(model), ref_params, f"step {step}: params")


_TP_OPTIONS = {
    "keep_every": dict(),
    "keep_last": dict(sync_grads="last"),
    "regather_every": dict(keep_unsharded=False),
    "regather_last_b2": dict(keep_unsharded=False, sync_grads="last", backwards=2),
    "budget_every_b2": dict(keep_unsharded=1, backwards=2),
    "budget_last": dict(keep_unsharded=1, sync_grads="last"),
}
for (_name, _options), _probe in itertools.product(_TP_OPTIONS.items(), (False, True)):
    registry.add(
        f"fsdp2_tp_2x2_{_name}{'_probe' if _probe else ''}",
        lambda o=_options, p=_probe: _tp_parity(o, p),
        world_sizes=(4,),
    )
for _name in ("keep_every", "regather_every", "budget_last"):
    registry.add(
        f"fsdp2_tp_2x2_loss_parallel_{_name}",
        lambda o=_TP_OPTIONS[_name]: _tp_parity(o, loss_parallel=True),
        world_sizes=(4,),
    )


# --- the user's reshard_after_backward -----------------------------------------


def _accumulation_recipe(options: dict, expected: tuple[int, int]) -> None:
    """2 micro-batches x 2 passes with the user keeping parameters gathered: the
    all-gathers of each micro-batch, in units (``expected``): one per unit in all
    with ``keep_unsharded=True``, as plain FSDP2. ``keep_unsharded=False`` re-gathers
    for pass 2; its last pass, when known (``backwards=2``), leaves the groups
    gathered for the next micro-batch."""
    net = make_net()
    ref = copy.deepcopy(net)
    model = f2.wrap(net, reshard_after_forward=False)
    model.set_reshard_after_backward(False)
    opt, ref_opt = sgd(model), sgd(ref)
    units = f2.units(model)
    for step in range(STEPS):
        micro = [batch(2 * step), batch(2 * step + 1)]
        for x in micro:
            out = ref(x)
            (LOSSES[0](out) + LOSSES[1](out)).backward()
        grads = averaged_grads(ref)
        for name, param in ref.named_parameters():
            param.grad = grads[name]
        ref_opt.step()
        ref_opt.zero_grad()
        gathers = 0
        seen = []
        for i, x in enumerate(micro):
            model.set_requires_gradient_sync(i == len(micro) - 1)
            with count_collectives() as counts:
                with no_reshard_between_backwards(model, **options):
                    out = model(x)
                    LOSSES[0](out).backward(retain_graph=True)
                    LOSSES[1](out).backward()
            gathers += counts.all_gather
            seen.append(counts.all_gather)
            if options.get("keep_unsharded", True) or options.get("backwards"):
                groups = fsdp2_param_groups(model)
                assert all(g.is_unsharded for g in groups), "a group the user keeps was resharded"
                weight = model.blocks[0].fc1.weight
                assert not hasattr(weight, "to_local"), "the modules show sharded parameters"
        want = [e * units for e in expected]
        assert seen == want, f"step {step}: {seen} all-gathers, expected {want}"
        for module in model.modules():  # FSDPModule.reshard() is per module
            if isinstance(module, FSDPModule):
                module.reshard()
        opt.step()
        opt.zero_grad()
        ref_params = {n: p.detach() for n, p in ref.named_parameters()}
        assert_close_dicts(f2.ADAPTER.full_params(model), ref_params, f"step {step}: params")
    dist.barrier()


for _name, _options, _expected in (
    ("keep_every", dict(), (1, 0)),
    ("keep_last", dict(sync_grads="last"), (1, 0)),
    ("keep_every_b2", dict(backwards=2), (1, 0)),
    ("regather_every", dict(keep_unsharded=False), (2, 2)),
    ("regather_every_b2", dict(keep_unsharded=False, backwards=2), (2, 1)),
):
    registry.add(
        f"user_reshard_after_backward_false_{_name}",
        lambda o=_options, e=_expected: _accumulation_recipe(o, e),
    )


@registry.case(world_sizes=(4,))
def fsdp2_tp_block_grads_refused() -> None:
    """``block.grads`` needs the shards of one mesh dimension (a Gramian over TP
    shards and replicas would count some twice): refused, naming why; the step goes on."""
    model, _, mesh = _tp_fsdp(False)
    x, _ = _dp_batch(mesh, 0)
    with no_reshard_between_backwards(model) as block:
        out = model(x)
        try:
            block.grads(LOSSES[0](out), retain_graph=True)
        except ValueError as e:
            assert "tensor parallelism" in str(e), e
        else:
            raise AssertionError("block.grads ran over TP-sharded parameters")
        assert block.backward_passes == 0
        LOSSES[1](out).backward()
