"""DeepSpeed ZeRO stages 0, 1 and 2 with backward passes inside a backward: a tiled MLP
(part of ``tests/deepspeed/cases_deepspeed.py``; CPU, gloo, 2 ranks, fp32). See [Note: nested
backward passes] in ``fsdp_retain/_nested.py`` and [Note: ZeRO stages 0-2 in the block]
in ``fsdp_retain/_deepspeed/_zero12.py``; the cached loss is in
``tests/deepspeed/cases_deepspeed_zero12.py``, ZeRO-3's tiled MLP in ``tests/deepspeed/cases_deepspeed_nested.py``.

``TiledNet`` of ``tests/support/nested_models.py`` (4 tiles: each tile's backward is a
``torch.autograd.backward`` inside the MLP's node), in fp32, under the engines of
``tests/deepspeed/cases_deepspeed_zero12.py`` (SGD with momentum), against an unsharded copy whose
gradients are averaged over the ranks (the union batch): gradients before and
parameters after each of 3 ``engine.step()``s, to 1e-5 (a missing or doubled tile is
off by ~1e-2). Two passes over one forward (``loss1``, then ``loss2``), optionally after
a probe pass (``block.backward(loss2, param_grads=False)``), whose tiles must write no
parameter gradient.

- ``zero12_nested_tiled_*``: a covering array (strength 2) over the stage,
  ``sync_grads``, ``engine.backward``/``loss.backward()``, a probe pass first, where the
  tiling sits (``inside``) and ``backwards``; one all-reduce per reducing pass whatever
  the number of tiles.
- ``zero12_nested_tiled_grads_probe``: ``block.grads`` per loss after a probe pass,
  combined into ``.grad``.
- ``zero12_nested_tiled_without_the_block``: plain ZeRO-1/2 with the same code are
  wrong or fail; plain ZeRO-0 with ``engine.backward`` is right by itself.
"""

from __future__ import annotations

import contextlib

import fsdp_retain
from fsdp_retain import no_reshard_between_backwards
from tests.support import nested_models as nm
from tests.support.case_parts import covering
from tests.deepspeed.cases_deepspeed_common import assert_close, counting, full_grads
from tests.deepspeed.cases_deepspeed_zero12 import Z12, _relative, engine_for, params_of
from tests.support.harness import Registry
from tests.support.parity import rank, step_averaged

registry = Registry()
TOL = dict(rtol=1e-5, atol=1e-5)
TILES = 4
STEPS = 3


def _reference_step(ref, opt, x) -> dict:
    out = ref(x)
    nm.loss1(out).backward(retain_graph=True)
    nm.loss2(out).backward()
    return step_averaged(ref, opt)


def _tiled(stage: int, sync: str = "every", engine_backward: bool = True,
           probe: bool = False, inside: bool = False, backwards: bool = False,
           grads: bool = False, use_block: bool = True) -> float:
    """Parity over ``STEPS`` steps; returns the largest relative gradient error (for the
    plain runs, which check nothing themselves)."""
    engine, ref, ref_opt = engine_for(Z12(stage=stage),
                                      nm.make_tiled(tiles=TILES, inside=inside).float())
    passes = 2 + int(probe)
    options = dict(sync_grads=sync, backwards=passes if backwards else None)
    worst = 0.0
    for step in range(STEPS):
        x = nm.tokens(rank(), step).float()
        expected = _reference_step(ref, ref_opt, x)
        block = (no_reshard_between_backwards(engine, **options) if use_block
                 else contextlib.nullcontext())
        with counting() as counts, block as b:
            out = engine(x)
            if probe:
                b.backward(nm.loss2(out), param_grads=False, retain_graph=True)
            if grads:  # per-loss gradients around the tiles' passes, then .grad
                per_loss = [b.grads(nm.loss1(out), retain_graph=True), b.grads(nm.loss2(out))]
                fsdp_retain.apply_grads(fsdp_retain.combine(per_loss, [1.0, 1.0]))
            else:
                for i, loss in enumerate((nm.loss1, nm.loss2)):
                    if engine_backward:
                        engine.backward(loss(out), retain_graph=i == 0)
                    else:
                        loss(out).backward(retain_graph=i == 0)
        got = full_grads(engine)
        worst = max(worst, _relative(got, expected))
        if use_block:
            assert b.backward_passes == passes, b.backward_passes
            # One reduction per reducing pass (this model's gradients fit one bucket),
            # whatever the number of tiles; block.grads: one per loss, and the exit's.
            want = 3 if grads else 2 if sync == "every" else 1
            assert counts.get("all_reduce", 0) == want, (step, dict(counts), want)
            assert_close(got, expected, f"step {step}: grads", tol=TOL)
        engine.step()
        if use_block:
            ref_params = {n: p.detach() for n, p in ref.named_parameters()}
            assert_close(params_of(engine), ref_params, f"step {step}: params", tol=TOL)
    return worst


def _name(stage: int, sync: str, engine_backward: bool, probe: bool, inside: bool,
          backwards: bool) -> str:
    where = "inside" if inside else "module"
    how = "engine" if engine_backward else "loss"
    return (f"zero12_nested_tiled_stage{stage}_{sync}_{how}_probe{int(probe)}_{where}"
            f"_backwards{int(backwards)}")


_FACTORS = dict(stage=(0, 1, 2), sync=("every", "last"), engine_backward=(True, False),
                probe=(False, True), inside=(False, True), backwards=(False, True))
for _row in covering(_FACTORS, strength=2):
    registry.add(_name(**_row), lambda row=_row: _tiled(**row))

registry.add("zero12_nested_tiled_grads_probe",
             lambda: _tiled(2, probe=True, grads=True))


@registry.case()
def zero12_nested_tiled_without_the_block() -> None:
    """The same code without the block: ZeRO-1/2 step on the last pass (or fail on a
    tile's second reduction of a partition); ZeRO-0 is right with ``engine.backward``."""
    for stage in (1, 2):
        for engine_backward in (True, False):
            how = "engine" if engine_backward else "loss"
            what = f"plain ZeRO-{stage}, tiled MLP, {how}.backward x2"
            try:
                error = _tiled(stage, engine_backward=engine_backward, use_block=False)
            except (AssertionError, RuntimeError, TypeError) as exc:
                print(f"{what}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            else:
                print(f"{what}: relative error {error:.3f}", flush=True)
                assert error > 0.3, (what, error)
    error = _tiled(0, use_block=False)
    print(f"plain ZeRO-0, tiled MLP, engine.backward x2: relative error {error:.2e}", flush=True)
    assert error < 1e-5, error
