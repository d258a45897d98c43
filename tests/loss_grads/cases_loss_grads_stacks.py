"""Per-loss gradients where users run them (CPU, gloo, 2 ranks): frozen and tied
parameters, peft LoRA, gradients applied after the block, ``zero_grad()`` between
passes, and the parameters a method names (the shared trunk).

The model: a trunk (an input layer in the root unit, two residual blocks, each its
own FSDP unit) and three task heads in the root unit, so FSDP1's root flat parameter
mixes trunk and heads. Loss ``i`` reads head ``i``. Variants: ``tied`` (head 0's weight
is the input layer's, and one LayerNorm weight per block frozen, beside trainable
parameters of its unit: FSDP1 ``use_orig_params=True`` and FSDP2 only), ``lora`` (peft
LoRA on the blocks' linears: a frozen base in the same units as the adapters; the
heads trainable) and ``plain``.

The reference is the one-process method on an unsharded copy (seed 42, the rank's
batch): each loss's gradient by ``torch.autograd.grad`` over the trainable
parameters, averaged over ranks, the method's weights from their Gramian, an
SGD-momentum step; 3 steps, parameters compared after each (1e-6; the models that
feed torchjd are float64). Methods: ``all`` (PCGrad over every trainable
parameter), ``shared`` (PCGrad over the trunk, each head its own loss's gradient)
and ``mtl`` (torchjd's ``mtl_backward`` + ``jac_to_grad(shared, UPGrad())`` is the
reference itself; the block side is ``gramian`` of ``select(trunk)`` and UPGrad's
Gramian weighting).

Flows (where the gradients go), each of which was silently wrong on FSDP1 with
original parameters before GradSlots tracked them:
- ``inside``: ``apply_grads`` inside the block.
- ``after`` / ``after_fill``: a normal pass first, ``block.grads`` per loss, the
  block exits, ``zero_grad(set_to_none=True/False)``, then ``apply_grads``.
- ``zero_none`` / ``zero_fill``: a normal pass, ``zero_grad(set_to_none=...)``, then
  ``block.grads`` and ``apply_grads`` inside: the normal pass must not come back.
- ``plus_pass``: a normal pass, then ``block.grads``: ``.grad`` keeps the pass's
  gradient and the combination adds to it.
"""

from __future__ import annotations

import copy
import itertools

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_retain
from fsdp_retain import no_reshard_between_backwards
from tests.support import fsdp1_utils as f1
from tests.support import fsdp2_utils as f2
from tests.loss_grads.cases_loss_grads import pcgrad_weights
from tests.support.harness import Registry
from tests.support.parity import DIM, LOSSES, Block, batch, world

registry = Registry()
STEPS = 3
TIGHT = dict(rtol=1e-6, atol=1e-6)


class MTLNet(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM, bias=False)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(2))
        self.heads = nn.ModuleList(nn.Linear(DIM, DIM, bias=i > 0) for i in range(3))
        if tied:
            self.heads[0].weight = self.inp.weight

    def features(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return h

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        h = self.features(x)
        return [head(h) for head in self.heads]


def make_model(variant: str, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(42)
    model = MTLNet(tied=variant == "tied").to(dtype)
    if variant == "tied":
        for block in model.blocks:
            block.norm.weight.requires_grad_(False)
    if variant == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=2, target_modules=["fc1", "fc2"], init_lora_weights=False))
        for p in model.base_model.model.heads.parameters():
            p.requires_grad_(True)
    return model


def inner(model: nn.Module) -> MTLNet:
    """The ``MTLNet`` inside wrappers (FSDP1, peft)."""
    return next(m for m in model.modules() if isinstance(m, MTLNet))


def losses(outs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [fn(out) for fn, out in zip(LOSSES, outs)]


def trainable(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _averaged(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    grads = [g.detach().clone() for g in grads]
    for g in grads:
        dist.all_reduce(g)
        g /= world()
    return grads


def reference_step(ref: nn.Module, opt, x: torch.Tensor, method: str, flow: str) -> torch.Tensor:
    """The one-process method; returns its Gramian (over the parameters it weighs)."""
    named = trainable(ref)
    params = [p for _, p in named]
    trunk = {id(p) for p in inner(ref).blocks.parameters()} | {id(inner(ref).inp.weight)}
    shared = [id(p) in trunk for p in params]
    outs = ref(x)
    if method == "mtl":
        gram = _torchjd_step(ref, x, params, shared)
    else:
        per_loss = []
        for i, loss in enumerate(losses(outs)):
            grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
            per_loss.append(_averaged([torch.zeros_like(p) if g is None else g
                                       for p, g in zip(params, grads)]))
        mask = shared if method == "shared" else [True] * len(params)
        rows = [torch.cat([g.reshape(-1) for g, m in zip(gs, mask) if m]).double() for gs in per_loss]
        gram = torch.stack(rows) @ torch.stack(rows).T
        weights = pcgrad_weights(gram)
        for p, m, *gs in zip(params, mask, *per_loss):
            ws = weights if m else torch.ones_like(weights)
            p.grad = sum(float(w) * g for w, g in zip(ws, gs))
    if flow == "plus_pass":
        first = torch.autograd.grad(LOSSES[0](ref(x)[0]), params, materialize_grads=True)
        for p, g in zip(params, _averaged(list(first))):
            p.grad += g
    opt.step()
    opt.zero_grad()
    return gram


def _torchjd_step(ref: nn.Module, x: torch.Tensor, params, shared) -> torch.Tensor:
    """torchjd's own multi-task step, its Jacobian and head gradients averaged over ranks."""
    from torchjd.aggregation import UPGrad
    from torchjd.autojac import jac_to_grad, mtl_backward

    net = inner(ref)
    feats = net.features(x)
    outs = [head(feats) for head in net.heads]
    shared_params = [p for p, s in zip(params, shared) if s]
    tasks = [[p for p in head.parameters() if p.requires_grad] for head in net.heads]
    mtl_backward(losses(outs), features=feats, shared_params=shared_params, tasks_params=tasks)
    for p in shared_params:
        p.jac = _averaged([p.jac])[0]
    for p in params:
        if p.grad is not None:
            p.grad = _averaged([p.grad])[0]
    jac = torch.cat([p.jac.reshape(3, -1) for p in shared_params], dim=1)
    jac_to_grad(shared_params, UPGrad())
    return jac @ jac.T


def wrap(flavour: str, model: nn.Module) -> tuple[nn.Module, object]:
    if flavour.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = None
        if flavour == "fsdp2_hsdp":
            mesh = init_device_mesh("cpu", (world() // 2, 2), mesh_dim_names=("replicate", "shard"))
        for block in inner(model).blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, f2.ADAPTER
    strategy = {"full": f1.FULL, "gradop": f1.GRAD_OP, "noshard": f1.NO_SHARD,
                "hybrid": f1.HYBRID}[flavour.split("_")[1]]
    return f1.wrap(model, strategy, use_orig_params=flavour.endswith("orig")), f1.ADAPTER


def budget(ref: nn.Module) -> int:
    """About one block's unsharded bytes: the budget keeps some units, re-gathers others."""
    block = inner(ref).blocks[0]
    return int(1.5 * sum(p.numel() * p.element_size() for p in block.parameters()))


def fsdp_step(model, opt, x, method: str, flow: str, options: dict) -> torch.Tensor:
    with no_reshard_between_backwards(model, **options) as block:
        outs = model(x)
        if flow != "inside":
            LOSSES[0](outs[0]).backward(retain_graph=True)
        if flow in ("zero_none", "zero_fill"):
            opt.zero_grad(set_to_none=flow == "zero_none")
        trunk = None if method == "all" else [inner(model).inp, inner(model).blocks]
        grads = [block.grads(loss, retain_graph=True) for loss in losses(outs)]
        weigh = grads if trunk is None else [g.select(trunk) for g in grads]
        gram = fsdp_retain.gramian(weigh)
        if method == "mtl":
            from torchjd.aggregation import UPGrad

            weights = UPGrad().gramian_weighting(gram)
        else:
            weights = pcgrad_weights(gram)
        update = [fsdp_retain.combine(weigh, weights)]
        if trunk is not None:
            heads = [g.select(exclude=trunk) for g in grads]
            update.append(fsdp_retain.combine(heads, torch.ones(3)))
        if flow in ("inside", "zero_none", "zero_fill", "plus_pass"):
            for u in update:
                fsdp_retain.apply_grads(u)
    if flow in ("after", "after_fill"):
        opt.zero_grad(set_to_none=flow == "after")
        for u in update:
            fsdp_retain.apply_grads(u)
    opt.step()
    opt.zero_grad()
    return gram


def parity(flavour: str, variant: str, method: str, flow: str, keep) -> None:
    dtype = torch.float64 if method == "mtl" else torch.float32
    net = make_model(variant, dtype)
    ref = copy.deepcopy(net)
    model, adapter = wrap(flavour, net)
    options = dict(keep_unsharded=budget(ref) if keep == "budget" else keep)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD([p for _, p in trainable(ref)], lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x = batch(step).to(dtype)
        ref_gram = reference_step(ref, ref_opt, x, method, flow)
        gram = fsdp_step(model, opt, x, method, flow, options)
        torch.testing.assert_close(gram, ref_gram.to(gram.dtype), **TIGHT,
                                   msg=lambda m: f"step {step}: Gramian: {m}")
        ref_params = {n: p.detach() for n, p in ref.named_parameters()}
        params = adapter.full_params(model)
        assert set(params) == set(ref_params), sorted(set(params) ^ set(ref_params))
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], **TIGHT,
                                       msg=lambda m, n=name: f"step {step}: {n}: {m}")


FLAVOURS = ("fsdp2", "fsdp1_full_flat", "fsdp1_full_orig", "fsdp1_gradop_flat",
            "fsdp1_gradop_orig", "fsdp1_noshard_flat", "fsdp1_noshard_orig")
FLOWS = ("inside", "after", "after_fill", "zero_none", "zero_fill", "plus_pass")
KEEPS = (True, False, "budget")
_rotate = itertools.cycle(KEEPS)
for _flavour in FLAVOURS:
    # Frozen parameters beside trainable ones in one unit: FSDP1 needs original parameters.
    _variant = "plain" if _flavour.endswith("flat") else "tied"
    for _flow in FLOWS:
        _keep = next(_rotate)
        registry.add(
            f"loss_grads_{_flavour}_{_variant}_all_{_flow}_keep_{_keep}",
            lambda f=_flavour, v=_variant, fl=_flow, k=_keep: parity(f, v, "all", fl, k),
        )
# No frozen parameter: gradients applied after the block and zero_grad() between
# passes alone (each was silently wrong on FSDP1 with original parameters).
for _flavour, _flow, _keep in (("fsdp1_full_orig", "after", True), ("fsdp1_full_orig", "zero_none", True),
                               ("fsdp1_noshard_orig", "after", False),
                               ("fsdp1_gradop_orig", "zero_fill", "budget")):
    registry.add(
        f"loss_grads_{_flavour}_plain_all_{_flow}_keep_{_keep}",
        lambda f=_flavour, fl=_flow, k=_keep: parity(f, "plain", "all", fl, k),
    )
for _flavour in ("fsdp2", "fsdp1_full_orig", "fsdp1_gradop_orig", "fsdp1_noshard_orig"):
    for _keep, _method, _flow in zip(KEEPS, ("shared", "mtl", "all"), ("after", "inside", "zero_fill")):
        registry.add(
            f"loss_grads_{_flavour}_lora_{_method}_{_flow}_keep_{_keep}",
            lambda f=_flavour, m=_method, fl=_flow, k=_keep: parity(f, "lora", m, fl, k),
        )
for _flavour, _keep in zip(("fsdp2", "fsdp1_full_flat", "fsdp1_full_orig", "fsdp1_noshard_flat"),
                           itertools.cycle(KEEPS)):
    for _method in ("shared", "mtl"):
        registry.add(
            f"loss_grads_{_flavour}_plain_{_method}_inside_keep_{_keep}",
            lambda f=_flavour, m=_method, k=_keep: parity(f, "plain", m, "inside", k),
        )


# HSDP, 4 ranks (2 replicas of 2 shards): the Gramian is summed over one replica's shards.
for _flavour, _variant, _method, _flow, _keep in (
    ("fsdp1_hybrid_orig", "tied", "all", "after", True),
    ("fsdp1_hybrid_orig", "lora", "shared", "zero_none", "budget"),
    ("fsdp1_hybrid_flat", "plain", "mtl", "inside", False),
    ("fsdp2_hsdp", "lora", "mtl", "zero_fill", True),
    ("fsdp2_hsdp", "tied", "all", "after_fill", False),
):
    registry.add(
        f"loss_grads_{_flavour}_{_variant}_{_method}_{_flow}_keep_{_keep}",
        lambda f=_flavour, v=_variant, m=_method, fl=_flow, k=_keep: parity(f, v, m, fl, k),
        world_sizes=(4,),
    )


def _norms(flavour: str, variant: str) -> None:
    """``LossGrads.norms()``: each trainable parameter's gradient norm by name (the
    names of the unwrapped model's state dict), against the reference's; frozen
    parameters absent; ``names`` the same on every rank."""
    net = make_model(variant, torch.float32)
    ref = copy.deepcopy(net)
    model, _ = wrap(flavour, net)
    x = batch(0)
    with no_reshard_between_backwards(model) as block:
        g = block.grads(LOSSES[1](model(x)[1]))
        norms = g.norms()
        trunk_norm = g.select([n for n in g.names if ".blocks." in f".{n}"]).norm()
    named = trainable(ref)
    grads = torch.autograd.grad(LOSSES[1](ref(x)[1]), [p for _, p in named], allow_unused=True,
                                materialize_grads=True)
    expected = {n: gr.double().norm() for (n, _), gr in zip(named, _averaged(list(grads)))}
    assert set(norms) == set(expected) - _aliases(ref), sorted(set(norms) ^ set(expected))
    for name, value in norms.items():
        torch.testing.assert_close(value, expected[name], **TIGHT, msg=lambda m, n=name: f"{n}: {m}")
    want = sum(float(v) ** 2 for n, v in expected.items() if ".blocks." in f".{n}") ** 0.5
    torch.testing.assert_close(float(trunk_norm), want, **TIGHT)
    names = [None] * world()
    dist.all_gather_object(names, list(g.names))
    assert all(n == names[0] for n in names), "ranks cover different names"


def _aliases(ref: nn.Module) -> set[str]:
    """Tied names named_parameters() leaves out (it shows each tensor once)."""
    every = {n for n, p in ref.named_parameters(remove_duplicate=False) if p.requires_grad}
    return every - {n for n, _ in trainable(ref)}


registry.add("loss_grads_norms_fsdp2_lora", lambda: _norms("fsdp2", "lora"))
registry.add("loss_grads_norms_fsdp1_flat", lambda: _norms("fsdp1_full_flat", "plain"))
registry.add("loss_grads_norms_fsdp1_orig_lora", lambda: _norms("fsdp1_full_orig", "lora"))
registry.add("loss_grads_norms_fsdp1_noshard_orig_tied", lambda: _norms("fsdp1_noshard_orig", "tied"))


def _expect_value_error(fn, *words: str) -> None:
    try:
        fn()
    except ValueError as exc:
        for word in words:
            assert word in str(exc), (word, str(exc))
    else:
        raise AssertionError(f"no ValueError naming {words}")


@registry.case()
def loss_grads_selection_refusals() -> None:
    """Selections that would be silently wrong are refused, naming the fix: a
    submodule's ``parameters()`` on FSDP1 flat parameters (the flat parameters of the
    units inside it, not the root-owned ``inp``), a frozen parameter, an unknown name,
    parameters taken before wrapping, and gradients over different selections."""
    net = make_model("plain", torch.float32)
    before = list(net.parameters())
    flat, _ = wrap("fsdp1_full_flat", net)
    with no_reshard_between_backwards(flat) as block:
        outs = flat(batch(0))
        g = block.grads(LOSSES[0](outs[0]), retain_graph=True)
        _expect_value_error(lambda: g.select(inner(flat).blocks.parameters()), "params=model.trunk")
        assert set(g.select(flat.parameters()).names) == set(g.names)
        _expect_value_error(lambda: g.select("nope"), "matches no parameter")
        _expect_value_error(lambda: g.select(before[:1]), "before wrapping")
        h = block.grads(LOSSES[1](outs[1]))
        _expect_value_error(lambda: fsdp_retain.gramian([g.select("heads"), h]), "select")
    tied, _ = wrap("fsdp1_full_orig", make_model("tied", torch.float32))
    with no_reshard_between_backwards(tied) as block:
        g = block.grads(LOSSES[0](tied(batch(0))[0]))
        _expect_value_error(lambda: g.select("blocks.0.norm.weight"), "frozen")
        assert "blocks.0.norm.weight" not in g.names
        assert set(g.select("heads.0.weight").names) == {"inp.weight"}, "a tied alias"
