"""FSDP2 cases about state, memory, misuse and exceptions (CPU, gloo).

Run inside ranks by ``tests/fsdp2/test_fsdp2_state.py``.
"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._tools.mem_tracker import MemTracker

from fsdp_retain import no_reshard_between_backwards
from fsdp_retain._fsdp2._inspect import fsdp2_all_sharded, fsdp2_snapshot
from fsdp_retain._measure import count_collectives
from tests.support import any_start
from tests.support import fsdp2_utils as f2
from tests.support.harness import Registry
from tests.support.parity import (
    OPTION_GRID,
    block_options,
    LOSSES,
    Scenario,
    batch,
    make_net,
    reference_copy,
    run_parity,
    sgd,
)

registry = Registry()


class Boom(RuntimeError):
    pass




def _check_plain_steps_match(model: nn.Module, ref: nn.Module) -> None:
    """After whatever happened to ``model``, ordinary FSDP2 steps still match."""
    for p in model.parameters():
        p.grad = None
    run_parity(model, ref, Scenario(passes=1, steps=2, use_block=False), f2.ADAPTER)


# --- Why the library exists --------------------------------------------------


@registry.case()
def plain_fsdp2_regathers_every_backward() -> None:
    """Without the block FSDP2 all-gathers every unit again in each backward."""
    passes = 3
    model = f2.wrap(make_net())
    ref = reference_copy(make_net())
    plain = run_parity(model, ref, Scenario(passes=passes, use_block=False), f2.ADAPTER)
    n = f2.units(model)
    # forward: n; pass 1: the n-1 blocks resharded after forward; later passes: n.
    assert plain[-1].all_gather == n + (n - 1) + (passes - 1) * n == 15
    kept = run_parity(model, ref, Scenario(passes=passes), f2.ADAPTER)
    assert kept[-1].all_gather == n == 4


# --- State restored ----------------------------------------------------------


@registry.case()
def flags_restored_after_block() -> None:
    for keep, sync in OPTION_GRID:
        for backwards in (None, 2):
            model = f2.wrap(make_net())
            model(batch(0)).sum().backward()  # lazy init done, like a training loop
            model.zero_grad()
            before = fsdp2_snapshot(model)
            opts = dict(block_options(keep, sync), backwards=backwards)
            with no_reshard_between_backwards(model, **opts) as blk:
                out = model(batch(1))
                LOSSES[0](out).backward(retain_graph=True)
                if keep:
                    assert not fsdp2_all_sharded(model), "keep_unsharded freed params"
                LOSSES[1](out).backward()
            assert blk.backward_passes == 2
            assert fsdp2_snapshot(model) == before, (keep, sync, backwards)
            assert fsdp2_all_sharded(model), (keep, sync, backwards)


@registry.case()
def flags_restored_when_block_entered_before_first_forward() -> None:
    """FSDP2 picks its root lazily; the block then installs at the first forward."""
    model = f2.wrap(make_net())
    ref = reference_copy(make_net())
    run_parity(model, ref, Scenario(passes=2, steps=1), f2.ADAPTER)
    after_block = fsdp2_snapshot(model)
    other = f2.wrap(make_net())
    run_parity(other, reference_copy(make_net()), Scenario(passes=1, steps=1, use_block=False), f2.ADAPTER)
    assert after_block == fsdp2_snapshot(other)


def _raise_in(where: str, model: nn.Module, keep: bool, sync: str) -> None:
    opts = block_options(keep, sync)
    handle = None
    try:
        with pytest.raises(Boom):
            with no_reshard_between_backwards(model, **opts):
                if where == "forward":
                    handle = model.blocks[1].register_forward_hook(_boom_hook)
                out = model(batch(5))
                LOSSES[0](out).backward(retain_graph=True)
                if where == "between":
                    raise Boom("between passes")
                if where == "backward_hook":
                    out = out + 0
                    out.register_hook(_boom_grad_hook)
                LOSSES[1](out).backward()
    finally:
        if handle is not None:
            handle.remove()


def _boom_hook(*args):
    raise Boom("in forward")


def _boom_grad_hook(grad):
    raise Boom("inside backward")


@registry.case()
def exception_restores_state_and_next_step_is_correct() -> None:
    for where in ("forward", "between", "backward_hook"):
        for keep, sync in OPTION_GRID:
            model = f2.wrap(make_net())
            ref = reference_copy(make_net())
            model(batch(0)).sum().backward()
            ref(batch(0)).sum().backward()
            model.zero_grad()
            ref.zero_grad()
            before = fsdp2_snapshot(model)
            _raise_in(where, model, keep, sync)
            assert fsdp2_snapshot(model) == before, (where, keep, sync)
            assert fsdp2_all_sharded(model), (where, keep, sync)
            _check_plain_steps_match(model, ref)
            # ... and the block works again afterwards.
            run_parity(model, ref, Scenario(passes=2, steps=1, options=block_options(keep, sync), check_between=sync == "every"), f2.ADAPTER)


# --- Memory ------------------------------------------------------------------


def _param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@registry.case()
def kept_memory_is_released_after_block() -> None:
    """keep_unsharded holds the unsharded params between passes and frees them on exit.

    Budget after the block: memory before the forward + the sharded gradients
    (one sharded parameter's worth) + 10%. Between passes at least 90% of the
    unsharded bytes of the blocks (the root never reshards) must be held.
    """
    for sync in ("every", "last"):
        model = f2.wrap(make_net(depth=4, dim=64))
        full_bytes = _param_bytes(make_net(depth=4, dim=64))
        block_bytes = sum(_param_bytes(b) for b in make_net(depth=4, dim=64).blocks)
        opt = sgd(model)
        x = batch(0, dim=64)
        model(x).sum().backward()  # lazy init outside the measurement
        model.zero_grad()
        tracker = MemTracker()
        tracker.track_external(model, opt)
        sharded = full_bytes / dist.get_world_size()
        with tracker:
            start = _current(tracker)
            with no_reshard_between_backwards(model, sync_grads=sync):
                out = model(x)
                LOSSES[0](out).backward(retain_graph=True)
                between = _current(tracker)
                LOSSES[1](out).backward()
            del out
            after = _settled(tracker, (start + sharded) * 1.10)
        assert between - start >= 0.9 * block_bytes, (sync, start, between, block_bytes)
        assert after <= (start + sharded) * 1.10, (sync, start, after, sharded)
        assert fsdp2_all_sharded(model)


def _settled(tracker: MemTracker, bound: float, tries: int = 40) -> int:
    """Current bytes once gloo's finished work objects have let go of their buffers.

    gloo drops its references to collective buffers on its own thread, a little
    after the collective completes, so the count is read until it settles.
    """
    dist.barrier()  # once, so every rank calls the same collectives
    for _ in range(tries):
        current = _current(tracker)
        if current <= bound:
            return current
        time.sleep(0.05)
    return current


def _stable(tracker: MemTracker, tries: int = 40) -> int:
    """Current bytes once two reads 50 ms apart agree (see ``_settled``)."""
    last = None
    dist.barrier()  # once, so every rank calls the same collectives
    for _ in range(tries):
        current = _current(tracker)
        if current == last:
            return current
        last = current
        time.sleep(0.05)
    return current


def _current(tracker: MemTracker) -> int:
    snap = tracker.get_tracker_snapshot("current")
    return sum(v["Total"] for v in snap.values())


@registry.case()
def fifty_steps_do_not_grow_memory_or_hooks() -> None:
    model = f2.wrap(make_net())
    opt = sgd(model)
    tracker = MemTracker()
    tracker.track_external(model, opt)
    seen_memory, seen_hooks = set(), set()
    with tracker:
        for step in range(50):
            tracker.reset_mod_stats()
            keep, sync = OPTION_GRID[step % len(OPTION_GRID)]
            with no_reshard_between_backwards(model, **block_options(keep, sync)):
                out = model(batch(step))
                LOSSES[0](out).backward(retain_graph=True)
                LOSSES[1](out).backward()
            del out
            opt.step()
            opt.zero_grad()
            if step == 2:  # after momentum buffers exist
                baseline = _stable(tracker)
            if step >= 2:  # a leak grows every few steps and never settles back
                seen_memory.add(_settled(tracker, baseline))
                seen_hooks.add(repr(fsdp2_snapshot(model)))
    assert len(seen_memory) == 1, sorted(seen_memory)
    assert len(seen_hooks) == 1


# --- Misuse ------------------------------------------------------------------


@registry.case()
def misuse_gets_clear_errors() -> None:
    plain = make_net()
    with pytest.raises(ValueError, match="not wrapped by DDP or FSDP"):
        with no_reshard_between_backwards(plain):
            pass
    container = make_net()
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),))
    for block in container.blocks:
        torch.distributed.fsdp.fully_shard(block, mesh=mesh)
    with pytest.raises(ValueError, match="Wrap the root too"):
        with no_reshard_between_backwards(container):
            pass
    model = f2.wrap(make_net())
    model(batch(0)).sum().backward()
    before = fsdp2_snapshot(model)
    with pytest.raises(ValueError, match="non-root"):
        with no_reshard_between_backwards(model.blocks[0]):
            pass
    with pytest.raises(ValueError, match="already active"):
        with no_reshard_between_backwards(model):
            with no_reshard_between_backwards(model):
                pass
    assert fsdp2_snapshot(model) == before
    with pytest.raises(ValueError, match="sync_grads"):
        no_reshard_between_backwards(model, sync_grads="sometimes").__enter__()
    with pytest.raises(ValueError, match="backwards"):
        no_reshard_between_backwards(model, backwards=0).__enter__()
    with pytest.raises(TypeError, match="keep_unsharded"):
        no_reshard_between_backwards(model, keep_unsharded="yes").__enter__()
    # A DDP model is taken (tests/ddp/test_ddp.py); its misuses are refused as FSDP2's.
    ddp = torch.nn.parallel.DistributedDataParallel(make_net())
    with pytest.raises(ValueError, match="already active"):
        with no_reshard_between_backwards(ddp):
            with no_reshard_between_backwards(ddp):
                pass
    with pytest.raises(ValueError, match="reshard_to"):
        with no_reshard_between_backwards(ddp, reshard_to=1):
            pass
    with no_reshard_between_backwards(ddp):
        out = ddp(batch(0))
        out.sum().backward(retain_graph=True)
        out.pow(2).sum().backward()


@registry.case()
def non_root_before_lazy_init_errors_at_forward() -> None:
    model = f2.wrap(make_net())
    with pytest.raises(ValueError, match="non-root"):
        with no_reshard_between_backwards(model.blocks[0]):
            model(batch(0))
    # The model still trains normally.
    _check_plain_steps_match(model, reference_copy(make_net()))


@registry.case()
def backwards_count_mismatch_warns_and_stays_correct() -> None:
    for keep, sync in OPTION_GRID:
        model = f2.wrap(make_net())
        ref = reference_copy(make_net())
        options = dict(block_options(keep, sync), backwards=2)
        with pytest.warns(UserWarning, match="saw backward pass 3"):
            run_parity(model, ref, Scenario(passes=3, steps=1, options=options, check_between=sync == "every"), f2.ADAPTER)
        options = dict(block_options(keep, sync), backwards=3)
        with pytest.warns(UserWarning, match="exited after 2"):
            run_parity(model, ref, Scenario(passes=2, steps=1, options=options, check_between=sync == "every"), f2.ADAPTER)
        assert fsdp2_all_sharded(model)


@registry.case()
def backward_after_block_exit_regathers() -> None:
    """FSDP2 re-gathers on its own, so a pass after the block is still correct."""
    for keep, sync in OPTION_GRID:
        model = f2.wrap(make_net())
        ref = reference_copy(make_net())
        x = batch(0)
        with no_reshard_between_backwards(model, **block_options(keep, sync)):
            out = model(x)
            LOSSES[0](out).backward(retain_graph=True)
        LOSSES[1](out).backward()
        ref_out = ref(x)
        LOSSES[0](ref_out).backward(retain_graph=True)
        LOSSES[1](ref_out).backward()
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            grad = q.grad.clone()
            dist.all_reduce(grad)
            torch.testing.assert_close(
                p.grad.full_tensor(), grad / dist.get_world_size(), rtol=1e-5, atol=1e-5
            )


@registry.case()
def zero_grad_between_passes_variants() -> None:
    """optimizer.zero_grad(set_to_none=False) and model.zero_grad() between passes."""
    for keep, sync in OPTION_GRID:
        for how in ("model", "optimizer_keep_tensors"):
            model = f2.wrap(make_net())
            ref = reference_copy(make_net())
            opt, ref_opt = sgd(model), sgd(ref)
            x = batch(0)
            for m, o in ((model, opt), (ref, ref_opt)):
                block = (
                    no_reshard_between_backwards(m, **block_options(keep, sync))
                    if m is model
                    else contextlib.nullcontext()
                )
                with block:
                    out = m(x)
                    LOSSES[0](out).backward(retain_graph=True)
                    if how == "model":
                        m.zero_grad()
                    else:
                        o.zero_grad(set_to_none=False)
                    LOSSES[1](out).backward()
            for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
                grad = q.grad.clone()
                dist.all_reduce(grad)
                torch.testing.assert_close(
                    p.grad.full_tensor(),
                    grad / dist.get_world_size(),
                    rtol=1e-5,
                    atol=1e-5,
                    msg=lambda m, name=name: f"{keep} {sync} {how} {name}: {m}",
                )


@registry.case(world_sizes=(4,))
def parity_world_size_4() -> None:
    """4 ranks: each option pair once, reshard_after_forward True and False in turn
    (every pair with both at world size 2)."""
    for i, (keep, sync) in enumerate(OPTION_GRID):
        for raf in (i % 2 == 0,):
            model = f2.wrap(make_net(tied=True), reshard_after_forward=raf)
            ref = reference_copy(make_net(tied=True))
            scenario = Scenario(passes=3, zero_between=keep, options=block_options(keep, sync), check_between=sync == "every")

            def expect(counts, keep=keep, sync=sync, raf=raf) -> None:
                assert counts.all_gather == f2.expected_all_gathers(model, 3, keep, raf)
                assert counts.reduce_scatter == f2.expected_reduce_scatters(model, 3, sync)

            run_parity(model, ref, scenario, f2.ADAPTER, expect)



# --- Passes that start anywhere in the forward (see tests/support/any_start.py) ------
def _plain_all_gathers(run) -> int:
    """All-gathers of one plain step (``run(model, counts)``) on a fresh model."""
    net = make_net()
    model = f2.wrap(net)
    with count_collectives() as counts:
        run(net, model, counts)
    return counts.all_gather


@registry.case()
def any_start_passes() -> None:
    """FSDP2: passes from an activation inside a unit (blocks[1].fc1), the
    inner output of blocks[0] (before FSDP2's hooks wrap it) and a tensor that
    reaches only the root unit (inp), mixed with the output loss. Plain FSDP2
    crashes on the first (the unit was resharded after forward) and all-gathers
    again in each pass on the others. In the block each start set, with two of
    the four (keep_unsharded, sync_grads) pairs, matches the reference over 3
    steps after every pass, reduce-scatters each unit once per pass reaching it
    ("every") or once per step ("last"), and with keep_unsharded=True
    all-gathers only in the forward."""
    outcome = any_start.plain_fails_or_is_wrong(f2.wrap, f2.ADAPTER, ["inner", "out"])
    assert outcome.startswith("raised"), outcome

    def plain(net, model, counts):
        captured = any_start.Captured(net)
        starts = ["unit_out", "root_only"]
        any_start.step(model, captured, sgd(model), batch(0), starts,
                       contextlib.nullcontext(), f2.full_grads, counts)

    plain_ag = _plain_all_gathers(plain)
    for i, starts in enumerate(any_start.START_SETS):
        for keep, sync in (OPTION_GRID[i % 4], OPTION_GRID[(i + 2) % 4]):

            def expect(model, counts, starts=starts, keep=keep, sync=sync) -> None:
                rs = any_start.reductions(starts, sync)
                assert counts.reduce_scatter == rs, f"{counts.by_op}, expected {rs} reduce-scatters"
                if keep:
                    n = f2.units(model)
                    assert counts.all_gather == n, f"{counts.by_op}, expected {n} all-gathers"
                    if starts == any_start.START_SETS[2]:
                        assert plain_ag > n, f"plain FSDP2 all-gathered {plain_ag}, block {n}"

            options = block_options(keep, sync, len(starts) if i == 1 else None)
            model = any_start.parity(
                f2.wrap, f2.ADAPTER, starts, options, check_between=sync == "every", expect=expect
            )
            assert fsdp2_all_sharded(model)


@registry.case()
def penalty_across_passes() -> None:
    """FSDP2: create_graph=True in pass 1 (an input-gradient penalty), plain
    losses, then the penalty's backward (3 and 4 passes, "every" and "last")
    match the reference over 3 steps with keep_unsharded=True; False refuses."""
    for passes, sync in ((3, "every"), (3, "last"), (4, "every"), (4, "last")):
        model = any_start.penalty_parity(f2.wrap, f2.ADAPTER, dict(sync_grads=sync), passes=passes)
        assert fsdp2_all_sharded(model)
    model = f2.wrap(make_net())
    try:
        any_start.penalty_across_passes(
            model, batch(0), no_reshard_between_backwards(model, keep_unsharded=False)
        )
    except RuntimeError as exc:
        assert "needs keep_unsharded=True" in str(exc), exc
    else:
        raise AssertionError("keep_unsharded=False accepted create_graph=True")
    assert fsdp2_all_sharded(model)
