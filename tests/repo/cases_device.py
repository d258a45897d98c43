"""Parity and collective cases for any world size and device, run inside ranks by
``scripts/gpu_validate.py`` (NCCL, one GPU per rank; ``--dry-run``: CPU, gloo).

The device is chosen at run time (``tests.support.parity.device``): the suite's parity
helpers, reference model, losses and collective formulas, on CUDA under NCCL.
Every case is registered for world sizes 1 to 8. At world size 1 FSDP2 shards
over a mesh of one rank and FSDP1 runs ``NO_SHARD`` (what FSDP1 falls back to);
both still match the reference. Per backend (FSDP2, FSDP1) and
``keep_unsharded`` x ``sync_grads``:

- ``*_fp32_parity_*``: 3 passes over one forward, 3 SGD-momentum steps, losses,
  gradients and parameters against the unsharded reference after every step,
  all-gathers / reduce-scatters / all-reduces against the suite's formulas;
- ``*_bf16_vs_two_forward_*``: bf16 parameters with fp32 reduction (FSDP2
  ``MixedPrecisionPolicy``, FSDP1 ``MixedPrecision``) against the same model
  trained the two-forward way; ``sync_grads="every"`` is the same arithmetic
  (1e-5), ``"last"`` sums bf16 gradients before one reduction (rtol 1e-2,
  atol 1e-3);
- ``*_probe_*``: a probe pass (``param_grads=False``) then a normal pass: the
  activation gradients of the probe pass and the final gradients against the
  reference, and no reduction in the probe pass;
- ``*_check_saved_tensors``: parity with ``check_saved_tensors=True`` (no false
  alarm), and a saved tensor overwritten in place between passes is caught.
"""

from __future__ import annotations

import functools
import itertools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy

from fsdp_retain import no_reshard_between_backwards
from fsdp_retain._measure import count_collectives
from tests.support import fsdp1_utils as f1
from tests.support import fsdp2_utils as f2
from tests.support.harness import Registry
from tests.support.parity import (
    BATCH,
    DIM,
    LOSSES,
    OPTION_GRID,
    Scenario,
    assert_close_dicts,
    averaged_grads,
    batch,
    block_options,
    device,
    make_net,
    rank,
    reference_copy,
    run_parity,
    sgd,
    world,
)

registry = Registry()
WORLD_SIZES = tuple(range(1, 9))
PASSES = 3
BF16_TOL = {"every": dict(rtol=1e-5, atol=1e-5), "last": dict(rtol=1e-2, atol=1e-3)}


class InplaceLogProb(torch.autograd.Function):
    """``log_softmax(logits).gather(labels)`` whose backward overwrites the saved logits
    (flash-attn's ``inplace_backward``). The same as ``tests/api/cases_integrity.py``'s, which
    imports pytest through its neighbours: the kit runs where pytest may be absent."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        lse = logits.logsumexp(-1, keepdim=True)
        ctx.save_for_backward(logits, labels, lse)
        return (logits.gather(-1, labels[:, None]) - lse).squeeze(-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, labels, lse = ctx.saved_tensors
        grad_logits = -torch.exp(logits - lse)
        grad_logits.scatter_add_(-1, labels[:, None], torch.ones_like(grad_logits[:, :1]))
        grad_logits.mul_(grad[:, None])
        logits.data.copy_(grad_logits)
        return logits, None


def _logp_reference(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.log_softmax(out, -1).gather(-1, labels[:, None]).squeeze(-1)


def _tag(keep: bool, sync: str) -> str:
    return f"{'keep' if keep else 'regather'}_{sync}"


def _fsdp1_strategy():
    return f1.FULL if world() > 1 else f1.NO_SHARD


def _wrap(backend: str, model: nn.Module, bf16: bool = False) -> nn.Module:
    if backend == "fsdp2":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return f2.wrap(model, **(dict(mp_policy=mp) if bf16 else {}))
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return f1.wrap(model, _fsdp1_strategy(), **(dict(mixed_precision=mp) if bf16 else {}))


def _adapter(backend: str):
    return f2.ADAPTER if backend == "fsdp2" else f1.ADAPTER


@functools.cache
def _fsdp2_communicates() -> tuple[bool, bool]:
    """Whether plain FSDP2 issues (all-gathers, reduce-scatters) at this world size:
    at world size 1 recent torch skips both, torch 2.9 only the all-gathers (detected
    with one plain step, not by version)."""
    if world() > 1:
        return True, True
    model = f2.wrap(make_net())
    with count_collectives() as counts:
        LOSSES[0](model(batch(0))).backward()
    return counts.all_gather > 0, counts.reduce_scatter > 0


def _expect_counts(backend: str, model: nn.Module, keep: bool, sync: str):
    def expect(counts) -> None:
        if backend == "fsdp2":
            gathers, scatters = _fsdp2_communicates()
            want = dict(all_gather=gathers * f2.expected_all_gathers(model, PASSES, keep, True),
                        reduce_scatter=scatters * f2.expected_reduce_scatters(model, PASSES, sync))
        else:
            strategy = _fsdp1_strategy()
            want = dict(all_gather=f1.expected_all_gathers(model, PASSES, keep, strategy),
                        reduce_scatter=f1.expected_reduce_scatters(model, PASSES, sync, strategy),
                        all_reduce=f1.expected_all_reduces(model, PASSES, sync, strategy))
        got = {op: getattr(counts, op) for op in want}
        assert got == want, f"collectives {counts.by_op}, expected {want}"

    return expect


def _parity_case(backend: str, keep: bool, sync: str):
    def run() -> None:
        model = make_net()
        ref = reference_copy(model)
        model = _wrap(backend, model)
        options = block_options(keep, sync, PASSES if keep else None)
        scenario = Scenario(passes=PASSES, options=options, check_between=sync == "every")
        run_parity(model, ref, scenario, _adapter(backend), _expect_counts(backend, model, keep, sync))

    return run


def _bf16_case(backend: str, keep: bool, sync: str):
    def run() -> None:
        tol = BF16_TOL[sync]
        make = lambda: _wrap(backend, make_net(), bf16=True)  # noqa: E731
        new, old = make(), make()
        new_opt, old_opt = sgd(new), sgd(old)
        full_params = _adapter(backend).full_params
        init = full_params(old)
        for step in range(3):
            x = batch(step)
            for i in range(PASSES):  # the two-forward way: a forward per loss
                LOSSES[i](old(x)).float().backward()
            with no_reshard_between_backwards(new, **block_options(keep, sync)):
                out = new(x)
                for i in range(PASSES):
                    LOSSES[i](out).float().backward(retain_graph=i < PASSES - 1)
            for opt in (new_opt, old_opt):
                opt.step()
                opt.zero_grad()
            assert_close_dicts_tol(full_params(new), full_params(old), tol, f"step {step}")
        moved = max((init[n] - p).abs().max().item() for n, p in full_params(new).items())
        assert moved > 10 * tol["atol"], f"parameters barely moved ({moved}): vacuous comparison"

    return run


def assert_close_dicts_tol(actual: dict, expected: dict, tol: dict, what: str) -> None:
    assert set(actual) == set(expected), f"{what}: names differ"
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], **tol,
                                   msg=lambda m, name=name: f"{what}: {name}: {m}")


class _BlockGrads:
    """Gradients of each block's output in one backward pass (activation hooks)."""

    def __init__(self, model: nn.Module) -> None:
        self.grads: dict[int, torch.Tensor] = {}
        for i, blk in enumerate(model.blocks):
            blk.register_forward_hook(functools.partial(self._hook, i))

    def _hook(self, i: int, module, args, output) -> None:
        if output.requires_grad:
            output.register_hook(lambda g: self.grads.__setitem__(i, g.detach().clone()))

    def take(self) -> dict[int, torch.Tensor]:
        grads, self.grads = self.grads, {}
        return grads


def _probe_case(backend: str, keep: bool, sync: str):
    def run() -> None:
        model = make_net()
        ref = reference_copy(model)
        model = _wrap(backend, model)
        ref_hooks, hooks = _BlockGrads(ref), _BlockGrads(model)
        opt, ref_opt = sgd(model), sgd(ref)
        for step in range(3):
            x = batch(step)
            out = ref(x)
            LOSSES[0](out).backward(retain_graph=True)
            ref.zero_grad()
            want_probe = ref_hooks.take()
            LOSSES[1](out).backward()
            ref_hooks.take()
            want_grads = averaged_grads(ref)
            with no_reshard_between_backwards(model, **block_options(keep, sync)) as block:
                out = model(x)
                with count_collectives() as counts:
                    block.backward(LOSSES[0](out), param_grads=False, retain_graph=True)
                got_probe = {i: g.float() for i, g in hooks.take().items()}
                block.backward(LOSSES[1](out))
                hooks.take()
            assert counts.reduce_scatter == 0 and counts.all_reduce == 0, counts.by_op
            if keep:
                assert counts.all_gather == 0, counts.by_op
            where = f"step {step} keep={keep} sync={sync}"
            assert_close_dicts(got_probe, want_probe, f"{where}: probe-pass block gradients")
            assert_close_dicts(_adapter(backend).full_grads(model), want_grads, f"{where}: grads")
            for name, param in ref.named_parameters():
                param.grad = want_grads[name].clone()
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
            ref_params = {n: p.detach() for n, p in ref.named_parameters()}
            assert_close_dicts(_adapter(backend).full_params(model), ref_params, f"{where}: params")

    return run


def _check_case(backend: str):
    def run() -> None:
        for keep, sync in OPTION_GRID:  # no false alarm: parity with the check on
            model = make_net()
            ref = reference_copy(model)
            model = _wrap(backend, model)
            options = dict(block_options(keep, sync, PASSES), check_saved_tensors=True)
            scenario = Scenario(passes=PASSES, options=options, check_between=sync == "every")
            run_parity(model, ref, scenario, _adapter(backend),
                       _expect_counts(backend, model, keep, sync))
        # A backward that writes into its saved logits (flash-attn's inplace_backward).
        model = _wrap(backend, make_net())
        gen = torch.Generator().manual_seed(7 + rank())
        labels = torch.randint(0, DIM, (BATCH,), generator=gen).to(device())
        try:
            with no_reshard_between_backwards(model, check_saved_tensors=True):
                logp = InplaceLogProb.apply(model(batch(0)), labels)
                (-logp.mean()).backward(retain_graph=True)
                (-(2 * logp).mean()).backward()
        except RuntimeError as exc:
            assert "in place" in str(exc), exc
        else:
            raise AssertionError("check_saved_tensors=True missed a saved tensor changed in place")
        # The same loss without the in-place write passes.
        with no_reshard_between_backwards(model, check_saved_tensors=True):
            logp = _logp_reference(model(batch(0)), labels)
            (-logp.mean()).backward(retain_graph=True)
            (-(2 * logp).mean()).backward()

    return run


for backend in ("fsdp2", "fsdp1"):
    for keep, sync in itertools.product((True, False), ("every", "last")):
        tag = _tag(keep, sync)
        registry.add(f"{backend}_fp32_parity_{tag}", _parity_case(backend, keep, sync),
                     world_sizes=WORLD_SIZES)
        registry.add(f"{backend}_bf16_vs_two_forward_{tag}", _bf16_case(backend, keep, sync),
                     world_sizes=WORLD_SIZES)
        registry.add(f"{backend}_probe_{tag}", _probe_case(backend, keep, sync),
                     world_sizes=WORLD_SIZES)
    registry.add(f"{backend}_check_saved_tensors", _check_case(backend), world_sizes=WORLD_SIZES)
