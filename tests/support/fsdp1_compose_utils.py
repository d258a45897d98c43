"""What the FSDP1 composability cases share (``tests/fsdp1/cases_fsdp1_compose*.py``).

The grid (keep_unsharded x sync_grads x use_orig_params) and its case tags; the
bf16 ``MixedPrecision`` policy; warm-up steps and the checks that FSDP1 is left as
it was and stays usable; and the comparison with the two-forward way (one forward
per backward; for ``sync_grads="last"`` the passes before the last inside FSDP's
``no_sync()``), which is the same arithmetic as the block's, hence ``TOL_SAME``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import MixedPrecision

from fsdp_retain import no_reshard_between_backwards
from fsdp_retain._fsdp1._inspect import fsdp1_snapshot
from tests.support import fsdp1_utils as f1
from tests.support.parity import (
    LOSSES,
    Block,
    Scenario,
    assert_close_dicts,
    batch,
    block_options,
    make_net,
    run_parity,
    sgd,
)

# keep_unsharded x sync_grads x use_orig_params
GRID = list(itertools.product((True, False), ("every", "last"), (False, True)))
BF16_MP = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
# Same arithmetic as the two-forward run; only fp32 reassociation may differ.
TOL_SAME = dict(rtol=1e-5, atol=1e-5)


def _tag(keep: bool, sync: str, uop: bool) -> str:
    return f"{'keep' if keep else 'regather'}_{sync}_{'orig' if uop else 'flat'}"


def checkpointed(model: nn.Module) -> nn.Module:
    """FSDP1's ``apply_activation_checkpointing``: non-reentrant ``checkpoint_wrapper``
    around each ``Block`` (also ``tests/api/cases_integrity.py``'s)."""
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT
        ),
        check_fn=lambda m: isinstance(m, Block),
    )
    return model


def _warm_up(model: nn.Module, ref: nn.Module) -> None:
    """One plain step on both (FSDP1's lazy init), then no gradients anywhere."""
    run_parity(model, ref, Scenario(passes=1, steps=1, use_block=False), f1.ADAPTER)
    model.zero_grad()
    ref.zero_grad()


def _warm_up_twins(model: nn.Module, twin: nn.Module) -> None:
    """One plain step on two FSDP1 models of the same configuration."""
    for m in (model, twin):
        LOSSES[0](m(batch(0))).float().backward()
        m.zero_grad()


def _check_twin(model: nn.Module, twin: nn.Module, what: str) -> None:
    """The next plain step of ``model`` matches its twin's."""
    model.zero_grad()
    twin.zero_grad()
    for m in (model, twin):
        LOSSES[0](m(batch(7))).float().backward()
    assert_close_dicts_tol(f1.full_grads(model), f1.full_grads(twin), TOL_SAME, what)


def assert_same_state(model: nn.Module, before: dict, what: str) -> None:
    after = fsdp1_snapshot(model)
    keys = before.keys() | after.keys()
    diff = {k: (before.get(k), after.get(k)) for k in keys if before.get(k) != after.get(k)}
    assert not diff, f"{what}: FSDP1 state differs (before, after): {diff}"


def _check_usable(model: nn.Module, ref: nn.Module, keep: bool, sync: str) -> None:
    """The next plain steps and the next block steps match the reference."""
    model.zero_grad()
    run_parity(model, ref, Scenario(passes=1, steps=2, use_block=False), f1.ADAPTER)
    block_step = Scenario(
        passes=2, steps=1, options=block_options(keep, sync), check_between=sync == "every"
    )
    run_parity(model, ref, block_step, f1.ADAPTER)


def _maybe_no_sync(model, sync: str, last_pass: bool):
    """FSDP1's own local accumulation for the passes "last" does not reduce."""
    return model.no_sync() if sync == "last" and not last_pass else contextlib.nullcontext()


def _two_forward_step(model, x, passes, forward_ctx, sync) -> None:
    for i in range(passes):
        with _maybe_no_sync(model, sync, i == passes - 1):
            with forward_ctx():
                out = model(x)
            LOSSES[i](out).float().backward()


def _retain_step(model, x, passes, forward_ctx, options) -> None:
    with no_reshard_between_backwards(model, **options):
        with forward_ctx():
            out = model(x)
        for i in range(passes):
            LOSSES[i](out).float().backward(retain_graph=i < passes - 1)


def _assert_trained_alike(new, old, new_opt, old_opt, tol, where, init) -> None:
    assert_close_dicts_tol(f1.full_grads(new), f1.full_grads(old), tol, f"{where}: grads")
    for opt in (new_opt, old_opt):
        opt.step()
        opt.zero_grad()
    new_params = f1.full_params(new)
    assert_close_dicts_tol(new_params, f1.full_params(old), tol, f"{where}: params")
    # Not vacuous: training moved the parameters well beyond the tolerance.
    moved = max((init[n] - p).abs().max().item() for n, p in new_params.items())
    assert moved > 10 * tol["atol"], (where, moved)


def assert_close_dicts_tol(actual, expected, tol, what) -> None:
    assert set(actual) == set(expected), sorted(set(actual) ^ set(expected))
    assert_close_dicts({n: t.float() for n, t in actual.items()},
                       {n: t.float() for n, t in expected.items()}, what, tol)


def _compare_with_two_forward(make_model, options, tol, forward_ctx, passes=3, steps=3):
    new, old = make_model(), make_model()
    init = f1.full_params(old)
    new_opt, old_opt = sgd(new), sgd(old)
    for step in range(steps):
        x = batch(step)
        _two_forward_step(old, x, passes, forward_ctx, options["sync_grads"])
        _retain_step(new, x, passes, forward_ctx, options)
        _assert_trained_alike(new, old, new_opt, old_opt, tol, f"step {step} {options}", init)
    return new


def _bf16_model(uop: bool) -> nn.Module:
    return f1.wrap(make_net(), use_orig_params=uop, mixed_precision=BF16_MP)


def _plain_stepped(make_model) -> nn.Module:
    """A model of the same configuration after one ordinary step (reference state)."""
    model = make_model()
    LOSSES[0](model(batch(0))).float().backward()
    sgd(model).step()
    model.zero_grad()
    return model
