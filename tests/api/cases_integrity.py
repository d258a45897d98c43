"""``check_saved_tensors=True`` under FSDP1 and FSDP2 (CPU, gloo, world size 2).

Run inside ranks by ``tests/api/test_integrity.py``.

The hazard (see [Note: why a retained graph can silently read changed saved
tensors] in ``fsdp_retain/_saved_tensors.py``) is reproduced by
``InplaceLogProb``: per-token log-probs whose backward writes the gradient
into the saved logits through ``.data`` (no version-counter bump), as
flash-attn's ``cross_entropy_loss(..., inplace_backward=True)`` does from its
Triton kernel. The model is ``tests.support.parity.Net`` (its 12 outputs are the
logits), wrapped as in the parity tests; the reference is the unsharded copy
trained with an out-of-place log-prob, gradients averaged over ranks.
Checkpointed variants wrap every ``Block`` in non-reentrant activation
checkpointing; the log-prob stays outside, as in verl.

The false-positive cases run a sample of the parity scenarios with the check
on; they must match the reference to 1e-5 as without it.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy

from fsdp_retain import no_reshard_between_backwards
from fsdp_retain._saved_tensors import fingerprint
from tests.support import fsdp1_utils as f1
from tests.support import fsdp2_utils as f2
from tests.fsdp2.cases_compose import CheckpointedNet
from tests.support.fsdp1_compose_utils import checkpointed as checkpointed_fsdp1
from tests.support.harness import Registry
from tests.support.parity import (
    BATCH,
    DIM,
    OPTION_GRID,
    Scenario,
    assert_close_dicts,
    averaged_grads,
    batch,
    block_options,
    make_net,
    penalty_step,
    rank,
    reference_copy,
    run_parity,
)

registry = Registry()
CHECK = dict(check_saved_tensors=True)


class InplaceLogProb(torch.autograd.Function):
    """``log_softmax(logits).gather(labels)`` whose backward overwrites the saved logits."""

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
        logits.data.copy_(grad_logits)  # flash-attn: the kernel writes into the saved logits
        return logits, None


def _logp_inplace(out, labels):
    return InplaceLogProb.apply(out, labels)


def _logp_reference(out, labels):
    return F.log_softmax(out, -1).gather(-1, labels[:, None]).squeeze(-1)


def _labels_and_advantages(step: int):
    gen = torch.Generator().manual_seed(7 + rank() + 1000 * step)
    labels = torch.randint(0, DIM, (BATCH,), generator=gen)
    return labels, torch.randn(labels.shape[0], generator=gen)


def _two_passes(model, x, labels, adv, logp_fn, read):
    """Log-prob loss backward, then the policy loss backward; ``read`` grads after each."""
    logp = logp_fn(model(x), labels)
    (-logp.mean()).backward(retain_graph=True)
    after_first = read(model)
    (-(logp * adv).mean()).backward()
    return after_first, read(model)


def _reader(backend: str):
    return f2.full_grads if backend == "fsdp2" else f1.full_grads


def _wrap(backend: str, ckpt: bool, **kwargs) -> nn.Module:
    net = make_net()
    if backend == "fsdp2":
        return f2.wrap(CheckpointedNet(net) if ckpt else net, **kwargs)
    model = f1.wrap(net, **kwargs)
    return checkpointed_fsdp1(model) if ckpt else model


def _reference_grads(step: int):
    ref = reference_copy(make_net())
    labels, adv = _labels_and_advantages(step)
    return _two_passes(ref, batch(step), labels, adv, _logp_reference, averaged_grads)


def _max_diff(a: dict, b: dict) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in b)


def _assert_hooks_popped() -> None:
    """A graph built after the block is not packed by the check: the hazard is silent again."""
    w = torch.randn(4, 12, requires_grad=True)
    logp = InplaceLogProb.apply(torch.randn(3, 4) @ w, torch.tensor([0, 5, 11]))
    logp.sum().backward(retain_graph=True)
    logp.sum().backward()  # would raise if the block's hooks were still pushed


def _flash_attn_pattern_case(backend: str, ckpt: bool):
    def run() -> None:
        ref = _reference_grads(0)
        labels, adv = _labels_and_advantages(0)
        x = batch(0)

        # Without the check: no error, pass 1 right, pass 2 silently wrong.
        read = _reader(backend)
        model = _wrap(backend, ckpt)
        with no_reshard_between_backwards(model):
            grads = _two_passes(model, x, labels, adv, _logp_inplace, read)
        assert_close_dicts(grads[0], ref[0], "pass 1 without the check")
        wrong = _max_diff(grads[1], ref[1])
        assert wrong > 1e-2, f"the in-place backward no longer corrupts pass 2 ({wrong})"

        # With the check: pass 1 unchanged, pass 2 raises before using the logits.
        model = _wrap(backend, ckpt)
        try:
            with no_reshard_between_backwards(model, **CHECK):
                logp = _logp_inplace(model(x), labels)
                (-logp.mean()).backward(retain_graph=True)
                assert_close_dicts(read(model), ref[0], "pass 1 with the check")
                (-(logp * adv).mean()).backward()
        except RuntimeError as exc:
            message = str(exc)
        else:
            raise AssertionError("check_saved_tensors=True did not catch the in-place backward")
        needed = ("InplaceLogProbBackward", f"shape ({BATCH}, {DIM})", "2nd time", "in place")
        for text in needed:
            assert text in message, (text, message)
        _assert_hooks_popped()

        # The same model trains on with the check and an out-of-place log-prob.
        model.zero_grad()
        with no_reshard_between_backwards(model, **CHECK):
            grads = _two_passes(model, x, labels, adv, _logp_reference, read)
        assert_close_dicts(grads[1], ref[1], "after the error, out-of-place log-prob")
        _assert_hooks_popped()

    return run


for _backend in ("fsdp1", "fsdp2"):
    for _ckpt in (False, True):
        registry.add(
            f"flash_attn_pattern_{_backend}_{'ckpt' if _ckpt else 'plain'}",
            _flash_attn_pattern_case(_backend, _ckpt),
        )


def _no_false_positive_case(backend: str, ckpt: bool, **wrap_kwargs):
    """Every option pair, 3 passes, with the check: parity as without. ``zero_grad``
    between the passes for two of the four pairs (it touches ``.grad``, not what the
    check watches: the graph's saved tensors)."""

    def run() -> None:
        adapter = f2.ADAPTER if backend == "fsdp2" else f1.ADAPTER
        for i, (keep, sync) in enumerate(OPTION_GRID):
            for zero_between in (i % 2 == 1,):
                options = dict(block_options(keep, sync), **CHECK)
                scenario = Scenario(
                    passes=3,
                    zero_between=zero_between,
                    options=options,
                    check_between=sync == "every",
                )
                model = _wrap(backend, ckpt, **wrap_kwargs)
                run_parity(model, reference_copy(make_net()), scenario, adapter)

    return run


registry.add("no_false_positive_fsdp2", _no_false_positive_case("fsdp2", False))
registry.add("no_false_positive_fsdp2_ckpt", _no_false_positive_case("fsdp2", True))
registry.add(
    "no_false_positive_fsdp2_no_reshard_after_forward",
    _no_false_positive_case("fsdp2", False, reshard_after_forward=False),
)
registry.add("no_false_positive_fsdp1", _no_false_positive_case("fsdp1", False))
registry.add("no_false_positive_fsdp1_ckpt", _no_false_positive_case("fsdp1", True))
registry.add(
    "no_false_positive_fsdp1_orig_params",
    _no_false_positive_case("fsdp1", False, use_orig_params=True),
)
registry.add(
    "no_false_positive_fsdp1_shard_grad_op",
    _no_false_positive_case("fsdp1", False, strategy=f1.GRAD_OP),
)


@registry.case()
def no_false_positive_bf16_mixed_precision() -> None:
    """bf16 parameters, fp32 reduce, both backends: the check finds nothing."""
    for backend, kwargs in (
        ("fsdp2", dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                      reduce_dtype=torch.float32))),
        ("fsdp1", dict(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                      reduce_dtype=torch.float32))),
    ):
        for keep, sync in OPTION_GRID:
            model = _wrap(backend, False, **kwargs)
            labels, adv = _labels_and_advantages(0)
            with no_reshard_between_backwards(model, **block_options(keep, sync), **CHECK):
                grads = _two_passes(model, batch(0), labels, adv, _logp_reference, _reader(backend))
            assert all(g.isfinite().all() for g in grads[1].values()), (backend, keep, sync)


@registry.case()
def no_false_positive_create_graph() -> None:
    """Gradient penalty (create_graph=True): the double-backward graph is checked too."""
    for backend in ("fsdp2", "fsdp1"):
        ref, model = reference_copy(make_net()), _wrap(backend, False)
        x = batch(0)
        penalty_step(ref, x, contextlib.nullcontext())
        expected = averaged_grads(ref)
        penalty_step(model, x, no_reshard_between_backwards(model, **CHECK))
        assert_close_dicts(_reader(backend)(model), expected, f"{backend} penalty")


@registry.case()
def backward_after_exit_still_checked() -> None:
    """FSDP2 re-gathers for a backward after the block; the graph keeps the check."""
    model = _wrap("fsdp2", False)
    labels, adv = _labels_and_advantages(0)
    with no_reshard_between_backwards(model, **CHECK):
        logp = _logp_inplace(model(batch(0)), labels)
        (-logp.mean()).backward(retain_graph=True)
    try:
        (-(logp * adv).mean()).backward()
    except RuntimeError as exc:
        assert "InplaceLogProbBackward" in str(exc), exc
    else:
        raise AssertionError("the check was lost when the block exited")


@registry.case()
def dtensor_fingerprint_reads_the_local_shard() -> None:
    """A DTensor is fingerprinted through its local shard, with no collective."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from fsdp_retain._measure import count_collectives

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.arange(24.0).reshape(6, 4)
    dtensor = distribute_tensor(full, mesh, [Shard(0)])
    with count_collectives() as counts:
        before = fingerprint(dtensor)
        dtensor.to_local().data[0, 0] += 1.0
        after = fingerprint(dtensor)
    assert not counts.by_op, counts.by_op
    assert not torch.equal(before, after)
