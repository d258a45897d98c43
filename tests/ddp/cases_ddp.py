"""DDP: several backward passes over one forward, CPU/gloo, world size 2.

Each case trains a ``DistributedDataParallel`` model and an unwrapped copy for 3 SGD
steps (momentum 0.9) and compares gradients and parameters after every step; the copy
runs one backward of the sum of the same losses on the rank's batch, its gradients
averaged over ranks (what DDP's all-reduce gives). float64 (fp16/bf16 compression hooks
and a bf16 model: within their rounding). The same passes without the block are
checked to be wrong (or to raise) in every DDP setting. Collectives are counted per
step against a formula: per reduction, one all-reduce per DDP bucket, plus the used-map
all-reduce where DDP tracks unused parameters.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import fsdp_retain
from fsdp_retain import no_reshard_between_backwards
from fsdp_retain._measure import count_collectives
from tests.support.case_parts import covering
from tests.support.harness import Registry

registry = Registry()
DIM = 10
STEPS = 3
TOL = 1e-10


class TwoHeads(nn.Module):
    """A trunk and two heads: the first loss uses head ``a`` only."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(DIM, 2 * DIM + 1), nn.Tanh(), nn.LayerNorm(2 * DIM + 1),
                                   nn.Linear(2 * DIM + 1, DIM))
        self.a = nn.Linear(DIM, 3)
        self.b = nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return self.a(h), self.b(torch.tanh(h))


def loss1(out: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return out[0].pow(2).mean()


def loss2(out: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return (out[0].sum(-1) * out[1].sum(-1)).tanh().mean() + out[1].mean()


def batch(step: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(42 + dist.get_rank() + 1 + 1000 * step)
    return torch.randn(6, DIM, generator=gen, dtype=torch.float64).to(dtype)


@dataclasses.dataclass
class Setting:
    """How DDP is built (``ddp``: DDP's own arguments, given to ``wrapper``: DDP, or the
    composable ``replicate`` in tests/ddp/cases_ddp_replicate.py) and what the hook does."""

    ddp: dict = dataclasses.field(default_factory=dict)
    hook: Callable | None = None
    dtype: torch.dtype = torch.float64
    tol: float = TOL
    wrapper: Callable[..., nn.Module] = DDP

    def wrap(self, module: nn.Module) -> Any:
        model = self.wrapper(module, **self.ddp)
        if self.hook is not None:
            model.register_comm_hook(dist.group.WORLD, self.hook)
        return model


SETTINGS = {
    "default": Setting(),
    "static": Setting(ddp=dict(static_graph=True)),
    "unused": Setting(ddp=dict(find_unused_parameters=True)),
    "view": Setting(ddp=dict(gradient_as_bucket_view=True)),
    # Small buckets: find_unused_parameters=True (else DDP starts with one bucket).
    "buckets": Setting(ddp=dict(find_unused_parameters=True, bucket_cap_mb=0.0004)),
    "fp16": Setting(hook=default_hooks.fp16_compress_hook, dtype=torch.float32, tol=5e-3),
        "bf16_model": Setting(dtype=torch.bfloat16, tol=5e-2),
}


def reducer_owner(model: Any) -> DDP:
    """The ``DistributedDataParallel`` whose reducer averages ``model``'s gradients (the
    one ``replicate`` builds at its first forward)."""
    if isinstance(model, DDP):
        return model
    from torch.distributed._composable.replicate import replicate

    return replicate.state(model)._ddp


def user_module(model: Any) -> nn.Module:
    """The module whose forward runs: DDP's ``.module``; under replicate the model."""
    return model.module if isinstance(model, DDP) else model


def buckets(model: Any) -> int:
    return len(reducer_owner(model)._get_ddp_logging_data()["bucket_sizes"].split(", "))


def reductions(model: Any, passes: int) -> int:
    """All-reduces for ``passes`` reductions: a bucket each, and the used-map where DDP
    tracks unused parameters."""
    ddp = reducer_owner(model)
    tracked = ddp.find_unused_parameters or ddp.static_graph
    return passes * (buckets(model) + tracked)


def rel_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    num = sum(float((g.double() - w.double()).pow(2).sum()) for g, w in zip(got, want))
    den = sum(float(w.double().pow(2).sum()) for w in want)
    return (num / den) ** 0.5


def reference_grads(ref: nn.Module, x: torch.Tensor, losses: Callable) -> list[torch.Tensor]:
    """One backward of the summed losses on this rank's batch, averaged over ranks."""
    ref.zero_grad(set_to_none=False)
    losses(ref(x)).backward()
    grads = [p.grad for p in ref.parameters()]
    for g in grads:
        dist.all_reduce(g)
        g /= dist.get_world_size()
    return grads


def train(setting: Setting, step_fn: Callable, ref_losses: Callable, *,
          make: Callable[[], nn.Module] = TwoHeads, steps: int = STEPS,
          check: Callable[[DDP, Any, int], None] | None = None) -> list[float]:
    """Parameters' relative error after each step (gradients checked too)."""
    torch.manual_seed(42)
    module = make().to(setting.dtype)
    ref = copy.deepcopy(module).double()
    model = setting.wrap(module)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    errors = []
    for step in range(steps):
        x = batch(step, setting.dtype)
        opt.zero_grad()
        result = step_fn(model, x)
        want = reference_grads(ref, x.double(), ref_losses)
        got = [p.grad if p.grad is not None else torch.zeros_like(p)
               for p in user_module(model).parameters()]
        grad_error = rel_error(got, want)
        if check is not None:
            check(model, result, step)
        opt.step()
        ref_opt.step()
        errors.append(max(grad_error, rel_error(list(user_module(model).parameters()),
                                                list(ref.parameters()))))
    del model
    return errors


def two_losses(out: Any) -> torch.Tensor:
    return loss1(out) + loss2(out)


# Parity across the options and DDP's settings #
def block_step(sync: str, backwards: int | None, probe: bool, counts: dict) -> Callable:
    def step(model: DDP, x: torch.Tensor) -> Any:
        with count_collectives(modules=False) as c:
            with no_reshard_between_backwards(model, sync_grads=sync,
                                              backwards=backwards) as block:
                out = model(x)
                if probe:
                    block.backward(out[0].sum() + out[1].sum(), param_grads=False,
                                   retain_graph=True)
                loss1(out).backward(retain_graph=True)
                loss2(out).backward()
        counts["all_reduce"] = c.all_reduce
        counts["block"] = block
        return block
    return step


def plain_step(model: DDP, x: torch.Tensor) -> None:
    out = model(x)
    loss1(out).backward(retain_graph=True)
    loss2(out).backward()


def parity(setting_name: str, sync: str, backwards: bool, probe: bool,
           settings: dict[str, Setting] = SETTINGS) -> Callable[[], None]:
    def case() -> None:
        setting = settings[setting_name]
        passes = 2 + probe
        counts: dict = {}

        def check(model: DDP, block: Any, step: int) -> None:
            assert block.backward_passes == passes, block.backward_passes
            reduced = 2 if sync == "every" else 1
            assert counts["all_reduce"] == reductions(model, reduced), (counts, buckets(model))

        errors = train(setting, block_step(sync, passes if backwards else None, probe, counts),
                       two_losses, check=check)
        assert max(errors) < setting.tol, errors
        try:
            plain = train(setting, lambda m, x: plain_step(m, x), two_losses)
        except RuntimeError as exc:  # DDP's reducer refuses the passes
            assert "DDP" in str(exc) or "static_graph" in str(exc) or "reduction" in str(exc), exc
        else:
            assert max(plain) > 20 * setting.tol and max(plain) > 1e-2, plain
    return case


def _name(**row: Any) -> str:
    return ("parity_" + row["setting"] + f"_{row['sync']}" + ("_n" if row["backwards"] else "")
            + ("_probe" if row["probe"] else ""))


for _row in covering({"setting": tuple(SETTINGS), "sync": ("every", "last"),
                      "backwards": (False, True), "probe": (False, True)}, 2):
    registry.add(_name(**_row), parity(_row["setting"], _row["sync"], _row["backwards"],
                                       _row["probe"]))


# The torch API beside the block #
def block_or_not(use_block: bool, model: DDP, **options: Any) -> Any:
    return (no_reshard_between_backwards(model, **options) if use_block
            else contextlib.nullcontext())


def compare(model: DDP, ref_model: nn.Module) -> float:
    """The relative error of the DDP gradients against the reference's, averaged over ranks."""
    want = [p.grad if p.grad is not None else torch.zeros_like(p) for p in ref_model.parameters()]
    for g in want:
        dist.all_reduce(g)
        g /= dist.get_world_size()
    got = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.module.parameters()]
    return rel_error(got, want)


def grad_error(step: Callable[[DDP, torch.Tensor], None],
               reference: Callable[[nn.Module, torch.Tensor], None]) -> float:
    """The largest ``compare`` over ``STEPS`` batches: ``step`` on a DDP ``TwoHeads``,
    ``reference`` on its unwrapped copy (the same weights, no optimizer step)."""
    torch.manual_seed(42)
    module = TwoHeads().double()
    ref_model = copy.deepcopy(module)
    model = DDP(module)
    error = 0.0
    for step_index in range(STEPS):
        x = batch(step_index)
        model.zero_grad()
        step(model, x)
        ref_model.zero_grad()
        reference(ref_model, x)
        error = max(error, compare(model, ref_model))
    return error


def assert_plain_fails(run: Callable[[], float]) -> None:
    """The same code without the block: wrong gradients, or DDP's reducer raises."""
    try:
        error = run()
    except RuntimeError as exc:
        assert "DDP" in str(exc) or "reduction" in str(exc) or "ready" in str(exc), exc
    else:
        assert error > 1e-2, error


@registry.case()
def no_sync_accumulation() -> None:
    """Micro-batch 1 inside ``no_sync()`` (nothing reduced), micro-batch 2 synced: the
    block reduces both once; plain DDP reduces only the first pass of micro-batch 2."""
    setting = SETTINGS["default"]

    def micro(model: DDP, x: torch.Tensor, use_block: bool, counts: dict) -> None:
        first, second = x[:3], x[3:]
        ctx = (no_reshard_between_backwards if use_block
               else lambda m, **k: __import__("contextlib").nullcontext())
        with count_collectives(modules=False) as c:
            with model.no_sync():
                with ctx(model, sync_grads="last"):
                    out = model(first)
                    loss1(out).backward(retain_graph=True)
                    loss2(out).backward()
            counts["no_sync"] = c.all_reduce
        with ctx(model, sync_grads="last"):
            out = model(second)
            loss1(out).backward(retain_graph=True)
            loss2(out).backward()

    counts: dict = {}
    errors = train(setting, lambda m, x: micro(m, x, True, counts), two_microbatch_losses)
    assert max(errors) < TOL, errors
    assert counts["no_sync"] == 0, counts
    assert_plain_wrong(setting, lambda m, x: micro(m, x, False, {}), two_microbatch_losses)


def two_microbatch_losses(out: Any) -> torch.Tensor:
    """The reference of two micro-batches of 3, each loss a mean over its micro-batch."""
    return two_losses((out[0][:3], out[1][:3])) + two_losses((out[0][3:], out[1][3:]))


def assert_plain_wrong(setting: Any, step: Any, ref_losses: Any) -> None:
    """``step`` without the block: DDP's reducer refuses the second synced pass, or the
    parameters end away from the reference."""
    try:
        plain = train(setting, step, ref_losses)
    except RuntimeError as exc:
        assert "mark a variable ready only once" in str(exc), exc
    else:
        assert max(plain) > 1e-2, plain


@registry.case()
def inputs_and_gradient() -> None:
    """``backward(inputs=[head a], gradient=...)`` then a full pass; with ``"every"`` the
    restricted pass is reduced too."""
    def step(model: DDP, x: torch.Tensor, use_block: bool) -> None:
        with block_or_not(use_block, model, backwards=2):
            out = model(x)
            head = list(model.module.a.parameters())
            torch.autograd.backward(out[0], grad_tensors=out[0].detach() * 2 / out[0].numel(),
                                    inputs=head, retain_graph=True)
            loss2(out).backward()

    def reference(ref_model: nn.Module, x: torch.Tensor) -> None:
        h = ref_model.trunk(x)
        a = ref_model.a(h.detach())  # the first pass reaches head a only
        a.pow(2).mean().backward()
        loss2(ref_model(x)).backward()

    def run(use_block: bool) -> float:
        return grad_error(lambda m, x: step(m, x, use_block), reference)

    assert run(True) < TOL
    assert_plain_fails(lambda: run(False))


@registry.case()
def gradient_penalty_create_graph() -> None:
    """A first pass, then ``autograd.grad(..., create_graph=True)`` (local, as plain DDP
    gives it) and a backward through the penalty: both passes reduced."""
    def penalty(model: nn.Module, out: Any) -> torch.Tensor:
        params = list(model.a.parameters())
        grads = torch.autograd.grad(loss2(out), params, create_graph=True)
        return sum(g.pow(2).sum() for g in grads)

    def step(model: DDP, x: torch.Tensor, use_block: bool) -> None:
        with block_or_not(use_block, model) as block:
            out = model(x)
            loss1(out).backward(retain_graph=True)
            pen = penalty(model.module, out)
            (loss2(out) + pen).backward()
        assert not use_block or block.backward_passes == 3, block.backward_passes

    def reference(ref_model: nn.Module, x: torch.Tensor) -> None:
        out = ref_model(x)
        (loss1(out) + loss2(out) + penalty(ref_model, out)).backward()

    def run(use_block: bool) -> float:
        return grad_error(lambda m, x: step(m, x, use_block), reference)

    assert run(True) < TOL
    assert_plain_fails(lambda: run(False))


@registry.case()
def unused_head_stays_none() -> None:
    """``find_unused_parameters=True``: a head no pass uses keeps ``.grad`` None (as in
    DDP); a head one pass uses is reduced."""
    torch.manual_seed(42)
    model = DDP(TwoHeads().double(), find_unused_parameters=True)
    with no_reshard_between_backwards(model, sync_grads="last"):
        out = model(batch(0))
        loss1(out).backward(retain_graph=True)
        out[0].sum().backward()
    assert all(p.grad is None for p in model.module.b.parameters())
    grads = [p.grad.clone() for p in model.module.a.parameters()]
    for g in grads:
        others = [torch.empty_like(g) for _ in range(dist.get_world_size())]
        dist.all_gather(others, g)
        assert all(torch.equal(o, g) for o in others)  # reduced: the same on every rank


@registry.case()
def plain_steps_around_the_block() -> None:
    """Plain DDP steps before and after block steps (static_graph learns its graph at
    the first plain step; gradient_as_bucket_view stays a view): parity throughout."""
    for name in ("static", "view", "default"):
        setting = SETTINGS[name]

        def step(model: DDP, x: torch.Tensor, index: list = [0]) -> None:
            index[0] += 1
            if index[0] % 2:
                two_losses(model(x)).backward()
                return
            with no_reshard_between_backwards(model):
                out = model(x)
                loss1(out).backward(retain_graph=True)
                loss2(out).backward()

        errors = train(setting, step, two_losses, steps=5)
        assert max(errors) < setting.tol, (name, errors)


@registry.case()
def per_loss_gramian() -> None:
    """``block.grads`` per loss: averaged gradients (the same on every rank); the Gramian
    equals the one-process Gramian of the averaged gradients (no rank's local one, nor
    their sum); ``apply_grads`` of their sum trains as one backward of the sum."""
    def step(model: DDP, x: torch.Tensor) -> Any:
        with no_reshard_between_backwards(model) as block:
            out = model(x)
            grads = [block.grads(loss1(out), retain_graph=True), block.grads(loss2(out))]
            gram = fsdp_retain.gramian(grads)
            fsdp_retain.apply_grads(fsdp_retain.combine(grads, torch.ones(2, dtype=gram.dtype)))
        return grads, gram

    errors = train(SETTINGS["default"], step, two_losses)
    assert max(errors) < TOL, errors
    torch.manual_seed(42)
    ref = TwoHeads().double()
    model = DDP(copy.deepcopy(ref))
    grads, gram = step(model, batch(0))
    want = []
    for loss in (loss1, loss2):
        ref.zero_grad()
        loss(ref(batch(0))).backward()
        g = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                       for p in ref.parameters()])
        dist.all_reduce(g)
        want.append(g / dist.get_world_size())
    expected = torch.stack([torch.stack([a @ b for b in want]) for a in want])
    assert torch.allclose(gram, expected, rtol=1e-10, atol=1e-14), (gram, expected)


# Nested backward passes (see tests/nested/cases_nested.py) #
@registry.case()
def nested_tiled_mlp() -> None:
    """A tiled MLP (a backward per tile inside the MLP's node), two passes, 4 tiles: one
    reduction per pass (``"every"``) whatever the tiles; plain DDP raises (a tile's
    gradient marks a parameter ready once more). A probe pass first (its tiles write
    ``.grad``, which the block must drop; with ``gradient_as_bucket_view`` that ``.grad``
    is a view of DDP's bucket) changes no gradient; a probe pass, first or last, reduces
    nothing; the same with ``static_graph`` and ``find_unused_parameters``."""
    from tests.support.nested_models import loss1 as t1, loss2 as t2, make_tiled, tokens

    def run(use_block: bool, sync: str = "every", probe: str | None = None,
            as_view: bool = False, **ddp: Any) -> float:
        module = make_tiled(tiles=4)
        ref_model = copy.deepcopy(module)
        model = DDP(module, gradient_as_bucket_view=as_view, **ddp)
        error = 0.0
        for step_index in range(STEPS):
            x = tokens(dist.get_rank(), step_index)
            model.zero_grad()
            with count_collectives(modules=False) as counts:
                with block_or_not(use_block, model, sync_grads=sync) as block:
                    out = model(x)
                    t1(out).backward(retain_graph=True)
                    if probe == "between":  # .grad holds what the probe must keep
                        block.backward(t2(out), param_grads=False, retain_graph=True)
                    t2(out).backward(retain_graph=probe == "last")
                    if probe == "last":  # nothing left to reduce at the exit
                        block.backward(t1(out), param_grads=False)
            if use_block:
                assert counts.all_reduce == reductions(model, 2 if sync == "every" else 1)
            ref_model.zero_grad()
            out = ref_model(x)
            (t1(out) + t2(out)).backward()
            error = max(error, compare(model, ref_model))
        return error

    assert run(True) < TOL
    assert run(True, "last") < TOL
    for sync, probe, as_view in (("every", "between", False), ("last", "between", True),
                                 ("every", "last", True), ("last", "last", False)):
        error = run(True, sync, probe, as_view)
        assert error < TOL, (sync, probe, as_view, error)
    for sync, ddp in (("every", dict(static_graph=True)),
                      ("last", dict(find_unused_parameters=True))):
        error = run(True, sync, "between", **ddp)
        assert error < TOL, (sync, ddp, error)
    assert_plain_fails(lambda: run(False))


@registry.case()
def nested_cached_loss() -> None:
    """A cached (GradCache) loss whose mini-batches replay from a hook on the loss, as
    sentence-transformers does: one reduction per step. Plain DDP is right here (each
    replay forward arms its reducer) but reduces once per replayed mini-batch."""
    from tests.support.nested_models import cached_step, make_encoder, pairs, plain_ranking_step

    def run(use_block: bool) -> tuple[float, int]:
        module = make_encoder()
        ref_model = copy.deepcopy(module)
        model = DDP(module)
        error, reduced = 0.0, 0
        for step_index in range(STEPS):
            queries, docs = pairs(dist.get_rank(), step_index)
            model.zero_grad()
            with count_collectives(modules=False) as counts:
                with block_or_not(use_block, model, sync_grads="last"):
                    cached_step(model, queries, docs, minibatches=2)
            reduced = counts.all_reduce
            ref_model.zero_grad()
            plain_ranking_step(ref_model, queries, docs)
            error = max(error, compare(model, ref_model))
        assert reduced == reductions(model, 1 if use_block else 4), (use_block, reduced)
        return error, reduced

    assert run(True)[0] < TOL
    assert run(False)[0] < TOL


# Refusals and exits #
@registry.case()
def refusals_and_abort() -> None:
    """``reshard_to`` is refused naming the fix; an exception inside the block
    communicates nothing and drops the gradients a pass accumulated since the last
    reduction; the block leaves DDP's flags as it found them."""
    import pytest

    torch.manual_seed(42)
    model = DDP(TwoHeads().double(), static_graph=True)
    with pytest.raises(ValueError, match="Drop reshard_to"):
        with no_reshard_between_backwards(model, keep_unsharded=False, reshard_to=2):
            pass
    before = (model.require_backward_grad_sync, model._static_graph_delay_allreduce_enqueued)
    with count_collectives(modules=False) as counts:
        with pytest.raises(KeyError):
            with no_reshard_between_backwards(model, sync_grads="last"):
                out = model(batch(0))
                loss1(out).backward(retain_graph=True)
                raise KeyError("boom")
    assert counts.all_reduce == 0, counts
    assert all(p.grad is None for p in model.parameters())
    assert (model.require_backward_grad_sync,
            model._static_graph_delay_allreduce_enqueued) == before


@registry.case()
def compiled_trunk_and_calls_between_passes() -> None:
    """The trunk compiled in place (``aot_eager``), a ``no_grad`` forward and a state dict
    between the passes: parity over 3 steps, one reduction per step (``"last"``)."""
    def make() -> nn.Module:
        model = TwoHeads()
        model.trunk.compile(backend="aot_eager")
        return model

    counts: dict = {}

    def step(model: DDP, x: torch.Tensor) -> None:
        with count_collectives(modules=False) as c:
            with no_reshard_between_backwards(model, sync_grads="last"):
                out = model(x)
                loss1(out).backward(retain_graph=True)
                with torch.no_grad():
                    model(x)
                model.state_dict()
                loss2(out).backward()
        counts["all_reduce"] = c.all_reduce

    def check(model: DDP, result: Any, step_index: int) -> None:
        assert counts["all_reduce"] == reductions(model, 1), counts

    errors = train(SETTINGS["default"], step, two_losses, make=make, check=check)
    assert max(errors) < 1e-9, errors


def _hook_counts(model: DDP) -> tuple[int, int]:
    params = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.module.parameters())
    modules = sum(len(m._forward_pre_hooks) for m in model.module.modules())
    return params, modules


@registry.case()
def hooks_kept_across_blocks() -> None:
    """[Note: hooks kept on the model]: the block's hooks are installed at the first block
    and reused (the same count after each block, none added); a module replaced between
    blocks builds them again, the old ones removed; a copy of the module made after a
    block carries the modules' hooks (deepcopy copies them), which do nothing there: run
    with grad inside the next block, it adds no probe target; nor does a shallow copy of a
    unit (``copy.copy``: it shares the unit's hook dicts), while the unit itself adds one;
    outside a block the unit's hook records nothing. Parity over 5 steps, a probe pass in
    each."""
    torch.manual_seed(42)
    module = TwoHeads().double()
    ref = copy.deepcopy(module)
    model = DDP(module)
    assert _hook_counts(model) == (0, 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    counts, records, copy_of = [], [], None
    for step in range(5):
        if step == 2:  # a parameterless module replaced: the hooks are built again
            model.module.trunk[1] = nn.Tanh()
        x = batch(step)
        opt.zero_grad(set_to_none=True)
        with no_reshard_between_backwards(model) as block:
            out = model(x)
            targets = len(block.probe_targets.edges())
            if copy_of is not None:
                two_losses(copy_of(x))  # a graph of its own, with grad
                assert len(block.probe_targets.edges()) == targets, "the copy's hooks fired"
            block.backward(out[0].sum() + out[1].sum(), param_grads=False, retain_graph=True)
            loss1(out).backward(retain_graph=True)
            loss2(out).backward()
            z = x.detach().requires_grad_() * 1
            before = len(block.probe_targets.edges())
            copy.copy(model.module.a)(z)
            assert len(block.probe_targets.edges()) == before, "the shallow copy's hook fired"
            model.module.a(z)
            assert len(block.probe_targets.edges()) == before + 1, "the unit's hook did not"
        model.module.a(z)
        assert block.probe_targets.edges() == [], "a hook recorded outside the block"
        counts.append(_hook_counts(model))
        records.append(model.__dict__["_fsdp_retain_hooks"])
        want = reference_grads(ref, x, two_losses)
        got = [p.grad if p.grad is not None else torch.zeros_like(p)
               for p in model.module.parameters()]
        assert rel_error(got, want) < TOL, step
        opt.step()
        ref_opt.step()
        copy_of = copy.deepcopy(model.module)
    # A pre-hook per module with parameters of its own (probe targets); no hook on a
    # parameter: a pass's AccumulateGrad nodes say it writes .grad (_pass_start.will_run).
    units = sum(1 for m in model.module.modules() if m._parameters)
    assert counts == [(0, units)] * 5, counts
    assert records[0] is records[1] and records[1] is not records[2], "built again"
    assert records[2] is records[3] is records[4]
    assert rel_error(list(model.module.parameters()), list(ref.parameters())) < TOL


def check_frozen_after_wrapping(wrap: Callable[[nn.Module], Any]) -> None:
    """A parameter frozen after the model was wrapped (progressive unfreezing's other
    half) stays in DDP's buckets: the block all-reduces it with the rest, but leaves its
    ``.grad`` as ``None`` (a zero one would let AdamW's weight decay step it). The others:
    parity with a reference frozen the same way, over 3 steps, both ``sync_grads``."""
    for sync in ("every", "last"):
        torch.manual_seed(42)
        module = TwoHeads().double()
        ref = copy.deepcopy(module)
        model = wrap(module)
        for frozen in (user_module(model).b.weight, ref.b.weight):
            frozen.requires_grad_(False)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                lr=0.01, weight_decay=0.1)
        ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad],
                                    lr=0.01, weight_decay=0.1)
        before = user_module(model).b.weight.detach().clone()
        for step in range(STEPS):
            x = batch(step)
            opt.zero_grad(set_to_none=True)
            with no_reshard_between_backwards(model, sync_grads=sync):
                out = model(x)
                loss1(out).backward(retain_graph=True)
                loss2(out).backward()
            assert user_module(model).b.weight.grad is None, (sync, step)
            ref.zero_grad(set_to_none=True)
            two_losses(ref(x)).backward()
            trained = [p for p in ref.parameters() if p.requires_grad]
            for param in trained:
                dist.all_reduce(param.grad)
                param.grad /= dist.get_world_size()
            got = [p.grad for p in user_module(model).parameters() if p.requires_grad]
            assert rel_error(got, [p.grad for p in trained]) < TOL, (sync, step)
            opt.step()
            ref_opt.step()
        assert torch.equal(user_module(model).b.weight, before), sync
        assert rel_error(list(user_module(model).parameters()), list(ref.parameters())) < TOL


@registry.case()
def frozen_after_wrapping_gets_no_grad() -> None:
    """``check_frozen_after_wrapping`` on ``DistributedDataParallel``."""
    check_frozen_after_wrapping(DDP)


def check_storage_swapped(wrap: Callable[[nn.Module], Any]) -> None:
    """Every parameter's storage swapped between blocks (``param.set_`` under ``no_grad``,
    as a checkpoint loader may do) gives each a new ``AccumulateGrad`` node; the nodes the
    block holds from the first block are looked up again when no pass seems to reach
    them (``ParamNodes.any_run`` in ``fsdp_retain/_pass_start.py``): parity over 3 steps,
    a reduction per pass. Without the lookup the passes read as another model's and
    nothing is reduced."""
    torch.manual_seed(42)
    module = TwoHeads().double()
    ref = copy.deepcopy(module)
    model = wrap(module)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        if step:
            with torch.no_grad():
                for param in user_module(model).parameters():
                    param.set_(param.detach().clone())
        x = batch(step)
        opt.zero_grad(set_to_none=True)
        with count_collectives(modules=False) as counts:
            with no_reshard_between_backwards(model):
                out = model(x)
                loss1(out).backward(retain_graph=True)
                loss2(out).backward()
        assert counts.all_reduce == reductions(model, 2), (step, counts.all_reduce)
        want = reference_grads(ref, x, two_losses)
        got = [p.grad for p in user_module(model).parameters()]
        assert rel_error(got, want) < TOL, step
        opt.step()
        ref_opt.step()


@registry.case()
def storage_swapped_between_blocks() -> None:
    """``check_storage_swapped`` on ``DistributedDataParallel``."""
    check_storage_swapped(DDP)


def check_buckets_rebuilt(wrap: Callable[..., Any]) -> None:
    """DDP rebuilds its buckets once, at the forward after its first synced backward
    (``bucket_cap_mb`` then applies to the first bucket too, in the order gradients
    arrived). The block reuses the bucket objects it fetched until then and fetches them
    again after (``Buckets._fetch`` in ``fsdp_retain/_ddp/_buckets.py``): a comm hook
    that keeps state per bucket (PowerSGD's error feedback) sees in the block DDP's own
    layout, index by index. Block, plain, plain, block steps: parity every step, and the
    bucket buffers the block keeps hold no memory between reductions. Without the second
    fetch the last block hands the hook the one bucket of before the rebuild."""
    torch.manual_seed(42)
    module = TwoHeads().double()
    ref = copy.deepcopy(module)
    model = wrap(module, bucket_cap_mb=0.0004)
    calls: list[tuple[int, tuple[int, ...]]] = []

    def hook(group, bucket):  # unannotated: DDP checks a hook's annotations
        calls.append((bucket.index(), tuple(id(p) for p in bucket.parameters())))
        return default_hooks.allreduce_hook(group, bucket)

    model.register_comm_hook(dist.group.WORLD, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    layouts = []
    for step, use_block in enumerate((True, False, False, True)):
        x = batch(step)
        opt.zero_grad(set_to_none=True)
        calls.clear()
        if use_block:
            with no_reshard_between_backwards(model, sync_grads="last", backwards=2):
                out = model(x)
                loss1(out).backward(retain_graph=True)
                loss2(out).backward()
        else:
            two_losses(model(x)).backward()
        layouts.append(sorted(set(calls)))
        want = reference_grads(ref, x, two_losses)
        got = [p.grad for p in user_module(model).parameters()]
        assert rel_error(got, want) < TOL, step
        opt.step()
        ref_opt.step()
    ddp = reducer_owner(model)
    assert ddp._has_rebuilt_buckets, "DDP did not rebuild its buckets: the case tests nothing"
    before, plain_before, plain_after, block_after = layouts
    assert len(before) == 1 and plain_before == before, layouts
    assert len(plain_after) > 1, plain_after
    assert block_after == plain_after, (block_after, plain_after)
    kept = ddp.__dict__["_fsdp_retain_buckets"].buckets._grad_buckets
    assert kept and all(bucket.buffer().numel() == 0 for bucket, _, _ in kept), kept


@registry.case()
def buckets_rebuilt_between_blocks() -> None:
    """``check_buckets_rebuilt`` on ``DistributedDataParallel``."""
    check_buckets_rebuilt(DDP)
