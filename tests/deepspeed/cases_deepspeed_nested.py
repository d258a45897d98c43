"""DeepSpeed ZeRO-3 with backward passes inside a backward (CPU, gloo, 2 ranks, fp32):
a tiled MLP and a GradCache cached loss (``tests/support/nested_models.py``), run by
``tests/deepspeed/test_deepspeed.py``. See [Note: nested backward passes] in
``fsdp_retain/_nested.py`` and [Note: ZeRO-3 reductions in a span] in
``fsdp_retain/_deepspeed/_nested.py``.

ZeRO-3 refuses float64, so everything runs in fp32 and is compared, after each of 3
SGD-momentum steps, with an unsharded copy whose gradients are averaged over the ranks
(the union batch) to 1e-5: a missing or doubled tile is off by ~1e-2.

- ``nested_tiled_*``: ``TiledNet`` (4 tiles, ``engine.backward`` twice over one
  forward), a covering array (strength 2) over where the tiling sits (``inside``),
  ``keep_unsharded``, ``sync_grads``, ``backwards`` and a probe pass first. Plain ZeRO-3
  fails on the duplicate bucket entry for every tile after the first
  (``nested_tiled_without_the_block_fails``). ``block.grads`` per loss after a probe
  pass, combined into ``.grad`` (``nested_tiled_module_grads_probe``).
- ``nested_cached_*``: ``cached_step`` replaying its mini-batches from a hook on the loss
  (inside the trainer's backward, which never reaches the engine) or after it; with
  ``sync_grads="last"`` a replay's forward after a held pass is refused.
"""

from __future__ import annotations

import copy

import torch

import fsdp_retain
from fsdp_retain import no_reshard_between_backwards
from fsdp_retain._common import RetainError
from tests.support import nested_models as nm
from tests.support.case_parts import covering
from tests.deepspeed.cases_deepspeed_common import (
    assert_close,
    counting,
    ds_config,
    full_grads,
    full_params,
    initialize,
    setup,
)
from tests.support.harness import Registry
from tests.support.parity import rank, step_averaged

registry = Registry()
TOL = dict(rtol=1e-5, atol=1e-5)
TILES = 4
MINIBATCHES = 2


def _engine(model: torch.nn.Module):
    setup()
    model = model.float()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    engine, *_ = initialize(model, opt, ds_config())
    return engine, ref, torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9)


def _reference_step(ref, opt, run) -> dict:
    run(ref)
    return step_averaged(ref, opt)


def _check_step(engine, ref, expected: dict, step: int) -> None:
    assert_close(full_grads(engine), expected, f"step {step}: grads", tol=TOL)
    engine.step()
    ref_params = {n: p.detach() for n, p in ref.named_parameters()}
    assert_close(full_params(engine), ref_params, f"step {step}: params", tol=TOL)


def _modules_with_params(model: torch.nn.Module) -> int:
    return sum(1 for m in model.modules() if any(True for _ in m.parameters(recurse=False)))


def _tiled(inside: bool, keep: bool, sync: str, backwards: bool, probe: bool,
           grads: bool = False) -> None:
    engine, ref, ref_opt = _engine(nm.make_tiled(tiles=TILES, inside=inside))
    passes = 2 + int(probe)
    options = dict(keep_unsharded=keep, sync_grads=sync, backwards=passes if backwards else None)
    for step in range(3):
        x = nm.tokens(rank(), step).float()

        def reference(model):
            out = model(x)
            nm.loss1(out).backward(retain_graph=True)
            nm.loss2(out).backward()

        expected = _reference_step(ref, ref_opt, reference)
        with counting() as counts:
            with no_reshard_between_backwards(engine, **options) as block:
                out = engine(x)
                if probe:
                    block.backward(nm.loss2(out), param_grads=False, retain_graph=True)
                if grads:  # per-loss gradients around the tiles' passes, then .grad
                    per_loss = [block.grads(nm.loss1(out), retain_graph=True),
                                block.grads(nm.loss2(out))]
                    fsdp_retain.apply_grads(fsdp_retain.combine(per_loss, [1.0, 1.0]))
                else:
                    engine.backward(nm.loss1(out), retain_graph=True)
                    engine.backward(nm.loss2(out))
                assert block.backward_passes == passes, block.backward_passes
        counts = dict(counts)
        # One reduce-scatter per reducing pass (the bucket holds every gradient of this
        # model), whatever the number of tiles.
        want = {"reduce_scatter": 2 if sync == "every" else 1}
        if keep:
            # The forward gathers each module with parameters once; the tiles' passes
            # and the later passes find them gathered.
            want["all_gather"] = _modules_with_params(engine.module)
        got = {k: counts.get(k, 0) for k in want}
        assert got == want, f"step {step}: collectives {counts}, expected {want}"
        _check_step(engine, ref, expected, step)


def _name(inside: bool, keep: bool, sync: str, backwards: bool, probe: bool) -> str:
    where = "inside" if inside else "module"
    return (f"nested_tiled_{where}_keep{int(keep)}_{sync}_backwards{int(backwards)}"
            f"_probe{int(probe)}")


_FACTORS = dict(inside=(False, True), keep=(True, False), sync=("every", "last"),
                backwards=(False, True), probe=(True, False))
for _row in covering(_FACTORS, strength=2):
    registry.add(_name(**_row), lambda row=_row: _tiled(**row))


def _tiled_without_the_block() -> None:
    """Plain ZeRO-3, one pass: each tile's AccumulateGrad hook puts the parameter in
    the reduce bucket again (see [Note: ZeRO-3 reductions in a span])."""
    engine, _, _ = _engine(nm.make_tiled(tiles=TILES))
    out = engine(nm.tokens(rank(), 0).float())
    try:
        engine.backward(nm.loss1(out))
    except AssertionError:
        pass
    else:
        raise AssertionError("plain ZeRO-3 ran a tiled MLP's backward without failing")


registry.add("nested_tiled_without_the_block_fails", _tiled_without_the_block)
registry.add("nested_tiled_module_grads_probe", lambda: _tiled(
    inside=False, keep=False, sync="every", backwards=False, probe=True, grads=True))


def _cached(replay: str, keep: bool, engine_backward: bool = False) -> None:
    engine, ref, ref_opt = _engine(nm.make_encoder())
    backward = engine.backward if engine_backward else None
    for step in range(3):
        queries, docs = (t.float() for t in nm.pairs(rank(), step))
        expected = _reference_step(
            ref, ref_opt, lambda model: nm.plain_ranking_step(model, queries, docs))
        with counting() as counts:
            with no_reshard_between_backwards(engine, keep_unsharded=keep) as block:
                nm.cached_step(engine, queries, docs, MINIBATCHES, replay=replay,
                               backward=backward)
                # One pass per replayed mini-batch; the loss's own pass never reaches
                # the engine.
                assert block.backward_passes == 2 * MINIBATCHES, block.backward_passes
        assert counts["reduce_scatter"] == 2 * MINIBATCHES, dict(counts)
        _check_step(engine, ref, expected, step)


registry.add("nested_cached_hook_keep1_every", lambda: _cached("hook", True))
registry.add("nested_cached_after_keep0_every", lambda: _cached("after", False))
# The Trainer's way under DeepSpeed: engine.backward of the loss whose hook replays (no
# epilogue at a pass's end inside engine.backward: each replay runs it itself).
registry.add("nested_cached_hook_engine_backward", lambda: _cached("hook", True, True))


def _cached_last_refused() -> None:
    """Each replay runs its own forward: after a held pass, refused (a hook's replay
    too, though it runs inside the trainer's backward), before any reduction."""
    engine, _, _ = _engine(nm.make_encoder())
    queries, docs = (t.float() for t in nm.pairs(rank(), 0))
    before = full_grads(engine)
    try:
        with no_reshard_between_backwards(engine, sync_grads="last"):
            nm.cached_step(engine, queries, docs, MINIBATCHES, replay="hook")
    except RetainError as err:
        assert "sync_grads='every'" in str(err), err
    else:
        raise AssertionError("sync_grads='last' ran a cached loss's replays")
    after = full_grads(engine)
    for name, grad in before.items():
        assert (grad is None) == (after[name] is None), name
        if grad is not None:
            torch.testing.assert_close(after[name], grad, rtol=0, atol=0)


registry.add("nested_cached_last_refused", _cached_last_refused)
