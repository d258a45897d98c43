"""FSDP1 cases, run inside ranks by ``tests/test_fsdp1.py`` (CPU, gloo).

World size 2: the parity grid for FULL_SHARD and SHARD_GRAD_OP, NO_SHARD, and
the behaviour cases (crash repro, zero_grad variants, exceptions, memory,
misuse). World size 4: HYBRID_SHARD. World size 1: FSDP1 falls back to
NO_SHARD there.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import warnings

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffload, MixedPrecision
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from fsdp_retain import no_reshard_between_backwards
from fsdp_retain._common import ACTIVE_ATTR
from fsdp_retain._fsdp1_inspect import fsdp1_handles
from fsdp_retain._measure import count_collectives
from tests import any_start
from tests import fsdp1_utils as f1
from tests.harness import Registry
from tests.parity import (
    OPTION_GRID,
    block_options,
    world,
    penalty_step,
    LOSSES,
    Block,
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


def _expect_counts(model, passes, keep, sync, strategy):
    def expect(counts) -> None:
        expected = dict(
            all_gather=f1.expected_all_gathers(model, passes, keep, strategy),
            reduce_scatter=f1.expected_reduce_scatters(model, passes, sync, strategy),
            all_reduce=f1.expected_all_reduces(model, passes, sync, strategy),
        )
        assert counts.as_dict() == expected, f"collectives {counts.by_op}, expected {expected}"

    return expect


def assert_restored(model) -> None:
    """FSDP1 looks as after a plain training step: nothing of the block is left."""
    assert not hasattr(model, ACTIVE_ATTR)
    assert f1.unsharded_storage_bytes(model) == 0, "unsharded storage kept after block"
    for module in FSDP.fsdp_modules(model):
        assert module._sync_gradients, "_sync_gradients not restored"
    for handle in fsdp1_handles(model):
        assert "reshard" not in handle.__dict__, "reshard override left installed"
        assert "pre_unshard" not in handle.__dict__, "pre_unshard override left installed"
        assert not hasattr(handle.flat_param, "_post_backward_hook_state")
        assert not handle._needs_pre_backward_unshard
        flat_param = handle.flat_param
        assert not hasattr(flat_param, "_saved_grad_shard"), "gradient left aside"
        grad = flat_param.grad
        assert grad is None or grad.shape == flat_param.shape, "unreduced gradient left"


def _parity_case(strategy, uop, passes, zero_between, keep, sync, backwards, tied):
    def run() -> None:
        model = make_net(tied=tied)
        ref = reference_copy(model)
        model = f1.wrap(model, strategy, use_orig_params=uop)
        options = dict(
            keep_unsharded=keep,
            sync_grads=sync,
            backwards=passes if backwards else None,
        )
        scenario = Scenario(
            passes=passes,
            zero_between=zero_between,
            options=options,
            check_between=sync == "every",
        )
        expect = _expect_counts(model, passes, keep, sync, strategy)
        run_parity(model, ref, scenario, f1.ADAPTER, expect)
        assert_restored(model)

    return run


def _name(strategy, uop, passes, zero_between, keep, sync, backwards, tied) -> str:
    return (
        f"parity_{f1.STRATEGY_NAMES[strategy]}_{'orig' if uop else 'flat'}_p{passes}_"
        f"{'zero' if zero_between else 'accum'}_{'keep' if keep else 'regather'}_{sync}_"
        f"{'backwards' if backwards else 'nbackwards'}_{'tied' if tied else 'untied'}"
    )


def _add_grid(strategies, world_sizes, *, both_pass_counts: bool, prefix: str = "") -> None:
    """Every strategy x use_orig_params x keep_unsharded x sync_grads x backwards.

    With ``both_pass_counts`` each runs with 2 and 3 passes, with zero_grad
    between passes and the tied weight chosen so that every pair of factors
    meets (64 cases for two strategies). Otherwise (one strategy, 16 cases)
    passes, zero_grad and the tied weight are XORs of the other factors'
    bits, which again makes every pair of factors meet.
    """
    combos = itertools.product(
        strategies, (False, True), (True, False), ("every", "last"), (False, True)
    )
    for i, (strategy, uop, keep, sync, backwards) in enumerate(combos):
        if both_pass_counts:
            variants = [
                (passes, (i + (passes == 3)) % 2 == 0, (i // 2 + i // 8 + (passes == 3)) % 2 == 0)
                for passes in (2, 3)
            ]
        else:
            bit = [(i >> j) & 1 for j in range(4)]  # backwards, sync, keep, uop
            variants = [(2 + (bit[0] ^ bit[1]), bool(bit[0] ^ bit[2]), bool(bit[0] ^ bit[3]))]
        for passes, zero, tied in variants:
            args = (strategy, uop, passes, zero, keep, sync, backwards, tied)
            registry.add(prefix + _name(*args), _parity_case(*args), world_sizes=world_sizes)


_add_grid((f1.FULL, f1.GRAD_OP), (2,), both_pass_counts=True)
_add_grid((f1.NO_SHARD,), (2,), both_pass_counts=False)
_add_grid((f1.HYBRID,), (4,), both_pass_counts=False)
# World size 1: FSDP1 switches every strategy to NO_SHARD.
_add_grid((f1.FULL,), (1,), both_pass_counts=False, prefix="ws1_")


# Without the block #
def _crash_case(strategy, uop):
    def run() -> None:
        model = f1.wrap(make_net(), strategy, use_orig_params=uop)
        out = model(batch(0))
        LOSSES[0](out).backward(retain_graph=True)
        try:
            LOSSES[1](out).backward()
        except RuntimeError as exc:
            assert "setStorage" in str(exc), f"unexpected error: {exc}"
        else:
            raise AssertionError("plain FSDP1 did not crash on the second backward")
        # The same model inside the block, from a fresh one.
        model = make_net()
        ref = reference_copy(model)
        model = f1.wrap(model, strategy, use_orig_params=uop)
        run_parity(model, ref, Scenario(passes=2, steps=3), f1.ADAPTER)

    return run


for strategy, uop in itertools.product((f1.FULL, f1.GRAD_OP), (False, True)):
    registry.add(
        f"crash_without_block_{f1.STRATEGY_NAMES[strategy]}_{'orig' if uop else 'flat'}",
        _crash_case(strategy, uop),
    )


def _relative_error(model, ref) -> float:
    got = f1.full_grads(model)
    want = averaged_grads(ref)
    num = sum((got[n] - want[n]).norm() ** 2 for n in want) ** 0.5
    den = sum(want[n].norm() ** 2 for n in want) ** 0.5
    return float(num / den)


def _no_shard_case(uop):
    def run() -> None:
        for use_block in (False, True):
            model = make_net()
            ref = reference_copy(model)
            model = f1.wrap(model, f1.NO_SHARD, use_orig_params=uop)
            block = (
                no_reshard_between_backwards(model)
                if use_block
                else contextlib.nullcontext()
            )
            x = batch(0)
            with block:
                out, ref_out = model(x), ref(x)
                for i in range(2):
                    LOSSES[i](out).backward(retain_graph=i == 0)
                    LOSSES[i](ref_out).backward(retain_graph=i == 0)
            error = _relative_error(model, ref)
            if use_block:
                assert error < 1e-5, f"NO_SHARD with the block: relative error {error}"
            else:
                # The second pass is never all-reduced: only rank-local gradients.
                assert error > 0.1, f"plain NO_SHARD unexpectedly right ({error})"

    return run


for uop in (False, True):
    registry.add(f"no_shard_wrong_without_block_{'orig' if uop else 'flat'}", _no_shard_case(uop))


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
        plain = _expect_counts(model, 1, False, "every", strategy)
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


# Exceptions #
def _exception_one_rank_case(uop, sync):
    """Rank 0 raises after pass 1; rank 1 finishes. Rank 0's exit communicates
    nothing (it would hang otherwise); afterwards plain steps match the reference."""

    def run() -> None:
        model = make_net()
        ref = reference_copy(model)
        model = f1.wrap(model, f1.FULL, use_orig_params=uop)
        # Warm up the lazy init (a plain step) so the exit is the only thing counted.
        run_parity(model, ref, Scenario(passes=1, steps=1, use_block=False), f1.ADAPTER)
        block = no_reshard_between_backwards(model, keep_unsharded=True, sync_grads=sync)
        block.__enter__()
        out = model(batch(1))
        LOSSES[0](out).backward(retain_graph=True)
        with count_collectives() as counts:
            if dist.get_rank() == 0:
                exc = RuntimeError("user code failed between passes")
                try:
                    raise exc
                except RuntimeError:
                    assert not block.__exit__(RuntimeError, exc, exc.__traceback__)
            elif sync == "every":
                block.__exit__(None, None, None)
        if dist.get_rank() == 0 or sync == "every":
            nothing = dict(all_gather=0, reduce_scatter=0, all_reduce=0)
            assert counts.as_dict() == nothing, counts.by_op
        else:
            # "last" on rank 1 would flush (a collective rank 0 never joins): abort too.
            exc = RuntimeError("peer failed")
            assert not block.__exit__(RuntimeError, exc, None)
        assert_restored(model)
        model.zero_grad()
        run_parity(model, ref, Scenario(passes=1, steps=2, use_block=False), f1.ADAPTER)
        block_step = Scenario(
            passes=2, steps=2, options=dict(sync_grads=sync), check_between=sync == "every"
        )
        run_parity(model, ref, block_step, f1.ADAPTER)

    return run


def _exception_in_backward_case(uop, keep, sync, where):
    """Both ranks raise inside pass 2's backward (a gradient hook) or inside the forward."""

    def run() -> None:
        model = make_net()
        ref = reference_copy(model)
        model = f1.wrap(model, f1.FULL, use_orig_params=uop)
        block_body = model.blocks[1]

        def fail(*args):
            raise ValueError("hook failed")

        hook = None
        try:
            with no_reshard_between_backwards(model, keep_unsharded=keep, sync_grads=sync):
                if where == "forward":
                    hook = block_body.register_forward_hook(fail)
                out = model(batch(0))
                LOSSES[0](out).backward(retain_graph=True)
                hook = out.register_hook(fail)
                LOSSES[1](out).backward()
        except ValueError as exc:
            assert "hook failed" in str(exc)
        else:
            raise AssertionError("the hook did not raise")
        finally:
            if hook is not None:
                hook.remove()
        assert_restored(model)
        model.zero_grad()
        run_parity(model, ref, Scenario(passes=1, steps=2, use_block=False), f1.ADAPTER)
        options = dict(keep_unsharded=keep, sync_grads=sync)
        block_step = Scenario(passes=2, steps=2, options=options, check_between=sync == "every")
        run_parity(model, ref, block_step, f1.ADAPTER)

    return run


for uop, sync in itertools.product((False, True), ("every", "last")):
    registry.add(
        f"exception_one_rank_{'orig' if uop else 'flat'}_{sync}",
        _exception_one_rank_case(uop, sync),
    )
for uop, keep, sync, where in (
    (False, True, "every", "backward"),
    (True, False, "last", "backward"),
    (True, True, "last", "forward"),
    (False, False, "every", "forward"),
):
    registry.add(
        f"exception_in_{where}_{'orig' if uop else 'flat'}_{'keep' if keep else 'regather'}_{sync}",
        _exception_in_backward_case(uop, keep, sync, where),
    )


# Misuse and options #
@registry.case()
def non_root_unit_after_init() -> None:
    model = f1.wrap(make_net())
    model(batch(0)).sum().backward()
    try:
        no_reshard_between_backwards(model.blocks[0]).__enter__()
    except ValueError as exc:
        assert "non-root" in str(exc) and "outermost" in str(exc), str(exc)
    else:
        raise AssertionError("non-root unit accepted")


@registry.case()
def non_root_unit_before_init() -> None:
    """FSDP1 decides its root at the first forward: the error comes from there."""
    model = make_net()
    ref = reference_copy(model)
    model = f1.wrap(model)
    try:
        with no_reshard_between_backwards(model.blocks[0]):
            model(batch(0))
    except ValueError as exc:
        assert "non-root" in str(exc) and "outermost" in str(exc), str(exc)
    else:
        raise AssertionError("non-root unit accepted")
    assert not hasattr(model.blocks[0], ACTIVE_ATTR)
    run_parity(model, ref, Scenario(passes=2, steps=2), f1.ADAPTER)


@registry.case()
def cpu_offload_refused() -> None:
    model = f1.wrap(make_net(), cpu_offload=CPUOffload(offload_params=True))
    try:
        no_reshard_between_backwards(model).__enter__()
    except ValueError as exc:
        assert "CPUOffload" in str(exc), str(exc)
    else:
        raise AssertionError("CPU offload accepted")
    assert not hasattr(model, ACTIVE_ATTR)


@registry.case()
def extra_pass_warns_and_stays_correct() -> None:
    """backwards=2 but 3 passes: a warning, the third pass re-gathers, gradients right."""
    model = make_net()
    ref = reference_copy(model)
    model = f1.wrap(model, use_orig_params=True)
    scenario = Scenario(passes=3, steps=3, options=dict(backwards=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_parity(model, ref, scenario, f1.ADAPTER)
    assert any("backwards=2" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert_restored(model)


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
        expect = _expect_counts(model, 2, keep, "every", f1.FULL)
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


# Passes that start anywhere in the forward (see tests/any_start.py) #
def _expect_any_start(starts, keep, sync, strategy):
    def expect(model, counts) -> None:
        n = any_start.reductions(starts, sync)
        single = world() == 1
        want = dict(
            reduce_scatter=0 if strategy == f1.NO_SHARD or single else n,
            all_reduce=n if strategy in (f1.NO_SHARD, f1.HYBRID) or single else 0,
        )
        got = dict(reduce_scatter=counts.reduce_scatter, all_reduce=counts.all_reduce)
        assert got == want, f"reductions {counts.by_op}, expected {want}"
        if keep:
            ag = f1.expected_all_gathers(model, len(starts), True, strategy)
            assert counts.all_gather == ag, f"all-gathers {counts.by_op}, expected {ag}"

    return expect


def _any_start_case(strategy, uop):
    """Passes from an activation inside a unit (blocks[1].fc1), a non-root unit's
    output (blocks[0]) and a tensor that reaches only the root unit (inp), mixed
    with the output loss. Plain FSDP1 fails; in the block each start set, with
    two of the four (keep_unsharded, sync_grads) pairs (all four over the sets;
    ``backwards`` known for the 3-pass set), matches the reference over 3 steps
    after every pass, reduces each unit once per pass that reaches it ("every")
    or once per step ("last"), and with keep_unsharded=True all-gathers only in
    the forward."""

    def run() -> None:
        wrap = functools.partial(f1.wrap, strategy=strategy, use_orig_params=uop)
        outcome = any_start.plain_fails_or_is_wrong(wrap, f1.ADAPTER, ["inner", "out"])
        assert outcome.startswith("raised"), outcome
        for i, starts in enumerate(any_start.START_SETS):
            for keep, sync in (OPTION_GRID[i % 4], OPTION_GRID[(i + 2) % 4]):
                options = block_options(keep, sync, len(starts) if i == 1 else None)
                model = any_start.parity(
                    wrap,
                    f1.ADAPTER,
                    starts,
                    options,
                    check_between=sync == "every",
                    expect=_expect_any_start(starts, keep, sync, strategy),
                )
                assert_restored(model)

    return run


def _penalty_across_passes_case(strategy, uop, variants):
    """create_graph=True in pass 1 (an input-gradient penalty), plain losses,
    then the penalty's backward: plain FSDP1 crashes; keep_unsharded=True
    matches the reference over 3 steps; False refuses clearly and leaves
    FSDP1 as it was."""

    def run() -> None:
        wrap = functools.partial(f1.wrap, strategy=strategy, use_orig_params=uop)
        if strategy != f1.NO_SHARD:
            try:
                any_start.penalty_across_passes(wrap(make_net()), batch(0), contextlib.nullcontext())
            except RuntimeError as exc:
                assert "storage of size 0" in str(exc), exc
            else:
                raise AssertionError("plain FSDP1 ran the penalty across passes")
        for passes, sync in variants:
            model = any_start.penalty_parity(wrap, f1.ADAPTER, dict(sync_grads=sync), passes=passes)
            assert_restored(model)
        model = wrap(make_net())
        block = no_reshard_between_backwards(model, keep_unsharded=False)
        try:
            any_start.penalty_across_passes(model, batch(0), block)
        except RuntimeError as exc:
            assert "needs keep_unsharded=True" in str(exc), exc
        else:
            raise AssertionError("keep_unsharded=False accepted create_graph=True")
        assert_restored(model)

    return run


for strategy, uop in itertools.product((f1.FULL, f1.GRAD_OP, f1.NO_SHARD, f1.HYBRID), (False, True)):
    sizes = (4,) if strategy == f1.HYBRID else (2,)
    label = f"{f1.STRATEGY_NAMES[strategy]}_{'orig' if uop else 'flat'}"
    registry.add(f"any_start_{label}", _any_start_case(strategy, uop), world_sizes=sizes)
    variants = (
        [(3, "every"), (3, "last"), (4, "every"), (4, "last")]
        if strategy == f1.FULL
        else [(3, "every"), (4, "last")]
    )
    registry.add(
        f"penalty_across_passes_{label}",
        _penalty_across_passes_case(strategy, uop, variants),
        world_sizes=sizes,
    )


@registry.case()
def backward_create_graph_accumulating_refused() -> None:
    """loss.backward(create_graph=True) would accumulate gradients of gradients
    into FSDP1's flat parameters: the block refuses before any gradient moves,
    and the next step is right."""
    model = make_net()
    ref = reference_copy(model)
    model = f1.wrap(model, use_orig_params=True)
    run_parity(model, ref, Scenario(passes=2, steps=1), f1.ADAPTER)
    model(batch(1)).pow(2).mean().backward()  # reduced gradients the pass must keep
    before = f1.full_grads(model)
    assert before, "no gradients to keep"
    try:
        with no_reshard_between_backwards(model):
            out = model(batch(1))
            out.pow(2).mean().backward(create_graph=True)
    except RuntimeError as exc:
        assert "gradients of gradients" in str(exc), exc
    else:
        raise AssertionError("backward(create_graph=True) into FSDP1 .grad accepted")
    assert_restored(model)
    assert_close_dicts(f1.full_grads(model), before, "grads after the refused pass")
    model.zero_grad()
    run_parity(model, ref, Scenario(passes=2, steps=2), f1.ADAPTER)
