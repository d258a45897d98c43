"""FSDP1 under training patterns beyond one forward and plain passes (part of
``tests/fsdp1/cases_fsdp1.py``).

Non-reentrant activation checkpointing, two forwards before three backwards,
a gradient penalty (``create_graph=True``), bf16 ``MixedPrecision``.
"""

from __future__ import annotations

import contextlib
import itertools

import torch
from torch.distributed.fsdp import MixedPrecision

from fsdp_retain import no_reshard_between_backwards
from tests.support import fsdp1_utils as f1
from tests.support.fsdp1_checks import assert_restored, expect_counts
from tests.support.harness import Registry
from tests.support.parity import (
    LOSSES,
    Block,
    Scenario,
    assert_close_dicts,
    averaged_grads,
    batch,
    make_net,
    penalty_step,
    reference_copy,
    run_parity,
    sgd,
)

registry = Registry()


def _checkpointed_case(uop, keep):
    """Non-reentrant activation checkpointing inside each unit (common in RL stacks)."""

    def run() -> None:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            apply_activation_checkpointing,
        )

        model = make_net()
        ref = reference_copy(model)
        model = f1.wrap(model, use_orig_params=uop)
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
        options = dict(keep_unsharded=keep)
        expect = expect_counts(model, 2, keep, "every", f1.FULL)
        run_parity(model, ref, Scenario(passes=2, steps=3, options=options), f1.ADAPTER, expect)
        assert_restored(model)

    return run


for uop, keep in itertools.product((False, True), (True, False)):
    registry.add(
        f"activation_checkpointing_{'orig' if uop else 'flat'}_{'keep' if keep else 'regather'}",
        _checkpointed_case(uop, keep),
    )


def _two_forwards_case(uop):
    """Forward A, forward B, then backward A, backward B, backward A+B."""

    def run() -> None:
        for keep, sync in itertools.product((True, False), ("every", "last")):
            model = make_net()
            ref = reference_copy(model)
            model = f1.wrap(model, use_orig_params=uop)
            opt, ref_opt = sgd(model), sgd(ref)
            for step in range(3):
                xa, xb = batch(step), batch(step + 100)
                for m in (ref, model):
                    block = (
                        no_reshard_between_backwards(m, keep_unsharded=keep, sync_grads=sync)
                        if m is model
                        else contextlib.nullcontext()
                    )
                    with block:
                        out_a, out_b = m(xa), m(xb)
                        LOSSES[0](out_a).backward(retain_graph=True)
                        LOSSES[1](out_b).backward(retain_graph=True)
                        LOSSES[2](out_a + out_b).backward()
                ref_grads = averaged_grads(ref)
                where = f"step {step} keep={keep} sync={sync}"
                assert_close_dicts(f1.full_grads(model), ref_grads, f"{where}: grads")
                for name, param in ref.named_parameters():
                    param.grad = ref_grads[name]
                for o in (opt, ref_opt):
                    o.step()
                    o.zero_grad()
            assert_restored(model)

    return run


for uop in (False, True):
    registry.add(f"two_forwards_{'orig' if uop else 'flat'}", _two_forwards_case(uop))


@registry.case()
def gradient_penalty_create_graph() -> None:
    """Higher-order gradients (create_graph=True): plain FSDP1 crashes,
    keep_unsharded=True matches the reference, False refuses clearly."""
    model = f1.wrap(make_net())
    try:
        penalty_step(model, batch(0), contextlib.nullcontext())
    except RuntimeError as exc:
        assert "storage of size 0" in str(exc), exc
    else:
        raise AssertionError("plain FSDP1 no longer fails with create_graph=True")
    for uop, sync in itertools.product((False, True), ("every", "last")):
        model = make_net()
        ref = reference_copy(model)
        model = f1.wrap(model, use_orig_params=uop)
        opt, ref_opt = sgd(model), sgd(ref)
        for step in range(3):
            x = batch(step)
            penalty_step(ref, x, contextlib.nullcontext())
            ref_grads = averaged_grads(ref)
            penalty_step(model, x, no_reshard_between_backwards(model, sync_grads=sync))
            where = f"step {step} uop={uop} sync={sync}"
            assert_close_dicts(f1.full_grads(model), ref_grads, f"{where}: grads")
            for name, param in ref.named_parameters():
                param.grad = ref_grads[name]
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
        assert_restored(model)
    model = make_net()
    ref = reference_copy(model)
    model = f1.wrap(model)
    try:
        penalty_step(model, batch(0), no_reshard_between_backwards(model, keep_unsharded=False))
    except RuntimeError as exc:
        assert "needs keep_unsharded=True" in str(exc), exc
    else:
        raise AssertionError("keep_unsharded=False accepted create_graph=True")
    assert_restored(model)
    model.zero_grad()
    run_parity(model, ref, Scenario(passes=2, steps=2), f1.ADAPTER)


def _mixed_precision_case(uop, sync):
    """bf16 parameters (FSDP1 switches the flat parameter's dtype between forward
    and backward): one forward + 2 passes in the block match two forwards
    without it; the float32 reference does not apply."""

    def run() -> None:
        mp = MixedPrecision(param_dtype=torch.bfloat16)
        base = make_net()
        models = [
            f1.wrap(reference_copy(base), use_orig_params=uop, mixed_precision=mp)
            for _ in range(2)
        ]
        x = batch(0)
        with no_reshard_between_backwards(models[0], sync_grads=sync):
            out = models[0](x)
            LOSSES[0](out).backward(retain_graph=True)
            LOSSES[1](out).backward()
        for i in range(2):
            LOSSES[i](models[1](x)).backward()
        got, want = f1.full_grads(models[0]), f1.full_grads(models[1])
        # "every" reduces each pass as the two-forward run does: same numbers.
        # "last" sums two bf16 gradients before one reduction: bf16 rounding.
        tol = dict(rtol=1e-6, atol=1e-6) if sync == "every" else dict(rtol=2e-2, atol=5e-3)
        assert set(got) == set(want), sorted(set(got) ^ set(want))
        for name in want:
            torch.testing.assert_close(
                got[name], want[name], **tol, msg=lambda m, n=name: f"bf16 {sync}: {n}: {m}"
            )
        assert_restored(models[0])

    return run


for uop, sync in itertools.product((False, True), ("every", "last")):
    registry.add(
        f"mixed_precision_bf16_{'orig' if uop else 'flat'}_{sync}", _mixed_precision_case(uop, sync)
    )
