"""Parity helpers shared by the FSDP1 and FSDP2 case modules (run inside ranks).

The reference is an unsharded copy of the model (deep-copied before wrapping,
weights from seed 42). Every rank feeds it the same local batch as the FSDP
model (seed ``42 + rank + 1`` plus the step), then averages the reference
gradients over ranks, which is what FSDP's reduce-scatter computes.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_retain import no_reshard_between_backwards
from fsdp_retain._measure import CollectiveCounts, count_collectives

DIM = 12
BATCH = 6
TOL = dict(rtol=1e-5, atol=1e-5)


def rank() -> int:
    return dist.get_rank()


def world() -> int:
    return dist.get_world_size()


def device() -> torch.device:
    """The ranks' device: the current CUDA device under NCCL (``scripts/gpu_validate.py``),
    else the CPU (the suite, on gloo)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Block(nn.Module):
    """Residual MLP block; the hidden width (2d+1) does not divide by world size."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim + 1)
        self.fc2 = nn.Linear(2 * dim + 1, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, dim: int = DIM, depth: int = 3, tied: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim, bias=False)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.out = nn.Linear(dim, dim, bias=False)
        if tied:
            self.out.weight = self.inp.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def make_net(depth: int = 3, tied: bool = False, dim: int = DIM) -> Net:
    torch.manual_seed(42)
    return Net(dim, depth, tied).to(device())


def batch(step: int, dim: int = DIM) -> torch.Tensor:
    gen = torch.Generator().manual_seed(42 + rank() + 1 + 1000 * step)
    return torch.randn(BATCH, dim, generator=gen).to(device())


def _loss0(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def _loss1(out: torch.Tensor) -> torch.Tensor:
    weight = torch.linspace(-1.0, 1.0, out.shape[-1], device=out.device)
    return (torch.tanh(out) * weight).sum() / out.shape[0]


def _loss2(out: torch.Tensor) -> torch.Tensor:
    return out.logsumexp(-1).mean()


LOSSES: list[Callable[[torch.Tensor], torch.Tensor]] = [_loss0, _loss1, _loss2]

# (keep_unsharded, sync_grads) pairs, for cases that loop over the options.
OPTION_GRID = [(True, "every"), (True, "last"), (False, "every"), (False, "last")]


def block_options(keep: bool, sync: str, backwards: int | None = None) -> dict:
    return dict(keep_unsharded=keep, sync_grads=sync, backwards=backwards)


def penalty_step(model: nn.Module, x: torch.Tensor, block) -> None:
    """A gradient penalty: ``create_graph=True`` w.r.t. the input, then one backward."""
    x = x.clone().requires_grad_()
    with block:
        out = model(x)
        loss = out.pow(2).mean()
        (grad_x,) = torch.autograd.grad(loss, x, create_graph=True)
        (loss + grad_x.pow(2).sum()).backward()


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def averaged_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each gradient averaged over ranks: one all-reduce of them all, flattened."""
    named = {n: p.grad.detach() for n, p in model.named_parameters() if p.grad is not None}
    if not named:
        return {}
    flat = torch.cat([g.reshape(-1) for g in named.values()])
    dist.all_reduce(flat)
    flat /= world()
    out, offset = {}, 0
    for name, grad in named.items():
        out[name] = flat[offset:offset + grad.numel()].view(grad.shape).clone()
        offset += grad.numel()
    return out


@dataclasses.dataclass
class Scenario:
    """One training step with ``passes`` backward passes over one forward."""

    passes: int = 2
    zero_between: bool = False
    steps: int = 3
    options: dict = dataclasses.field(default_factory=dict)
    use_block: bool = True
    check_between: bool = True  # compare .grad after each pass ("every" only)
    zero_before: tuple[int, ...] | None = None  # passes preceded by zero_grad()
    dim: int = DIM  # input width
    probe_first: bool = False  # pass 1 a probe pass (block.backward(param_grads=False))
    # Called with (model, block) after each pass but the last, inside the block.
    between: Callable[[nn.Module, Any], None] | None = None

    def zeroes_before(self, index: int) -> bool:
        if self.zero_before is not None:
            return index in self.zero_before
        return self.zero_between and index > 0

    def describe(self) -> str:
        return (
            f"passes={self.passes} zero_between={self.zero_between} "
            f"zero_before={self.zero_before} probe_first={self.probe_first} "
            f"options={self.options} use_block={self.use_block}"
        )


@dataclasses.dataclass
class Adapter:
    """How to read full parameters and gradients of a wrapped model."""

    full_params: Callable[[nn.Module], dict[str, torch.Tensor]]
    full_grads: Callable[[nn.Module], dict[str, torch.Tensor]]


def step_averaged(model: nn.Module, opt) -> dict[str, torch.Tensor]:
    """An optimizer step of the reference on its gradients averaged over ranks (the union
    batch), then ``zero_grad``; returns those averaged gradients."""
    grads = averaged_grads(model)
    for name, param in model.named_parameters():
        grad = grads.get(name)
        param.grad = None if grad is None else grad.clone()
    opt.step()
    opt.zero_grad()
    return grads


def reference_step(ref: nn.Module, opt, x: torch.Tensor, scenario: Scenario):
    """Runs the scenario on the unsharded reference; returns losses and per-pass grads
    (a probe pass adds none)."""
    out = ref(x)
    losses, grads_after_pass = [], []
    for i in range(scenario.passes):
        if scenario.zeroes_before(i):
            opt.zero_grad()
        loss = LOSSES[i % len(LOSSES)](out)
        if not (scenario.probe_first and i == 0):
            loss.backward(retain_graph=i < scenario.passes - 1)
        losses.append(loss.detach())
        grads_after_pass.append(averaged_grads(ref))
    final = grads_after_pass[-1]
    for name, param in ref.named_parameters():
        param.grad = final[name].clone() if name in final else None
    opt.step()
    opt.zero_grad()
    return losses, grads_after_pass


def fsdp_step(
    model: nn.Module, opt, x: torch.Tensor, scenario: Scenario, adapter: Adapter
):
    """Runs the scenario on the FSDP model; returns losses, per-pass grads, counts
    (marked by phase: "forward", "pass1", "pass2", ..., "exit")."""
    losses, grads_after_pass = [], []
    block = (
        no_reshard_between_backwards(model, **scenario.options)
        if scenario.use_block
        else contextlib.nullcontext()
    )
    with count_collectives() as counts:
        with block as retain:
            counts.mark("forward")
            out = model(x)
            for i in range(scenario.passes):
                counts.mark(f"pass{i + 1}")
                if scenario.zeroes_before(i):
                    opt.zero_grad()
                loss = LOSSES[i % len(LOSSES)](out)
                if scenario.probe_first and i == 0:
                    retain.backward(loss, param_grads=False, retain_graph=True)
                else:
                    loss.backward(retain_graph=i < scenario.passes - 1)
                losses.append(loss.detach())
                if scenario.between is not None and i < scenario.passes - 1:
                    scenario.between(model, retain)
                if scenario.check_between and i < scenario.passes - 1:
                    with counts.excluded():
                        grads_after_pass.append(adapter.full_grads(model))
            counts.mark("exit")
    grads_after_pass.append(adapter.full_grads(model))
    opt.step()
    opt.zero_grad()
    return losses, grads_after_pass, counts


_PLAIN = (torch.Tensor, nn.Parameter)


def _plainly_close(actual: dict, expected: dict, rtol: float, atol: float) -> bool:
    """True where every pair is two plain fp32 (or fp64) strided tensors of one shape,
    dtype and device whose values are all close (``torch.isclose``: what
    ``torch.testing.assert_close`` checks of such a pair), in one comparison of them all
    concatenated: assert_close's per-pair checks cost about 4% of the case launches' time.
    Anything else, or any value not close, is left to assert_close and its message."""
    flat: dict[torch.dtype, tuple[list, list]] = {}
    for name, want in expected.items():
        got = actual[name]
        if not (type(got) in _PLAIN and type(want) in _PLAIN and got.shape == want.shape
                and got.dtype == want.dtype in (torch.float32, torch.float64)
                and got.device == want.device
                and got.layout == want.layout == torch.strided):
            return False
        pair = flat.setdefault(got.dtype, ([], []))
        pair[0].append(got.detach().reshape(-1))
        pair[1].append(want.detach().reshape(-1))
    return all(bool(torch.isclose(torch.cat(got), torch.cat(want), rtol=rtol, atol=atol).all())
               for got, want in flat.values())


def assert_close_dicts(actual, expected, what: str, tol: dict | None = None) -> None:
    """Every tensor of ``actual`` close to ``expected``'s of its name (``tol``, default
    ``TOL``), as ``torch.testing.assert_close`` checks and words it."""
    tol = TOL if tol is None else tol
    missing = set(expected) ^ set(actual)
    assert not missing, f"{what}: names differ: {sorted(missing)}"
    if _plainly_close(actual, expected, **tol):
        return
    for name in expected:
        torch.testing.assert_close(
            actual[name],
            expected[name],
            **tol,
            msg=lambda m, name=name: f"{what}: {name}: {m}",
        )


def run_parity(
    fsdp_model: nn.Module,
    ref_model: nn.Module,
    scenario: Scenario,
    adapter: Adapter,
    expect_counts: Callable[[CollectiveCounts], None] | None = None,
) -> list[CollectiveCounts]:
    """Trains both models ``scenario.steps`` steps and compares after every step."""
    fsdp_opt, ref_opt = sgd(fsdp_model), sgd(ref_model)
    all_counts = []
    for step in range(scenario.steps):
        x = batch(step, scenario.dim)
        ref_losses, ref_grads = reference_step(ref_model, ref_opt, x, scenario)
        losses, grads, counts = fsdp_step(fsdp_model, fsdp_opt, x, scenario, adapter)
        all_counts.append(counts)
        where = f"step {step} ({scenario.describe()})"
        for i, (a, b) in enumerate(zip(losses, ref_losses)):
            torch.testing.assert_close(a, b, **TOL, msg=f"{where}: loss {i}")
        if scenario.check_between:
            for i, (a, b) in enumerate(zip(grads, ref_grads)):
                assert_close_dicts(a, b, f"{where}: grads after pass {i + 1}")
        else:
            assert_close_dicts(grads[-1], ref_grads[-1], f"{where}: final grads")
        ref_params = {n: p.detach() for n, p in ref_model.named_parameters()}
        assert_close_dicts(adapter.full_params(fsdp_model), ref_params, f"{where}: params")
        if expect_counts is not None:
            expect_counts(counts)
    return all_counts


def reference_copy(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)
