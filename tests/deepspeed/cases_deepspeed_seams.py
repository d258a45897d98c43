"""Who steps and who scales on DeepSpeed, every way in (part of
``tests/deepspeed/cases_deepspeed.py``; CPU, gloo, 2 ranks). See [Note: who steps and who
scales on DeepSpeed] in ``fsdp_retain/_deepspeed/_step.py``; the drivers are in
``tests/support/ds_seams.py``.

The grid: every driver (a plain engine loop; accelerate's own loop with ``accumulate()``
and, ``accelerate_no_accumulate``, without it; transformers' ``Trainer`` with
``RetainTrainerMixin``) x ZeRO-0..3 x every entry the driver offers (``loss.backward()``,
``engine.backward`` with and without ``scale_wrt_gas``, ``accelerator.backward``,
``block.backward``, ``block.grads`` with ``apply_grads``), two losses over one forward per
micro-batch, gradient accumulation 2 (and each entry once at accumulation 1, the stage
rotating), 2 optimizer steps: the parameters equal a one-process replay of the batches
each rank got (to 1e-4 of the largest update: a missed step is off by 1, a loss divided
twice by about 0.5) and the engine stepped once per window. Under the Trainer,
``engine.backward(loss)`` without ``scale_wrt_gas`` at accumulation 2 is refused before
its pass (the Trainer divided the loss already).

Plain DeepSpeed beside it (``PLAIN``): the same code without the library at accumulation
2, every entry that exists without it, with what it does (right, wrong, the engine never
steps, or which error); docs/integrations/deepspeed_seams.md has the same table.
"""

from __future__ import annotations

import itertools

from tests.support.ds_seams import ENTRIES, STEPS, Outcome, Seams, outcome
from tests.support.harness import Registry

registry = Registry()
TOL = 1e-4

_DRIVER_ENTRIES = {
    "engine": [e for e in ENTRIES if e != "accelerator.backward"],
    "accelerate": list(ENTRIES),
    "accelerate_no_accumulate": ["accelerator.backward"],
    "trainer": list(ENTRIES),
}

_FAILS = ("Direct calls to tensor.backward()", "KeyError", "size of tensor a (0)",
          "modified by an inplace operation")
_DIRECT, _RELEASED = ("fails: Direct calls to tensor.backward()", "fails: size of tensor a (0)")
# What plain DeepSpeed does with two passes per micro-batch, accumulation 2, per stage 0-3.
PLAIN = {
    ("engine", "loss.backward"): (_DIRECT, "fails: KeyError", "fails: KeyError", _RELEASED),
    ("engine", "engine.backward"): ("right", "wrong", "wrong", _RELEASED),
    ("engine", "engine.backward(scale_wrt_gas=False)"): ("right", "wrong", "wrong", _RELEASED),
    ("accelerate", "accelerator.backward"): (
        "fails: modified by an inplace operation", "wrong", "wrong", _RELEASED),
    ("accelerate", "loss.backward"): (_DIRECT, "no step", "no step", _RELEASED),
    ("accelerate", "engine.backward"): ("no step", "no step", "no step", _RELEASED),
    ("trainer", "accelerator.backward"): (
        "fails: modified by an inplace operation", "wrong", "wrong", _RELEASED),
    ("trainer", "loss.backward"): (_DIRECT, "no step", "no step", _RELEASED),
}


def _name(case: Seams) -> str:
    entry = (case.entry.replace("engine.backward(scale_wrt_gas=False)", "engine_unscaled")
             .replace(".", "_"))
    plain = "_plain" if not case.use_block else ""
    return f"seams{plain}_{case.driver}_zero{case.stage}_gas{case.gas}_{entry}"


def _windows(case: Seams) -> int:
    """The optimizer steps DeepSpeed takes: one per window (every micro-batch without
    accelerate's accumulate(), which then syncs each)."""
    return STEPS * (case.gas if case.driver == "accelerate_no_accumulate" else 1)


def verdict(case: Seams, result: Outcome) -> str:
    if result.raised:
        return "fails: " + next((key for key in _FAILS if key in result.raised), result.raised)
    if result.steps == 0:
        return "no step"
    return "right" if result.error <= TOL and result.steps == _windows(case) else "wrong"


def _check(case: Seams) -> None:
    result = outcome(case)
    print(f"{_name(case)}: {verdict(case, result)} (error {result.error:.3g}, "
          f"{result.steps} steps) {result.raised[:200]}")
    if not case.use_block:
        assert verdict(case, result) == PLAIN[case.driver, case.entry][case.stage], result
        return
    if case.driver == "trainer" and case.entry == "engine.backward" and case.gas > 1:
        assert "divided twice" in result.raised and "Nothing was computed" in result.raised
        return
    assert verdict(case, result) == "right", result


def _add(case: Seams) -> None:
    registry.add(_name(case), lambda: _check(case))


for _driver, _entries in _DRIVER_ENTRIES.items():
    for _stage, _entry in itertools.product(range(4), _entries):
        _add(Seams(_driver, _stage, 2, _entry))
    if _driver != "accelerate_no_accumulate":
        for _index, _entry in enumerate(_entries):
            _add(Seams(_driver, _index % 4, 1, _entry))
for (_driver, _entry), _verdicts in PLAIN.items():
    for _stage in range(4):
        _add(Seams(_driver, _stage, 2, _entry, use_block=False))
