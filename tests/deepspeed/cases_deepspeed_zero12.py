"""DeepSpeed ZeRO stages 0, 1 and 2 (part of ``tests/deepspeed/cases_deepspeed.py``; CPU, gloo, 2
ranks): the block's parity grid, its settings, what plain DeepSpeed does, the refusals,
per-loss gradients and a cached (GradCache) loss; a tiled MLP is in
``tests/deepspeed/cases_deepspeed_zero12_nested.py``. See [Note: ZeRO stages 0-2 in the block] in
``fsdp_retain/_deepspeed/_zero12.py``.

Parity: the tiny Qwen2 of ``tests/deepspeed/cases_deepspeed_common.py`` (seed 42 weights, inputs
from ``42 + rank + 1``) against an unsharded copy whose gradients are averaged over the
ranks (the union batch), SGD with momentum, gradients before and parameters after each
of 3 ``engine.step()``s; fp32 to 1e-4 (ZeRO refuses float64), bf16 and fp16 within their
rounding (``assert_close(..., bf16=True)``). Pass ``i`` runs ``LOSSES[(i + 1) % 3]``: the
first pass's loss is the largest, so a lost pass shows (plain ZeRO-1/2: ~100%).

Collectives per micro-batch inside the block (``all_reduce``: DeepSpeed reduces the
gradients of this model with one all-reduce per flush on gloo): one per pass that
computes gradients with ``sync_grads="every"``, one with ``"last"``; with gradient
accumulation on ZeRO-0 and ZeRO-1 none off the boundary, as plain DeepSpeed
(``collectives``; ``zero12_gas2_*`` count plain DeepSpeed beside the block).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import torch

import fsdp_retain
from fsdp_retain import no_reshard_between_backwards
from fsdp_retain._common import RetainError
from tests.support import nested_models as nm
from tests.support.case_parts import covering
from tests.deepspeed.cases_deepspeed_common import (
    TOL,
    TOL_ACCUMULATED,
    assert_close,
    counting,
    full_grads,
    initialize,
    make_model,
    setup,
    tokens,
)
from tests.support.harness import Registry
from tests.support.parity import LOSSES, averaged_grads, rank

registry = Registry()


@dataclasses.dataclass
class Z12:
    stage: int = 2
    passes: int = 2
    sync: str = "every"
    backwards: bool = False
    engine_backward: bool = True
    gas: int = 1
    bf16: bool = False
    fp16: bool = False
    overlap: bool = False
    contiguous: bool = True
    offload: bool = False
    accum_fp32: bool = False  # fp16/bf16 gradients accumulated in fp32 (grad_accum)
    clip: float = 0.0
    probe_first: bool = False
    use_block: bool = True
    steps: int = 3

    def config(self) -> dict:
        zero: dict = {"stage": self.stage}
        if self.stage > 0:
            zero.update(overlap_comm=self.overlap, contiguous_gradients=self.contiguous)
        if self.offload:
            zero["offload_optimizer"] = {"device": "cpu"}
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": self.gas,
            "zero_optimization": zero,
            "bf16": {"enabled": self.bf16},
            "gradient_clipping": self.clip,
            "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False,
            "steps_per_print": 10**9,
        }
        if self.fp16:
            config["fp16"] = {"enabled": True, "initial_scale_power": 8}
        if self.accum_fp32:
            config["data_types"] = {"grad_accum_dtype": "fp32"}
        return config

    @property
    def low_precision(self) -> bool:
        return self.bf16 or self.fp16


def loss(logits: torch.Tensor, index: int) -> torch.Tensor:
    return LOSSES[(index + 1) % len(LOSSES)](logits.float())


def engine_for(scenario: Z12, model: torch.nn.Module | None = None):
    setup()
    model = make_model() if model is None else model
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    engine, *_ = initialize(model, opt, scenario.config())
    return engine, ref, torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9)


def reference_step(ref, opt, scenario: Z12, step: int) -> dict:
    for micro in range(scenario.gas):
        out = ref(tokens(step, micro)).logits
        for i in range(scenario.passes):
            if not (scenario.probe_first and i == 0):
                (loss(out, i) / scenario.gas).backward(retain_graph=i < scenario.passes - 1)
    grads = averaged_grads(ref)
    for name, param in ref.named_parameters():
        param.grad = grads[name].clone()
    if scenario.clip:
        torch.nn.utils.clip_grad_norm_(ref.parameters(), scenario.clip)
    opt.step()
    opt.zero_grad()
    return grads


def micro_step(engine, scenario: Z12, step: int, micro: int) -> None:
    options = dict(sync_grads=scenario.sync,
                   backwards=scenario.passes if scenario.backwards else None)
    block = (no_reshard_between_backwards(engine, **options) if scenario.use_block
             else contextlib.nullcontext())
    with block as b:
        out = engine(tokens(step, micro)).logits
        for i in range(scenario.passes):
            this, retain = loss(out, i), i < scenario.passes - 1
            if scenario.probe_first and i == 0:
                b.backward(this, param_grads=False, retain_graph=True)
            elif scenario.engine_backward:
                engine.backward(this, retain_graph=retain)
            else:
                this.backward(retain_graph=retain)


def params_of(engine) -> dict:
    if engine.zero_optimization_stage() == 0:
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).detach().clone()
            for n, p in engine.module.named_parameters()}


def grads_of(engine, scenario: Z12) -> dict:
    grads = full_grads(engine)
    if scenario.fp16:  # ZeRO holds them loss-scaled until the step
        scale = engine.optimizer.loss_scale
        grads = {n: None if g is None else g / scale for n, g in grads.items()}
    return grads


def collectives(scenario: Z12, micro: int) -> int:
    """The all-reduces of micro-batch ``micro``: one per pass that computes gradients
    (``sync_grads="every"``; plain DeepSpeed: one per ``engine.backward``) or one
    (``"last"``). With gradient accumulation ZeRO-0 and ZeRO-1 reduce nothing off the
    boundary (DeepSpeed's ``allreduce_gradients``), the block neither; ZeRO-2 reduces
    every micro-batch."""
    if scenario.stage < 2 and micro < scenario.gas - 1:
        return 0
    real = scenario.passes - int(scenario.probe_first)
    return real if scenario.sync == "every" or not scenario.use_block else 1


def run(scenario: Z12, seen: list | None = None) -> float:
    """Parity over ``scenario.steps`` steps; returns the largest relative gradient error
    (for the plain runs, which are expected to fail the parity). ``seen`` gets the
    all-reduces of each micro-batch."""
    engine, ref, ref_opt = engine_for(scenario)
    tol = TOL_ACCUMULATED if scenario.gas > 1 else TOL
    worst = 0.0
    for step in range(scenario.steps):
        expected = reference_step(ref, ref_opt, scenario, step)
        for micro in range(scenario.gas):
            with counting() as counts:
                micro_step(engine, scenario, step, micro)
            counts = dict(counts)
            if seen is not None:
                seen.append(counts.get("all_reduce", 0))
            if scenario.use_block:
                want = collectives(scenario, micro)
                assert counts.get("all_reduce", 0) == want, (step, micro, counts, want)
            if micro == scenario.gas - 1:
                grads = grads_of(engine, scenario)
                worst = max(worst, _relative(grads, expected))
                if scenario.use_block:
                    assert_close(grads, expected, f"step {step}: grads", scenario.low_precision, tol)
            engine.step()
        if scenario.use_block:
            ref_params = {n: p.detach() for n, p in ref.named_parameters()}
            assert_close(params_of(engine), ref_params, f"step {step}: params",
                         scenario.low_precision, tol)
    return worst


def _relative(actual: dict, expected: dict) -> float:
    num = sum(float((actual[n] - e).pow(2).sum()) for n, e in expected.items())
    den = sum(float(e.pow(2).sum()) for e in expected.values())
    return (num / den) ** 0.5


def _name(fields: dict) -> str:
    return "zero12_" + "_".join(
        f"{k}{int(v) if isinstance(v, bool) else v}" for k, v in fields.items())


def _add(**fields) -> None:
    registry.add(_name(fields), lambda: run(Z12(**fields)))


# Per stage, every 2 of passes, sync_grads, backwards and the kind of backward meet.
for _stage in (0, 1, 2):
    for _row in covering(dict(passes=(2, 3), sync=("every", "last"), backwards=(False, True),
                              engine_backward=(True, False)), strength=2):
        _add(stage=_stage, **_row)

# The settings, each on stage 1 and 2 with both sync_grads values between them
# (gradient accumulation: zero12_gas2_* below).
SETTINGS = (
    dict(overlap=True),
    dict(contiguous=False),
    dict(bf16=True),
    dict(fp16=True),
    dict(offload=True),
    dict(clip=0.05),
    dict(probe_first=True, passes=3),
)
for _extra in SETTINGS:
    for _stage, _sync in ((1, "last"), (2, "every")):
        _add(stage=_stage, sync=_sync, **_extra)
_add(stage=0, gas=2, sync="last", engine_backward=False)
_add(stage=0, clip=0.05)
_add(stage=0, probe_first=True, passes=3, engine_backward=False)
_add(stage=2, gas=2, sync="last", backwards=True, overlap=True)
_add(stage=1, gas=2, sync="every", offload=True, clip=0.05)


# Gradient accumulation: the collectives per micro-batch beside plain DeepSpeed's #
def _gas2(stage: int, sync: str, passes: int) -> None:
    """``gradient_accumulation_steps: 2``: parity over 3 steps, and the all-reduces of
    each micro-batch by ``collectives`` (ZeRO-0/1: none off the boundary, then the
    policy's count; ZeRO-2: the policy's count in every micro-batch). Plain DeepSpeed
    with ``engine.backward`` per pass, counted the same way (its gradients are wrong on
    ZeRO-1/2): one per ``engine.backward``, on ZeRO-0/1 at the boundary only (none off
    it, as the block)."""
    scenario = Z12(stage=stage, sync=sync, passes=passes, gas=2)
    seen: list = []
    run(scenario, seen)
    want = [collectives(scenario, micro) for micro in range(scenario.gas)]
    assert seen == want * scenario.steps, (seen, want)
    plain = dataclasses.replace(scenario, use_block=False, steps=1)
    plain_seen: list = []
    run(plain, plain_seen)
    plain_want = [collectives(plain, micro) for micro in range(plain.gas)]
    assert plain_seen == plain_want, (plain_seen, plain_want)
    if stage < 2:  # DeepSpeed reduces nothing off the boundary, the block neither
        assert seen[0] == plain_seen[0] == 0, (seen, plain_seen)
    print(f"ZeRO-{stage} gas 2, {passes} passes, {sync}: all-reduces per micro-batch "
          f"{seen[:2]} (plain DeepSpeed {plain_seen})", flush=True)


for _stage in (0, 1, 2):
    for _sync in ("every", "last"):
        for _passes in (2, 3):
            registry.add(f"zero12_gas2_stage{_stage}_{_sync}_passes{_passes}",
                         lambda s=_stage, y=_sync, p=_passes: _gas2(s, y, p))


def _gas2_fp32_accumulation(sync: str, passes: int) -> None:
    """fp16 accumulated in fp32 on ZeRO-1 (``grad_accum_dtype: fp32``, its
    ``grad_accum``): off the boundary the block moves ``.grad`` into it, as DeepSpeed's
    backward epilogue. One step: with gas 2 the second one overflows the loss scale, in
    plain DeepSpeed too (which skips it; the reference does not)."""
    scenario = Z12(stage=1, fp16=True, accum_fp32=True, gas=2, sync=sync, passes=passes,
                   steps=1)
    engine, _, _ = engine_for(scenario)
    assert engine.optimizer.use_grad_accum_attribute
    run(scenario)


registry.add("zero12_gas2_fp32_accumulation_every", lambda: _gas2_fp32_accumulation("every", 2))
registry.add("zero12_gas2_fp32_accumulation_last", lambda: _gas2_fp32_accumulation("last", 3))


@registry.case()
def zero12_gas_exception_drops_held() -> None:
    """An exception off the boundary (ZeRO-0/1, gas 3): no collective, and every local
    gradient is dropped, the earlier micro-batch's held one included (none of it was
    reduced)."""
    for stage in (0, 1):
        scenario = Z12(stage=stage, gas=3)
        engine, _, _ = engine_for(scenario)
        params = [p for p in engine.module.parameters() if p.requires_grad]
        with counting() as counts:
            micro_step(engine, scenario, 0, 0)
            assert any(p.grad is not None for p in params), stage  # held for the boundary
            engine.step()
            with contextlib.suppress(KeyError), no_reshard_between_backwards(engine):
                out = engine(tokens(0, 1)).logits
                engine.backward(loss(out, 0), retain_graph=True)
                raise KeyError("boom")
        assert not counts.get("all_reduce"), dict(counts)
        assert all(p.grad is None for p in params), stage


def _params_per_step(scenario: Z12) -> list[dict]:
    engine, _, _ = engine_for(scenario)
    params = []
    for step in range(scenario.steps):
        for micro in range(scenario.gas):
            micro_step(engine, scenario, step, micro)
            engine.step()
        params.append(params_of(engine))
    return params


@registry.case()
def zero12_gas2_one_pass_is_plain_deepspeed() -> None:
    """One ``engine.backward`` per micro-batch, gas 2, 3 steps: the block's parameters
    equal plain DeepSpeed's bit for bit on ZeRO-0 and ZeRO-1 (it accumulates and reduces
    as DeepSpeed does: in ``.grad``, or ``grad_accum``, then once at the boundary),
    also in bf16, where the step's rounding follows that order."""
    for fields in (dict(stage=0), dict(stage=1), dict(stage=1, bf16=True),
                   dict(stage=1, bf16=True, accum_fp32=True, offload=True)):
        scenario = Z12(passes=1, gas=2, **fields)
        block = _params_per_step(scenario)
        plain = _params_per_step(dataclasses.replace(scenario, use_block=False))
        for step, (got, want) in enumerate(zip(block, plain)):
            for name, value in want.items():
                assert torch.equal(got[name], value), (fields, step, name)


# What plain DeepSpeed does with the same code #
def _plain(stage: int, **fields) -> float:
    return run(Z12(stage=stage, use_block=False, **fields))


@registry.case()
def zero12_plain_stage1_and_2_step_on_the_last_pass() -> None:
    """ZeRO-1/2 keep only the last pass's reduced gradient: ~100% off."""
    for stage in (1, 2):
        error = _plain(stage, steps=1)
        print(f"plain ZeRO-{stage}, engine.backward x2: relative error {error:.3f}", flush=True)
        assert error > 0.5, error
        error = _plain(stage, steps=1, gas=2)
        print(f"plain ZeRO-{stage}, gas 2: relative error {error:.3f}", flush=True)
        assert error > 0.3, error


@registry.case()
def zero12_plain_loss_backward_is_wrong_or_fails() -> None:
    """``loss.backward()`` twice: ZeRO-1/2 wrong or failing, ZeRO-0 refused by DeepSpeed;
    ZeRO-0 with ``engine.backward`` is right by itself (the block keeps it right)."""
    for stage in (1, 2):
        try:
            error = _plain(stage, steps=1, engine_backward=False)
        except (TypeError, AssertionError, RuntimeError) as exc:
            print(f"plain ZeRO-{stage}, loss.backward x2: {type(exc).__name__}", flush=True)
        else:
            print(f"plain ZeRO-{stage}, loss.backward x2: relative error {error:.3f}", flush=True)
            assert error > 0.5, error
    try:
        _plain(0, steps=1, engine_backward=False)
    except RuntimeError as exc:
        assert "Direct calls to tensor.backward() are not supported" in str(exc), exc
    else:
        raise AssertionError("plain ZeRO-0 ran loss.backward()")
    assert _plain(0, steps=2) < 1e-5


# Refusals, raised before any gradient is written #
@registry.case()
def zero12_refusals() -> None:
    engine, _, _ = engine_for(Z12(stage=1))
    try:
        no_reshard_between_backwards(engine, reshard_to=2).__enter__()
    except ValueError as exc:
        assert "Drop reshard_to" in str(exc), exc
    else:
        raise AssertionError("reshard_to was accepted on ZeRO-1")
    with no_reshard_between_backwards(engine, keep_unsharded=False):  # accepted, no effect
        engine.backward(loss(engine(tokens(0)).logits, 0))
    engine.step()
    engine0, _, _ = engine_for(Z12(stage=0, bf16=True))
    try:
        no_reshard_between_backwards(engine0).__enter__()
    except ValueError as exc:
        assert "zero_optimization.stage to 1 or 2" in str(exc), exc
    else:
        raise AssertionError("bf16 on ZeRO-0 was accepted")


@registry.case()
def zero12_refusal_fp16_loss_backward() -> None:
    """``loss.backward()`` under fp16 skips the loss scale: refused before any gradient."""
    engine16, _, _ = engine_for(Z12(stage=2, fp16=True))
    try:
        with no_reshard_between_backwards(engine16) as block:
            loss(engine16(tokens(0)).logits, 0).backward()
    except RetainError as exc:
        assert "engine.backward(loss)" in str(exc), exc
    else:
        raise AssertionError("loss.backward() under fp16 was accepted")
    assert block.backward_passes == 0
    assert all(p.grad is None for p in engine16.module.parameters())


# Per-loss gradients #
def _loss_grads(stage: int, gas: int = 1) -> None:
    """``block.grads`` per loss: the full averaged gradients; their Gramian and sum.
    With ``gas`` 2 on ZeRO-0/1 an off-boundary block reduces nothing but each loss's
    gradient (``block.grads`` all-reduces it itself); the sum ``apply_grads`` wrote
    waits in ``.grad`` and the boundary micro-batch's exit reduces it with its own."""
    scenario = Z12(stage=stage, passes=2, gas=gas)
    engine, ref, ref_opt = engine_for(scenario)
    tol = TOL_ACCUMULATED if gas > 1 else TOL
    for step in range(3):
        per_loss = []
        for micro in range(gas):
            out = ref(tokens(step, micro)).logits
            per_loss.append([])
            for i in range(2):
                grads = torch.autograd.grad(loss(out, i) / gas, list(ref.parameters()),
                                            retain_graph=True)
                for param, grad in zip(ref.parameters(), grads):
                    param.grad = grad
                per_loss[micro].append(averaged_grads(ref))
        ref_opt.zero_grad()
        expected = reference_step(ref, ref_opt, scenario, step)
        for micro in range(gas):
            with counting() as counts, no_reshard_between_backwards(engine) as block:
                out = engine(tokens(step, micro)).logits
                got = [block.grads(loss(out, i), retain_graph=i == 0) for i in range(2)]
                gram = fsdp_retain.gramian(got)
                fsdp_retain.apply_grads(fsdp_retain.combine(got, [1.0, 1.0]))
            exit_flush = int(not (stage < 2 and micro < gas - 1))
            assert counts["all_reduce"] == 2 + exit_flush, (micro, dict(counts))
            names = got[0].names
            want_grads = per_loss[micro]
            for i in range(2):
                values = dict(zip(names, got[i].values))
                assert_close({n: values[n].view_as(want_grads[i][n]) for n in names},
                             want_grads[i], f"step {step} micro {micro}: loss {i}")
            flat = [torch.cat([want_grads[i][n].reshape(-1) for n in names]).double()
                    for i in range(2)]
            want = torch.stack([torch.stack([a @ b for b in flat]) for a in flat])
            torch.testing.assert_close(gram, want, rtol=1e-4, atol=1e-9)
            if micro == gas - 1:
                assert_close(full_grads(engine), expected, f"step {step}: grads", tol=tol)
            engine.step()
        ref_params = {n: p.detach() for n, p in ref.named_parameters()}
        assert_close(params_of(engine), ref_params, f"step {step}: params", tol=tol)


registry.add("zero12_loss_grads_stage0", lambda: _loss_grads(0))
registry.add("zero12_loss_grads_stage2", lambda: _loss_grads(2))
registry.add("zero12_loss_grads_gas2_stage0", lambda: _loss_grads(0, gas=2))
registry.add("zero12_loss_grads_gas2_stage1", lambda: _loss_grads(1, gas=2))


# A cached (GradCache) loss: sentence-transformers#3173 #
def _cached(stage: int, sync: str, use_block: bool = True) -> None:
    scenario = Z12(stage=stage)
    engine, ref, ref_opt = engine_for(scenario, nm.make_encoder().float())
    for step in range(3):
        queries, docs = (t.float() for t in nm.pairs(rank(), step))
        nm.plain_ranking_step(ref, queries, docs)
        expected = averaged_grads(ref)
        for name, param in ref.named_parameters():
            param.grad = expected[name].clone()
        ref_opt.step()
        ref_opt.zero_grad()
        block = (no_reshard_between_backwards(engine, sync_grads=sync) if use_block
                 else contextlib.nullcontext())
        with counting() as counts, block as b:
            nm.cached_step(engine, queries, docs, 2, replay="hook")
        if use_block:
            assert b.backward_passes == 4, b.backward_passes  # one per replayed mini-batch
            assert counts["all_reduce"] == (4 if sync == "every" else 1), dict(counts)
        assert_close(full_grads(engine), expected, f"step {step}: grads", tol=TOL)
        engine.step()
        ref_params = {n: p.detach() for n, p in ref.named_parameters()}
        assert_close(params_of(engine), ref_params, f"step {step}: params", tol=TOL)


for _stage, _sync in ((1, "every"), (2, "last"), (2, "every"), (0, "last")):
    registry.add(f"zero12_cached_stage{_stage}_{_sync}", lambda s=_stage, y=_sync: _cached(s, y))


@registry.case()
def zero12_cached_without_the_block_fails() -> None:
    """Plain ZeRO-2: each replay queues the parameters for reduction again."""
    try:
        _cached(2, "every", use_block=False)
    except AssertionError as exc:
        assert "Gradient computed twice" in str(exc) or "grads" in str(exc), exc
    else:
        raise AssertionError("plain ZeRO-2 ran a cached loss right")


@registry.case()
def zero12_hooks_kept_across_blocks() -> None:
    """[Note: hooks kept on the model] on ZeRO-0 and ZeRO-2: the block's module hooks are
    installed at the first block and reused by the next ones (one record, the same hook
    count), with a probe pass first in each: parity over 3 steps."""
    for stage in (0, 2):
        scenario = Z12(stage=stage, passes=2, probe_first=True)
        engine, ref, ref_opt = engine_for(scenario)
        before = _module_hooks(engine)
        records, counts = [], []
        for step in range(scenario.steps):
            expected = reference_step(ref, ref_opt, scenario, step)
            micro_step(engine, scenario, step, 0)
            assert_close(grads_of(engine, scenario), expected, f"stage {stage} step {step}",
                         False, TOL)
            engine.step()
            records.append(engine.__dict__["_fsdp_retain_hooks"])
            counts.append(_module_hooks(engine))
        assert records[0] is records[1] is records[2], stage
        assert counts[0] == counts[1] == counts[2] > before, (stage, before, counts)


def _module_hooks(engine) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in engine.module.modules())
