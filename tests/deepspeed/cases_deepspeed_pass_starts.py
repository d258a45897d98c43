"""DeepSpeed ZeRO-3: where a pass starts and which forward it runs over (part of
``tests/deepspeed/cases_deepspeed.py``).

ZeRO-3's engine runs its backward prologue from a once-per-forward hook on the
engine output; the block runs it for every later pass. These cases check the
passes that hook does not see once per block: a first pass that starts inside the
model (it never reaches the engine output), two forwards in one block (each output
has its own hook), and a forward before the block. Parity with an unsharded
reference over 3 SGD-momentum steps, collectives by formula (see
``tests/deepspeed/cases_deepspeed_common.py``), for keep_unsharded x sync_grads x ``engine.backward``
or ``loss.backward()``. Refused with a RetainError naming the fix: a forward before
the block; with ``sync_grads="last"`` a forward after a held-back pass; a
``loss.backward()`` from inside the model under gradient accumulation. A loss that
mixes a forward from before the block with one inside is right, where plain DeepSpeed
leaves it unreduced under ``loss.backward()``.
"""

from __future__ import annotations

import itertools

from fsdp_retain._common import RetainError
from tests.deepspeed.cases_deepspeed_common import (
    Scenario,
    assert_all_released,
    ds_config,
    engine_micro_step,
    make_engine,
    run_parity,
)
from tests.support.harness import Registry

registry = Registry()


def _parity_case(check_counts: bool = True, **fields):
    return lambda: run_parity(Scenario(**fields), check_counts=check_counts)


def _name(fields: dict) -> str:
    return "parity_" + "_".join(f"{k}{int(v) if isinstance(v, bool) else v}" for k, v in fields.items())


def _refused_case(message: str, **fields):
    """The block raises ``message`` (a RetainError naming the fix) in the first micro-batch."""

    def run() -> None:
        scenario = Scenario(**fields)
        engine, _ = make_engine(ds_config(gas=scenario.gas))
        try:
            engine_micro_step(engine, scenario, 0, 0)
        except RetainError as exc:
            assert message in str(exc), exc
        else:
            raise AssertionError(f"{scenario} was accepted")
        engine.optimizer.zero_grad()
        assert_all_released(engine)

    return run


for keep, sync, engine_backward in itertools.product((True, False), ("every", "last"), (True, False)):
    extras = (
        dict(inner_first=True),
        dict(inner_first=True, passes=3),
        dict(forwards=2),
        dict(forwards=2, interleave=True, passes=3),
    )
    for extra in extras:
        fields = dict(keep=keep, sync=sync, engine_backward=engine_backward, **extra)
        if sync == "last" and extra.get("interleave"):
            # A forward after a held-back pass: refused (FORWARD_AFTER_HELD_PASS).
            if engine_backward:
                registry.add("refused_" + _name(fields)[len("parity_"):], _refused_case(
                    "Run every forward before the block's first backward pass", **fields))
            continue
        registry.add(_name(fields), _parity_case(**fields))

# Gradient accumulation: engine.backward scales the loss; loss.backward() from inside
# the model misses DeepSpeed's division on the output (UNSCALED).
registry.add("parity_inner_first1_gas2", _parity_case(inner_first=True, gas=2))
registry.add("refused_inner_first1_gas2_engine_backward0", _refused_case(
    "Use engine.backward(loss)", inner_first=True, gas=2, engine_backward=False))

# A forward before the block (FORWARD_OUTSIDE, as on FSDP1).
for keep, engine_backward in itertools.product((True, False), (True, False)):
    fields = dict(keep=keep, engine_backward=engine_backward, forward_outside=True)
    registry.add("refused_" + _name(fields)[len("parity_"):], _refused_case(
        "Run the forward inside the block", **fields))

# One loss over a forward from before the block and one inside (pass i's loss summed
# over both): right with the block (its hook on the outside forward's output cannot
# run the engine prologue a second time in a pass), every pass count and option.
# ZeRO-3 gathers for the outside forward too, so no collective formula. 2 steps: at
# step 3 fp32 reassociation on the summed loss reaches 1.1e-4 on one embedding element
# of ~0.3, bit for bit the same with both forwards inside the block.
for passes, sync, engine_backward in itertools.product((1, 2), ("every", "last"), (True, False)):
    fields = dict(passes=passes, keep=passes == 1, sync=sync, engine_backward=engine_backward,
                  forwards=2, forward_outside=True, mixed=True, steps=2)
    registry.add(_name(fields), _parity_case(check_counts=False, **fields))
# The same loss with gradient accumulation, and after a probe pass (which runs no prologue).
for extra in (dict(gas=2, engine_backward=True), dict(gas=2, engine_backward=False),
              dict(probe_first=True, sync="every"), dict(probe_first=True, sync="last")):
    fields = dict(forwards=2, forward_outside=True, mixed=True, steps=2, **extra)
    if not extra.get("engine_backward", True) or "probe_first" in extra:
        fields["engine_backward"] = False
    registry.add(_name(fields), _parity_case(check_counts=False, **fields))


@registry.case()
def plain_mixed_forwards_loss_backward_wrong() -> None:
    """Without the block, two forwards and one ``loss.backward()`` over both: DeepSpeed's
    prologue runs twice (one hook per output), its epilogue is skipped and the
    gradients are left unreduced (so the block's shadowed prologue is needed)."""
    scenario = Scenario(passes=1, forwards=2, mixed=True, engine_backward=False,
                        use_block=False, steps=1)
    try:
        run_parity(scenario, check_counts=False)
    except AssertionError as exc:
        assert "grads" in str(exc), exc
    else:
        raise AssertionError("plain DeepSpeed got the right gradients")
