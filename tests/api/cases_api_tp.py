"""FSDP2 x tensor parallelism on a 2-D (dp, tp) mesh, 4 ranks (CPU, gloo).

Run inside ranks by ``tests/api/test_api_tp.py``. The model: each block's ``fc1``
``ColwiseParallel`` and ``fc2`` ``RowwiseParallel`` on ``tp``, then
``fully_shard(..., mesh=mesh["dp"])`` per block and on the root, so the
unsharded parameters FSDP2 gathers are DTensors over the ``tp`` mesh. The
reference is the unsharded model on every rank, fed the batch of the rank's dp
group (the two tp ranks of a dp group see the same data), its gradients
averaged over the ranks (over dp: tp ranks hold equal ones); SGD with
momentum, compared after every step.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

from fsdp_retain import no_reshard_between_backwards
from fsdp_retain._fsdp2._compat import unsharded_bytes
from fsdp_retain._fsdp2._inspect import fsdp2_all_sharded, fsdp2_param_groups
from fsdp_retain._measure import count_collectives
from tests.support import fsdp2_utils as f2
from tests.support.harness import Registry
from tests.support.parity import (
    BATCH,
    DIM,
    LOSSES,
    assert_close_dicts,
    averaged_grads,
    rank,
    reference_copy,
    sgd,
)

registry = Registry()
TP = 2
HIDDEN = 2 * DIM  # divides by TP
STEPS = 2
_AG_PER_UNIT = 1  # FSDP2 all-gathers one unit with one collective


class TPBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class TPNet(nn.Module):
    def __init__(self, depth: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM, bias=False)
        self.blocks = nn.ModuleList(TPBlock() for _ in range(depth))
        self.out = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def make_tp_net() -> TPNet:
    torch.manual_seed(42)
    return TPNet()


def wrap_2d(model: TPNet, loss_parallel_out: bool = False, hsdp: bool = False) -> TPNet:
    """FSDP over ``dp`` x TP over ``tp`` on 4 ranks; with ``hsdp``, HSDP over
    ``(replicate, shard)`` x TP on 8 ranks (a 3-D mesh)."""
    if hsdp:
        mesh = init_device_mesh("cpu", (2, 2, TP), mesh_dim_names=("replicate", "shard", "tp"))
        dp_mesh = mesh["replicate", "shard"]
    else:
        mesh = init_device_mesh("cpu", (4 // TP, TP), mesh_dim_names=("dp", "tp"))
        dp_mesh = mesh["dp"]
    plan: dict = {}
    for i in range(len(model.blocks)):
        plan[f"blocks.{i}.fc1"] = ColwiseParallel()
        plan[f"blocks.{i}.fc2"] = RowwiseParallel()
    if loss_parallel_out:
        plan["out"] = ColwiseParallel(use_local_output=False)
    parallelize_module(model, mesh["tp"], plan)
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def dp_batch(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(42 + rank() // TP + 1 + 1000 * step)
    return torch.randn(BATCH, DIM, generator=gen)


def _train(model, ref, options: dict | None, passes: int = 2, probe: bool = False,
           loss_fns=LOSSES) -> list:
    """``STEPS`` steps of ``passes`` backwards over one forward (a probe pass
    first if ``probe``), compared with the reference after every step."""
    opt, ref_opt = sgd(model), sgd(ref)
    counts_per_step = []
    for step in range(STEPS):
        x = dp_batch(step)
        out = ref(x)
        for i in range(passes):
            loss_fns[i % len(loss_fns)](out).backward(retain_graph=i < passes - 1)
        ref_losses = [float(f(out).detach()) for f in loss_fns[:passes]]
        for name, grad in averaged_grads(ref).items():
            ref.get_parameter(name).grad = grad
        ref_opt.step()
        ref_opt.zero_grad()
        with count_collectives() as counts:
            with no_reshard_between_backwards(model, **(options or {})) as block:
                out = model(x)
                if probe:
                    block.backward(out.pow(2).mean(), param_grads=False, retain_graph=True)
                losses = []
                for i in range(passes):
                    loss = loss_fns[i % len(loss_fns)](out)
                    block.backward(loss, retain_graph=i < passes - 1)
                    losses.append(float(loss))
        counts_per_step.append(counts)
        assert fsdp2_all_sharded(model), f"step {step}: not resharded at exit"
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-5)
        grads = f2.full_grads(model)
        opt.step()
        opt.zero_grad()
        where = f"step {step} options={options} probe={probe}"
        assert grads, where
        assert_close_dicts(f2.full_params(model),
                           {n: p.detach() for n, p in ref.named_parameters()}, where)
    return counts_per_step


def _case(options: dict, probe: bool = False, hsdp: bool = False) -> None:
    if probe and options.get("backwards"):
        options = dict(options, backwards=options["backwards"] + 1)  # the probe counts
    ref = reference_copy(make_tp_net())
    model = wrap_2d(make_tp_net(), hsdp=hsdp)
    counts = _train(model, ref, options, probe=probe)
    assert all(c.all_gather > 0 for c in counts)


GRID = [
    ("keep", dict(keep_unsharded=True)),
    ("free", dict(keep_unsharded=False)),
    ("keep_last", dict(keep_unsharded=True, sync_grads="last", backwards=2)),
    ("free_last", dict(keep_unsharded=False, sync_grads="last")),
    ("free_every_backwards", dict(keep_unsharded=False, backwards=2)),
]


def _register(name: str, options: dict) -> None:
    def run() -> None:
        _case(options)
        _case(options, probe=True)

    registry.add(f"tp_2d_{name}", run, world_sizes=(4,))


for _name, _options in GRID:
    _register(_name, _options)


@registry.case(world_sizes=(4,))
def tp_2d_budget_counts_local_bytes() -> None:
    """A budget counts the bytes a rank holds: the tp-local unsharded block
    (fc1 and fc2's weight split over tp, fc2's bias replicated), and a budget
    of one such block keeps what fits in it."""
    model = wrap_2d(make_tp_net())
    model(dp_batch(0)).sum().backward()  # lazy init
    model.zero_grad()
    full = sum(p.numel() * 4 for p in make_tp_net().blocks[0].parameters())
    local = (full - DIM * 4) // TP + DIM * 4
    groups = fsdp2_param_groups(model.blocks[0])
    assert [unsharded_bytes(g) for g in groups] == [local], (groups, local)
    ref = reference_copy(make_tp_net())
    counts = _train(model, ref, dict(keep_unsharded=local))
    keep = _train(wrap_2d(make_tp_net()), reference_copy(make_tp_net()),
                  dict(keep_unsharded=True))
    free = _train(wrap_2d(make_tp_net()), reference_copy(make_tp_net()),
                  dict(keep_unsharded=False))
    # Per byte a block avoids more all-gathers (2 a step: its pass-1 and pass-2
    # re-gathers) than the root (inp + out: 2 * DIM * DIM * 4 bytes, over half a local
    # block; 1: FSDP keeps it through pass 1): the budget keeps the last block, which
    # fills it, not the root. Two all-gathers fewer than keep_unsharded=False.
    root = 2 * DIM * DIM * 4
    assert local // 2 < root <= local
    for c, k, f in zip(counts, keep, free):
        assert c.all_gather == f.all_gather - 2 * _AG_PER_UNIT > k.all_gather, (
            k.all_gather, c.all_gather, f.all_gather)


@registry.case(world_sizes=(8,))
def hsdp_tp_3d_options() -> None:
    """HSDP (replicate 2 x shard 2) x TP 2 on 8 ranks: keep, free, a budget and
    ``sync_grads="last"`` with ``backwards``, each with a probe pass first."""
    for options in (dict(keep_unsharded=True), dict(keep_unsharded=False),
                    dict(keep_unsharded=2 * DIM * DIM * 4),
                    dict(keep_unsharded=False, sync_grads="last", backwards=2)):
        _case(options, probe=True, hsdp=True)


def _ce(out: torch.Tensor) -> torch.Tensor:
    target = torch.arange(out.shape[0]) % DIM
    return F.cross_entropy(out, target)


@registry.case(world_sizes=(4,))
def tp_2d_loss_parallel() -> None:
    """``loss_parallel`` over a ``ColwiseParallel(use_local_output=False)``
    output: the logits stay sharded on tp; two backwards, keep and free."""
    for options in (dict(keep_unsharded=True), dict(keep_unsharded=False)):
        ref = reference_copy(make_tp_net())
        model = wrap_2d(make_tp_net(), loss_parallel_out=True)
        opt, ref_opt = sgd(model), sgd(ref)
        for step in range(STEPS):
            x = dp_batch(step)
            ref_out = ref(x)
            ref_losses = []
            for i in range(2):
                loss = _ce(ref_out * (i + 1))
                loss.backward(retain_graph=i == 0)
                ref_losses.append(float(loss))
            for name, grad in averaged_grads(ref).items():
                ref.get_parameter(name).grad = grad
            ref_opt.step()
            ref_opt.zero_grad()
            with no_reshard_between_backwards(model, **options) as block:
                out = model(x)
                assert isinstance(out, DTensor)
                losses = []
                for i in range(2):
                    with loss_parallel():
                        loss = _ce(out * (i + 1))
                        block.backward(loss, retain_graph=i == 0)
                    losses.append(float(loss.full_tensor() if isinstance(loss, DTensor)
                                        else loss))
            torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-5)
            opt.step()
            opt.zero_grad()
            assert_close_dicts(f2.full_params(model),
                               {n: p.detach() for n, p in ref.named_parameters()},
                               f"loss_parallel step {step} {options}")


@registry.case(world_sizes=(4,))
def tp_2d_block_grads_pcgrad() -> None:
    """``block.grads`` on FSDP2 x TP: the Gramian counts each element once over the
    (dp, tp) mesh (TP shards summed, TP-replicated parameters such as ``inp`` and the
    biases of ``fc2`` not counted twice), so PCGrad's weights, each parameter's norm by
    name and the trunk's norm equal the one-process method's (3 losses, 3 steps)."""
    import fsdp_retain
    from fsdp_retain import no_reshard_between_backwards
    from tests.loss_grads.cases_loss_grads import pcgrad_weights

    ref = reference_copy(make_tp_net())
    model = wrap_2d(make_tp_net())
    opt, ref_opt = sgd(model), sgd(ref)
    names = [n for n, _ in ref.named_parameters()]
    for step in range(3):
        x = dp_batch(step)
        out = ref(x)
        per_loss = []
        for fn in LOSSES:
            grads = torch.autograd.grad(fn(out), list(ref.parameters()), retain_graph=True)
            flat = torch.cat([g.reshape(-1) for g in grads])
            torch.distributed.all_reduce(flat)
            per_loss.append(flat / torch.distributed.get_world_size())
        rows = torch.stack(per_loss).double()
        ref_gram = rows @ rows.T
        weights = pcgrad_weights(ref_gram)
        combined = sum(float(w) * g for w, g in zip(weights, per_loss))
        offset = 0
        ref_norms = {}
        for name, p in ref.named_parameters():
            p.grad = combined[offset:offset + p.numel()].view_as(p).clone()
            ref_norms[name] = per_loss[0][offset:offset + p.numel()].double().norm()
            offset += p.numel()
        ref_opt.step()
        ref_opt.zero_grad()
        with no_reshard_between_backwards(model) as block:
            out = model(x)
            grads = [block.grads(fn(out), retain_graph=True) for fn in LOSSES]
            gram = fsdp_retain.gramian(grads)
            norms = grads[0].norms()
            trunk = grads[0].select(model.blocks).norm()
            fsdp_retain.apply_grads(fsdp_retain.combine(grads, pcgrad_weights(gram)))
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(gram, ref_gram, rtol=1e-6, atol=1e-6 * float(ref_gram.abs().max()))
        assert sorted(norms) == sorted(names), (list(norms), names)
        for name in names:
            torch.testing.assert_close(norms[name], ref_norms[name], rtol=1e-6, atol=1e-9)
        want = sum(float(v) ** 2 for n, v in ref_norms.items() if n.startswith("blocks.")) ** 0.5
        torch.testing.assert_close(float(trunk), want, rtol=1e-6, atol=1e-9)
        assert_close_dicts(f2.full_params(model),
                           {n: p.detach() for n, p in ref.named_parameters()}, f"step {step}")
