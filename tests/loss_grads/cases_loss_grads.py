"""Per-loss gradients under FSDP (CPU, gloo): ``block.grads(loss)``, ``gramian``,
``combine`` and ``apply_grads``; see [Note: per-loss gradients].

A shared trunk (the repository's MLP) and three conflicting losses over one forward.
The reference is the one-process method on an unsharded copy: each loss's gradient
by ``torch.autograd.grad``, averaged over ranks (what FSDP's reduction gives), their
Gramian, the method's weights from it, the weighted sum as ``.grad``, an SGD-momentum
step. Over 3 steps the Gramian, the weights and the parameters match it. Methods:
PCGrad (pairwise projections, written on the k x k Gramian), an inverse-norm
weighting and torchjd's UPGrad (Jacobian descent; its Gramian weighting, unchanged). FSDP2 (``keep_unsharded`` True, False, a budget), FSDP1 FULL_SHARD (flat
and original parameters), SHARD_GRAD_OP, NO_SHARD.

Also: ``.grad`` is left as it was (a normal pass before ``block.grads`` keeps its
gradient), the ``LossGrads`` are shards, never unsharded copies (their elements sum
to 1/world of the model's), and ``sync_grads="last"`` is refused with the fix named.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist

import fsdp_retain
from fsdp_retain import no_reshard_between_backwards
from tests.support import fsdp1_utils as f1
from tests.support import fsdp2_utils as f2
from tests.support.harness import Registry
from tests.support.parity import LOSSES, assert_close_dicts, batch, make_net, sgd, world

registry = Registry()
STEPS = 3


def pcgrad_weights(gram: torch.Tensor) -> torch.Tensor:
    """PCGrad (Yu et al. 2020) in a fixed order, on the Gramian: each projected
    gradient is a combination of the originals; returns the summed coefficients."""
    k = gram.shape[0]
    coeffs = torch.eye(k, dtype=gram.dtype)
    for i in range(k):
        for j in range(k):
            if i == j:
                continue
            inner = coeffs[i] @ gram[:, j]
            if inner < 0:
                coeffs[i] = coeffs[i] - inner / gram[j, j] * torch.eye(k, dtype=gram.dtype)[j]
    return coeffs.sum(0)


def inverse_norm_weights(gram: torch.Tensor) -> torch.Tensor:
    norms = gram.diagonal().sqrt()
    return (1.0 / norms) / (1.0 / norms).sum()


def upgrad_weights(gram: torch.Tensor) -> torch.Tensor:
    from torchjd.aggregation import UPGrad  # the mtl extra

    return UPGrad().gramian_weighting(gram)


METHODS = {"pcgrad": pcgrad_weights, "inverse_norm": inverse_norm_weights, "upgrad": upgrad_weights}


def _reference_step(ref, opt, x, method) -> tuple[torch.Tensor, torch.Tensor]:
    out = ref(x)
    params = list(ref.parameters())
    flat = []
    per_loss = []
    for i, loss_fn in enumerate(LOSSES):
        grads = torch.autograd.grad(loss_fn(out), params, retain_graph=i < len(LOSSES) - 1)
        grads = [g.detach().clone() for g in grads]
        for g in grads:
            dist.all_reduce(g)
            g /= world()
        per_loss.append(grads)
        flat.append(torch.cat([g.reshape(-1) for g in grads]).to(torch.float64))
    gram = torch.stack(flat) @ torch.stack(flat).T
    weights = method(gram)
    for p, *gs in zip(params, *per_loss):
        p.grad = sum(float(w) * g for w, g in zip(weights, gs))
    opt.step()
    opt.zero_grad()
    return gram, weights


def _wrap(flavour: str, net):
    if flavour == "fsdp2":
        return f2.wrap(net), f2.ADAPTER
    strategy = {"full": f1.FULL, "gradop": f1.GRAD_OP, "noshard": f1.NO_SHARD}[flavour.split("_")[1]]
    return f1.wrap(net, strategy, use_orig_params=flavour.endswith("orig")), f1.ADAPTER


def _parity(flavour: str, method: str, options: dict) -> None:
    net = make_net()
    ref = copy.deepcopy(net)
    model, adapter = _wrap(flavour, net)
    opt, ref_opt = sgd(model), sgd(ref)
    weigh = METHODS[method]
    for step in range(STEPS):
        x = batch(step)
        ref_gram, ref_weights = _reference_step(ref, ref_opt, x, weigh)
        with no_reshard_between_backwards(model, **options) as block:
            out = model(x)
            grads = [
                block.grads(loss_fn(out), retain_graph=i < len(LOSSES) - 1)
                for i, loss_fn in enumerate(LOSSES)
            ]
            assert block.backward_passes == len(LOSSES)
            assert all(p.grad is None for p in model.parameters()), ".grad was written"
            gram = fsdp_retain.gramian(grads)
            torch.testing.assert_close(gram, ref_gram, rtol=1e-6, atol=1e-9)
            weights = weigh(gram)
            torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-9)
            fsdp_retain.apply_grads(fsdp_retain.combine(grads, weights))
        opt.step()
        opt.zero_grad()
        ref_params = {n: p.detach() for n, p in ref.named_parameters()}
        assert_close_dicts(adapter.full_params(model), ref_params, f"step {step}: params")


FLAVOURS = ("fsdp2", "fsdp1_full_flat", "fsdp1_full_orig", "fsdp1_gradop_orig", "fsdp1_noshard_orig")
for _flavour in FLAVOURS:
    for _method in METHODS:
        registry.add(
            f"loss_grads_{_method}_{_flavour}",
            lambda f=_flavour, m=_method: _parity(f, m, {}),
        )
for _flavour in ("fsdp2", "fsdp1_full_orig"):
    registry.add(
        f"loss_grads_pcgrad_{_flavour}_regather",
        lambda f=_flavour: _parity(f, "pcgrad", dict(keep_unsharded=False)),
    )
    registry.add(
        f"loss_grads_pcgrad_{_flavour}_budget",
        lambda f=_flavour: _parity(f, "pcgrad", dict(keep_unsharded=1, backwards=3)),
    )


def _grad_left_alone(flavour: str) -> None:
    """A normal pass, then ``block.grads`` of another loss: ``.grad`` still holds the
    normal pass's gradient, and the ``LossGrads`` equal that loss's own pass."""
    net = make_net()
    model, adapter = _wrap(flavour, net)
    x = batch(0)
    with no_reshard_between_backwards(model) as block:
        out = model(x)
        LOSSES[0](out).backward(retain_graph=True)
        before = adapter.full_grads(model)
        grads = block.grads(LOSSES[1](out), retain_graph=True)
        assert_close_dicts(adapter.full_grads(model), before, ".grad after block.grads")
        model.zero_grad()
        LOSSES[1](out).backward()
        alone = fsdp_retain.gramian([grads])[0, 0]
    norm = sum(float(g.pow(2).sum()) for g in adapter.full_grads(model).values())
    torch.testing.assert_close(alone.item(), norm, rtol=1e-6, atol=1e-9)
    numel = sum(v.numel() for v in grads.locals() if v is not None)
    total = sum(p.numel() for p in net.parameters()) if flavour == "fsdp2" else None
    if total is not None:
        assert numel <= total // world() + 64, (numel, total)


registry.add("loss_grads_leave_grad_alone_fsdp2", lambda: _grad_left_alone("fsdp2"))
registry.add("loss_grads_leave_grad_alone_fsdp1_orig", lambda: _grad_left_alone("fsdp1_full_orig"))
registry.add("loss_grads_leave_grad_alone_fsdp1_flat", lambda: _grad_left_alone("fsdp1_full_flat"))


@registry.case()
def loss_grads_sync_last_refused() -> None:
    model, _ = _wrap("fsdp2", make_net())
    with no_reshard_between_backwards(model, sync_grads="last") as block:
        out = model(batch(0))
        try:
            block.grads(LOSSES[0](out), retain_graph=True)
        except ValueError as e:
            assert "sync_grads='every'" in str(e), e
        else:
            raise AssertionError("block.grads() ran under sync_grads='last'")
        LOSSES[1](out).backward()


def _autogram(flavour: str) -> None:
    """torchjd's ``autogram.Engine`` builds its Gramian with ``torch.autograd.grad`` on
    the parameters: under FSDP it sees no parameter the forward used, so its Gramian
    is silently zero and any weighting of it falls back to equal weights. Inside the
    block that call is refused before anything is written (the fix named:
    ``block.grads``), and a plain step after it is right."""
    from torchjd.autogram import Engine

    from fsdp_retain._common import RetainError

    def gramian(model, use_block: bool):
        engine = Engine(model, batch_dim=None)
        ctx = no_reshard_between_backwards(model) if use_block else contextlib.nullcontext()
        with ctx:
            out = model(batch(0))
            return engine.compute_gramian(torch.stack([f(out) for f in LOSSES]))

    plain, _ = _wrap(flavour, make_net())
    try:
        silent = gramian(plain, use_block=False)
    except Exception as exc:  # noqa: BLE001 - plain FSDP1 may crash instead
        print(f"{flavour} without the library: {type(exc).__name__}: {exc}"[:300])
    else:
        assert float(silent.abs().max()) == 0.0, f"expected the silent zeros, got {silent}"
    net = make_net()
    ref = copy.deepcopy(net)
    model, adapter = _wrap(flavour, net)
    try:
        gramian(model, use_block=True)
    except (ValueError, RetainError) as exc:
        assert "block.grads" in str(exc), exc
    else:
        raise AssertionError("autogram's autograd.grad on parameters was not refused")
    assert all(p.grad is None for p in model.parameters()), "a gradient was written"
    opt, ref_opt = sgd(model), sgd(ref)
    x = batch(1)
    LOSSES[0](model(x)).backward()
    LOSSES[0](ref(x)).backward()
    for p in ref.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world()
    opt.step()
    ref_opt.step()
    ref_params = {n: p.detach() for n, p in ref.named_parameters()}
    assert_close_dicts(adapter.full_params(model), ref_params, "a plain step after the refusal")


registry.add("loss_grads_torchjd_autogram_caught_fsdp2", lambda: _autogram("fsdp2"))
registry.add("loss_grads_torchjd_autogram_caught_fsdp1", lambda: _autogram("fsdp1_full_orig"))
