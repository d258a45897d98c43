"""FSDP1 gradients across passes and steps (part of ``tests/fsdp1/cases_fsdp1.py``).

zero_grad between passes (the model's, the optimizer's in place, one parameter's,
after another model's backward), gradients from a plain backward before the block,
FSDP's ``no_sync()`` accumulation over two blocks, the plain step after a block,
and the unsharded bytes held between passes.
"""

from __future__ import annotations

import contextlib
import itertools

import torch

from fsdp_retain import no_reshard_between_backwards
from tests.support import fsdp1_utils as f1
from tests.support.fsdp1_checks import assert_restored, expect_counts
from tests.support.harness import Registry
from tests.support.parity import (
    LOSSES,
    Scenario,
    assert_close_dicts,
    averaged_grads,
    batch,
    make_net,
    reference_copy,
    run_parity,
    sgd,
)

registry = Registry()


# zero_grad between passes, gradients from before the block #
def _clear_one(name):
    def clear(model, opt) -> None:
        for param_name, param in model.named_parameters():
            if param_name.replace("_fsdp_wrapped_module.", "") == name:
                param.grad = None
                return
        raise AssertionError(f"no parameter {name}")

    return clear


def _other_backward_then_zero_grad(model, opt) -> None:
    """Another model's backward between passes (the block sees it start and
    leaves it alone), then ``zero_grad()``."""
    other = torch.nn.Linear(3, 1)
    other(torch.ones(2, 3)).sum().backward()
    model.zero_grad()


_BETWEEN = {
    "model_zero_grad": lambda model, opt: model.zero_grad(),
    "other_backward_then_zero_grad": _other_backward_then_zero_grad,
    "opt_zero_grad_in_place": lambda model, opt: opt.zero_grad(set_to_none=False),
    # Parameters that straddle or miss rank 0's shard, in a block and in the root.
    "clear_one_param": _clear_one("blocks.1.fc2.weight"),
    "clear_one_root_param": _clear_one("out.weight"),
}


def _custom_step(model, opt, x, pre, passes, between, block_options):
    """``pre``: a plain backward first, so gradients exist before the block."""
    if pre is not None:
        LOSSES[2](model(pre)).backward()
    block = (
        no_reshard_between_backwards(model, **block_options)
        if block_options is not None
        else contextlib.nullcontext()
    )
    with block as blk:
        out = model(x)
        for i in range(passes):
            if i:
                between(model, opt)
            LOSSES[i % len(LOSSES)](out).backward(retain_graph=i < passes - 1)
    if blk is not None:
        assert blk.backward_passes == passes


def _zero_grad_case(strategy, uop, sync, between_name, with_pre):
    def run() -> None:
        model = make_net()
        ref = reference_copy(model)
        model = f1.wrap(model, strategy, use_orig_params=uop)
        opt, ref_opt = sgd(model), sgd(ref)
        between = _BETWEEN[between_name]
        options = dict(keep_unsharded=True, sync_grads=sync)
        for step in range(3):
            x = batch(step)
            pre = batch(step + 100) if with_pre else None
            _custom_step(ref, ref_opt, x, pre, 3, between, None)
            _custom_step(model, opt, x, pre, 3, between, options)
            ref_grads = averaged_grads(ref)
            where = f"step {step}"
            assert_close_dicts(f1.full_grads(model), ref_grads, f"{where}: grads")
            for name, param in ref.named_parameters():
                param.grad = ref_grads[name]
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
            ref_params = {n: p.detach() for n, p in ref.named_parameters()}
            assert_close_dicts(f1.full_params(model), ref_params, f"{where}: params")
        assert_restored(model)

    return run


for uop, sync, between_name, with_pre in itertools.product(
    (False, True), ("every", "last"), _BETWEEN, (False, True)
):
    if between_name.startswith("clear_one") and not uop:
        continue  # use_orig_params=False: the flat parameter is the only parameter
    registry.add(
        f"zero_grad_full_{'orig' if uop else 'flat'}_{sync}_{between_name}_"
        f"{'pre_grads' if with_pre else 'no_pre_grads'}",
        _zero_grad_case(f1.FULL, uop, sync, between_name, with_pre),
    )
for uop, between_name in itertools.product(
    (False, True), ("model_zero_grad", "opt_zero_grad_in_place")
):
    registry.add(
        f"zero_grad_noshard_{'orig' if uop else 'flat'}_last_{between_name}_pre_grads",
        _zero_grad_case(f1.NO_SHARD, uop, "last", between_name, True),
    )


def _nothing(model, opt) -> None:
    pass


def _no_sync_accumulation_case(uop, sync):
    """Gradient accumulation: micro-batch 1 inside FSDP's no_sync(), micro-batch 2
    synchronized, each a block with 2 passes; matches the reference summing both."""

    def run() -> None:
        model = make_net()
        ref = reference_copy(model)
        model = f1.wrap(model, use_orig_params=uop)
        opt, ref_opt = sgd(model), sgd(ref)
        options = dict(sync_grads=sync)
        for step in range(3):
            micro = [batch(step), batch(step + 50)]
            for x in micro:
                _custom_step(ref, ref_opt, x, None, 2, _nothing, None)
            with model.no_sync():
                _custom_step(model, opt, micro[0], None, 2, _nothing, options)
            _custom_step(model, opt, micro[1], None, 2, _nothing, options)
            ref_grads = averaged_grads(ref)
            assert_close_dicts(f1.full_grads(model), ref_grads, f"step {step}: grads")
            for name, param in ref.named_parameters():
                param.grad = ref_grads[name]
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
            ref_params = {n: p.detach() for n, p in ref.named_parameters()}
            assert_close_dicts(f1.full_params(model), ref_params, f"step {step}: params")
        assert_restored(model)

    return run


for uop, sync in itertools.product((False, True), ("every", "last")):
    registry.add(
        f"no_sync_accumulation_{'orig' if uop else 'flat'}_{sync}",
        _no_sync_accumulation_case(uop, sync),
    )


# After the block: the next plain step, memory #
def _plain_after_block_case(strategy, uop, keep, sync):
    def run() -> None:
        model = make_net()
        ref = reference_copy(model)
        model = f1.wrap(model, strategy, use_orig_params=uop)
        options = dict(keep_unsharded=keep, sync_grads=sync)
        block_step = Scenario(passes=2, steps=2, options=options, check_between=False)
        run_parity(model, ref, block_step, f1.ADAPTER)
        assert_restored(model)
        plain = expect_counts(model, 1, False, "every", strategy)
        run_parity(model, ref, Scenario(passes=1, steps=2, use_block=False), f1.ADAPTER, plain)

    return run


for strategy, uop, keep, sync in (
    (f1.FULL, False, True, "last"),
    (f1.FULL, True, False, "every"),
    (f1.GRAD_OP, True, True, "last"),
    (f1.GRAD_OP, False, False, "every"),
):
    registry.add(
        f"plain_step_after_block_{f1.STRATEGY_NAMES[strategy]}_{'orig' if uop else 'flat'}_"
        f"{'keep' if keep else 'regather'}_{sync}",
        _plain_after_block_case(strategy, uop, keep, sync),
    )


def _memory_case(strategy, uop, keep, backwards):
    """Budget between passes: keep_unsharded=True holds at most the unsharded
    parameters of all units (parameter bytes + 10% for padding to the world
    size and use_orig_params alignment); False holds none."""

    def run() -> None:
        model = make_net()
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        model = f1.wrap(model, strategy, use_orig_params=uop)
        budget = int(1.1 * param_bytes) if keep else 0
        seen = []
        options = dict(keep_unsharded=keep, backwards=3 if backwards else None)
        with no_reshard_between_backwards(model, **options):
            out = model(batch(0))
            for i in range(3):
                LOSSES[i](out).backward(retain_graph=i < 2)
                seen.append(f1.unsharded_storage_bytes(model))
        assert all(b <= budget for b in seen[:2]), f"between passes {seen}, budget {budget}"
        if keep:
            assert seen[0] > 0, "keep_unsharded=True kept nothing"
        if backwards:
            assert seen[2] == 0, f"last known pass did not free: {seen[2]} bytes"
        assert_restored(model)

    return run


for strategy, uop, keep, backwards in (
    (f1.FULL, False, True, False),
    (f1.FULL, True, True, True),
    (f1.FULL, True, False, False),
    (f1.GRAD_OP, False, False, True),
    (f1.GRAD_OP, True, True, False),
):
    registry.add(
        f"memory_{f1.STRATEGY_NAMES[strategy]}_{'orig' if uop else 'flat'}_"
        f"{'keep' if keep else 'regather'}_{'backwards' if backwards else 'nbackwards'}",
        _memory_case(strategy, uop, keep, backwards),
    )
