"""DeepSpeed ZeRO-3 configurations refused and state restored (part of
``tests/deepspeed/cases_deepspeed.py``).

A nested block, a byte budget, ``engine.step()`` inside the block and
a backward after the block exited are refused; after a clean or failed block (keep_unsharded x sync_grads) the engine's
hooks, coordinator, optimizer flags and ``.grad`` are as before, and plain training
goes on matching the reference.
"""

from __future__ import annotations

import itertools

import torch

from fsdp_retain import no_reshard_between_backwards
from fsdp_retain._common import RetainError
from tests.deepspeed.cases_deepspeed_common import (
    Scenario,
    assert_all_released,
    assert_close,
    ds_config,
    engine_micro_step,
    full_grads,
    full_params,
    losses,
    make_engine,
    reference_step,
    tokens,
)
from tests.support.harness import Registry

registry = Registry()


def snapshot(engine) -> dict:
    """What the block may touch: hooks (but those it keeps on the engine, [Note: hooks
    kept on the model], which no block runs), coordinator overrides, optimizer flags."""
    opt = engine.optimizer
    coordinator = opt.parameter_offload.get_param_coordinator()
    kept = engine.__dict__.get("_fsdp_retain_hooks")
    ours = {handle.id for handle in kept.handles} if kept is not None else set()
    hooks = [
        (len(m._forward_pre_hooks.keys() - ours), len(m._forward_hooks.keys() - ours),
         len(m._backward_hooks))
        for m in (engine, *engine.module.modules())
    ]
    return dict(
        hooks=hooks,
        running=None if kept is None else kept.block,
        coordinator=sorted(coordinator.__dict__),
        coalesce=opt._coalesce_grad_reduction,
        micro_step=opt.micro_step_id,
        depth=opt._backward_hook_state.backward_active_depth,
        grads=[p.grad is None for p in engine.module.parameters()],
    )


def _state_case(keep: bool, sync: str, fail: bool):
    def run() -> None:
        engine, ref = make_engine(ds_config())
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9)
        plain = Scenario(passes=1, use_block=False)
        before = snapshot(engine)
        options = dict(keep_unsharded=keep, sync_grads=sync)
        try:
            with no_reshard_between_backwards(engine, **options):
                out = engine(tokens(0)).logits
                first, second = losses(out, 2)
                engine.backward(first, retain_graph=True)
                if fail:
                    raise KeyError("boom")
                engine.backward(second)
        except KeyError:
            assert fail
            # The reduced pass stays in ZeRO-3's partitions; drop it as
            # DeepSpeed would after a failed micro-batch.
            engine.optimizer.zero_grad()
        after = snapshot(engine)
        if not fail:
            assert after["micro_step"] == before["micro_step"], after
        after["micro_step"] = before["micro_step"]
        assert after == before, f"{before} -> {after}"
        assert_all_released(engine)
        if not fail:
            engine.step()
            reference_step(ref, ref_opt, Scenario(passes=2), 0)
        for step in range(1, 3):
            checked_step(engine, ref, ref_opt, plain, step)

    return run


def checked_step(engine, ref, ref_opt, scenario: Scenario, step: int) -> None:
    """One micro-batch of ``scenario`` and the optimizer step after it, the gradients
    and then the parameters checked against the reference's."""
    expected = reference_step(ref, ref_opt, scenario, step)
    engine_micro_step(engine, scenario, step, 0)
    assert_close(full_grads(engine), expected, f"step {step}: grads")
    engine.step()
    ref_params = {n: p.detach() for n, p in ref.named_parameters()}
    assert_close(full_params(engine), ref_params, f"step {step}: params")


for keep, sync, fail in itertools.product((True, False), ("every", "last"), (False, True)):
    name = f"state_{'keep' if keep else 'regather'}_{sync}_{'exception' if fail else 'clean'}"
    registry.add(name, _state_case(keep, sync, fail))


@registry.case()
def nested_block_is_rejected() -> None:
    engine, _ = make_engine(ds_config())
    with no_reshard_between_backwards(engine):
        try:
            no_reshard_between_backwards(engine).__enter__()
        except ValueError as exc:
            assert "already active" in str(exc), exc
        else:
            raise AssertionError("a nested block was accepted")
    assert_all_released(engine)


@registry.case()
def byte_budget_is_rejected() -> None:
    """keep_unsharded as an int (FSDP1/FSDP2 only) raises a ValueError naming the fix."""
    engine, _ = make_engine(ds_config())
    try:
        with no_reshard_between_backwards(engine, keep_unsharded=2**20):
            pass
    except ValueError as exc:
        assert "keep_unsharded=True or False" in str(exc), exc
    else:
        raise AssertionError("a byte budget was accepted on DeepSpeed")
    assert_all_released(engine)


def _after_exit_case(keep: bool, sync: str, engine_backward: bool):
    """A backward over the block's forward after the block exited: a RetainError that
    names the fix, raised before any node runs (not ZeRO-3's size-0 error); the
    engine then trains on, matching the reference."""

    def run() -> None:
        engine, ref = make_engine(ds_config())
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9)
        with no_reshard_between_backwards(engine, keep_unsharded=keep, sync_grads=sync):
            out = engine(tokens(0)).logits
            first, second = losses(out, 2)
            engine.backward(first, retain_graph=True)
        try:
            engine.backward(second) if engine_backward else second.backward()
        except RetainError as exc:
            assert "Move this backward inside the block" in str(exc), exc
        else:
            raise AssertionError("a backward after the block exited was accepted")
        engine.optimizer.zero_grad()  # the step is dropped, on both sides
        assert_all_released(engine)
        plain = Scenario(passes=1, use_block=False)
        for step in range(1, 3):
            expected = reference_step(ref, ref_opt, plain, step)
            engine_micro_step(engine, plain, step, 0)
            assert_close(full_grads(engine), expected, f"plain step {step}: grads")
            engine.step()

    return run


for keep, sync, engine_backward in itertools.product((True, False), ("every", "last"), (True, False)):
    name = (f"backward_after_exit_is_rejected_{'keep' if keep else 'regather'}_{sync}_"
            f"{'engine_backward' if engine_backward else 'loss_backward'}")
    registry.add(name, _after_exit_case(keep, sync, engine_backward))


@registry.case()
def step_inside_block_is_rejected() -> None:
    engine, _ = make_engine(ds_config())
    try:
        with no_reshard_between_backwards(engine):
            out = engine(tokens(0)).logits
            engine.backward(losses(out, 1)[0])
            engine.step()
    except RuntimeError as exc:
        assert "Call engine.step() after the" in str(exc), exc
    else:
        raise AssertionError("engine.step() inside the block was accepted")
    assert "step" not in engine.__dict__
    assert_all_released(engine)


def _module_hooks(engine) -> int:
    modules = [engine, *engine.module.modules()]
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in modules)


@registry.case()
def hooks_kept_across_blocks() -> None:
    """[Note: hooks kept on the model] on ZeRO-3: the block's module hooks (probe
    targets, sources, the output guards, the engine output's recording) are installed
    at the first block and reused by the next ones (one record, the same hook count),
    with a probe pass first in each; between blocks they do nothing: a plain ZeRO-3
    step outside the block keeps parity. 4 steps, every parameter released after each."""
    engine, ref = make_engine(ds_config())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9)
    before = _module_hooks(engine)
    in_block = Scenario(passes=2, probe_first=True)
    plain = Scenario(passes=1, use_block=False)
    records, counts = [], []
    for step, scenario in enumerate((in_block, in_block, plain, in_block)):
        checked_step(engine, ref, ref_opt, scenario, step)
        assert_all_released(engine)
        records.append(engine.__dict__["_fsdp_retain_hooks"])
        counts.append(_module_hooks(engine))
    assert all(record is records[0] for record in records), records
    assert records[0].block is None
    assert len(set(counts)) == 1 and counts[0] > before, (before, counts)
