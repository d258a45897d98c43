"""DeepSpeed ZeRO-3 parity grid and what goes wrong without the block (part of
``tests/deepspeed/cases_deepspeed.py``).

The grid: 2 and 3 passes, keep_unsharded, sync_grads, backwards known or not,
``engine.backward`` or ``loss.backward()``, every 3 of them in each combination; then, per keep_unsharded x sync_grads,
gradient accumulation, bf16, a probe pass first, resident parameters, the saved-tensor
check, zero_grad between passes and a last pass that starts inside the model (each with
every keep_unsharded and every sync_grads value). Parity
with an unsharded reference over 3 SGD-momentum steps, collectives by formula (see
``tests/deepspeed/cases_deepspeed_common.py``). Without the block: pass 2 fails on released
parameters, or with resident parameters gives wrong gradients.
"""

from __future__ import annotations


import torch

from tests.deepspeed.cases_deepspeed_common import (
    Scenario,
    assert_close,
    ds_config,
    engine_micro_step,
    full_grads,
    losses,
    make_engine,
    reference_step,
    run_parity,
    tokens,
)
from tests.support.case_parts import covering
from tests.support.harness import Registry

registry = Registry()


def _parity_case(**fields):
    return lambda: run_parity(Scenario(**fields))


def _name(fields: dict) -> str:
    return "parity_" + "_".join(f"{k}{int(v) if isinstance(v, bool) else v}" for k, v in fields.items())


# Every 3 of the 5 options meet in each combination of their values (12 of the 32).
for fields in covering(dict(passes=(2, 3), keep=(True, False), sync=("every", "last"),
                            backwards=(False, True), engine_backward=(True, False)), strength=3):
    registry.add(_name(fields), _parity_case(**fields))

EXTRAS = (
    dict(gas=2),
    dict(bf16=True),
    dict(probe_first=True, passes=3),
    dict(persist=True),
    dict(check=True),
    dict(zero_between=True, passes=3),
    dict(inner_last=True),
    dict(inner_last=True, engine_backward=False),
)
# Each extra with each keep_unsharded and each sync_grads value (every pair meets).
for extra, keep, sync in (tuple(row.values()) for row in covering(dict(
    extra=range(len(EXTRAS)), keep=(True, False), sync=("every", "last")), strength=2)):
    extra = EXTRAS[extra]
    if extra.get("zero_between") and sync == "last":
        # DeepSpeed 0.19.8's zero_grad() calls record_stream on the held .grad,
        # which fails on CPU ("unknown parameter type").
        sync = "every"
    fields = dict(keep=keep, sync=sync, **extra)
    if _name(fields) not in registry.cases:
        registry.add(_name(fields), _parity_case(**fields))


@registry.case()
def plain_one_pass_matches_reference() -> None:
    """Baseline: DeepSpeed alone, one backward per forward, matches the reference."""
    run_parity(Scenario(passes=1, use_block=False), check_counts=False)


@registry.case()
def without_block_second_pass_fails() -> None:
    """The bug: DeepSpeed alone releases every parameter after pass 1."""
    engine, _ = make_engine(ds_config())
    out = engine(tokens(0)).logits
    first, second = losses(out, 2)
    engine.backward(first, retain_graph=True)
    try:
        engine.backward(second)
    except RuntimeError as exc:
        assert "size of tensor" in str(exc), exc
    else:
        raise AssertionError("pass 2 without the block was expected to fail")



@registry.case()
def without_block_resident_parameters_are_wrong() -> None:
    """DeepSpeed's default persistence threshold keeps this model resident. In the
    first step ZeRO-3 still releases them (it has not traced the model yet), so pass
    2 fails; once traced, pass 2 runs and the gradients are wrong."""
    engine, ref = make_engine(ds_config(stage3_param_persistence_threshold=100_000))
    assert all(p.ds_persist for p in engine.module.parameters())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9)
    two = Scenario(passes=2, use_block=False)
    try:
        engine_micro_step(engine, two, 0, 0)
    except RuntimeError as exc:
        assert "size of tensor" in str(exc), exc
    else:
        raise AssertionError("pass 2 of the first step was expected to fail")
    engine.optimizer.zero_grad()
    for step in (1, 2):
        plain = Scenario(passes=1, use_block=False)
        expected = reference_step(ref, ref_opt, plain, step)
        engine_micro_step(engine, plain, step, 0)
        assert_close(full_grads(engine), expected, f"plain step {step}")
        engine.step()
    expected = reference_step(ref, ref_opt, two, 3)
    try:
        engine_micro_step(engine, two, 3, 0)
        assert_close(full_grads(engine), expected, "two passes, traced")
    except AssertionError as exc:
        print(f"wrong as expected: {str(exc)[:400]}", flush=True)
    else:
        raise AssertionError("2 passes without the block matched the reference")
