"""The user's own FSDP2 reshard settings inside and after a block (CPU, gloo, 2 ranks).

Run inside ranks by ``tests/api/test_api_tp.py``. A group whose owner set
``set_reshard_after_backward(False)`` (gradient accumulation: keep the
parameters gathered across micro-batches) stays gathered after the block, as
after plain FSDP2's last backward; ``reshard_after_forward=False`` given to
``fully_shard`` keeps its meaning. Parity with an unsharded reference (SGD
with momentum, grads averaged over ranks), 2 steps.
"""

from __future__ import annotations

import contextlib

from torch.distributed.tensor import DTensor

from fsdp_retain import no_reshard_between_backwards
from fsdp_retain._fsdp2._inspect import fsdp2_all_sharded, fsdp2_param_groups
from fsdp_retain._measure import count_collectives
from tests.support import fsdp2_utils as f2
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
from tests.support.harness import Registry

registry = Registry()
PASSES = 2
STEPS = 2


def _accumulation(options: dict | None) -> list[int]:
    """Two micro-batches per step, ``PASSES`` backwards each; the first with
    ``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(False)``.
    Returns the all-gathers per step; checks parity and the group state after
    each micro-batch."""
    model, ref = f2.wrap(make_net()), reference_copy(make_net())
    opt, ref_opt = sgd(model), sgd(ref)
    gathers = []
    for step in range(STEPS):
        for mb in range(2):
            out = ref(batch(2 * step + mb))
            for i in range(PASSES):
                LOSSES[i](out).backward(retain_graph=i < PASSES - 1)
        for name, grad in averaged_grads(ref).items():
            ref.get_parameter(name).grad = grad
        ref_opt.step()
        ref_opt.zero_grad()
        gathers.append(0)
        for mb in range(2):
            with count_collectives() as counts:
                last = mb == 1
                model.set_requires_gradient_sync(last)
                model.set_reshard_after_backward(last)
                block = (no_reshard_between_backwards(model, **options)
                         if options is not None else contextlib.nullcontext())
                with block:
                    out = model(batch(2 * step + mb))
                    if options is None:  # plain FSDP2: one backward of the sum
                        sum(LOSSES[i](out) for i in range(PASSES)).backward()
                    else:
                        for i in range(PASSES):
                            LOSSES[i](out).backward(retain_graph=i < PASSES - 1)
                where = f"step {step} micro-batch {mb} options={options}"
                groups = fsdp2_param_groups(model)
                if last:
                    assert fsdp2_all_sharded(model), where
                elif options is None or options.get("keep_unsharded") is not False \
                        or options.get("backwards"):
                    # Left gathered, as the user asked; the modules show the
                    # unsharded parameters (plain tensors, not DTensors).
                    assert all(g.is_unsharded for g in groups), where
                    assert not isinstance(model.inp.weight, DTensor)
                else:
                    # keep_unsharded=False, backwards unknown: freed after each
                    # pass (the block's promise), not gathered again at exit.
                    assert fsdp2_all_sharded(model), where
            gathers[-1] += counts.all_gather
        opt.step()
        opt.zero_grad()
        assert_close_dicts(f2.full_params(model),
                           {n: p.detach() for n, p in ref.named_parameters()},
                           f"step {step} options={options}")
    return gathers


@registry.case()
def user_reshard_after_backward_false_stays_gathered() -> None:
    """All-gathers per step (n units, n - 1 blocks that reshard after forward):
    plain FSDP2: n + (n - 1) in micro-batch 1, (n - 1) in micro-batch 2 (its
    forward finds everything gathered). keep_unsharded=True: n (one forward
    gathers, the block keeps, the exit leaves them gathered for micro-batch 2).
    keep_unsharded=False with backwards=2: micro-batch 1 as plain FSDP2 plus one
    re-gather of all n in pass 2; micro-batch 2: (n - 1) + n."""
    n = f2.units(f2.wrap(make_net()))
    plain = _accumulation(None)
    assert plain == [n + 2 * (n - 1)] * STEPS, plain
    keep = _accumulation(dict(keep_unsharded=True))
    assert keep == [n] * STEPS, keep
    keep_last = _accumulation(dict(keep_unsharded=True, sync_grads="last", backwards=2))
    assert keep_last == [n] * STEPS, keep_last
    free_known = _accumulation(dict(keep_unsharded=False, backwards=2))
    assert free_known == [n + (n - 1) + n + (n - 1) + n] * STEPS, free_known
    free = _accumulation(dict(keep_unsharded=False))
    assert free == [2 * (n + (n - 1) + n)] * STEPS, free


@registry.case()
def user_reshard_after_forward_false() -> None:
    """``fully_shard(..., reshard_after_forward=False)``: no re-gather in pass 1;
    every option in parity, all-gathers from ``expected_all_gathers``, and
    every group resharded after the block (as after plain FSDP2's backward)."""
    for keep, sync in ((True, "every"), (False, "every"), (False, "last")):
        model = f2.wrap(make_net(), reshard_after_forward=False)
        ref = reference_copy(make_net())
        scenario = Scenario(passes=PASSES, steps=STEPS,
                            options=dict(keep_unsharded=keep, sync_grads=sync),
                            check_between=sync == "every")
        expected = f2.expected_all_gathers(model, PASSES, keep, reshard_after_forward=False)

        def check(counts, expected=expected) -> None:
            assert counts.all_gather == expected, (counts.all_gather, expected)
            assert fsdp2_all_sharded(model)

        run_parity(model, ref, scenario, f2.ADAPTER, expect_counts=check)
