"""The rest of the torch API training code calls beside the block (part of
``tests/api/cases_api.py``), on FSDP2 and FSDP1 (FULL_SHARD, original parameters).

- ``out.backward(gradient=g)`` on the non-scalar output, then a scalar loss.
- ``torch.autograd.grad`` on an activation between passes (the result equals the
  reference's), and a gradient penalty built with ``create_graph=True`` on it.
- FSDP2 explicit prefetch (``set_modules_to_forward_prefetch`` /
  ``set_modules_to_backward_prefetch``).
- Meta-device init (FSDP2 ``to_empty`` + ``set_model_state_dict``; FSDP1
  ``param_init_fn``), then training.
- ``get_model_state_dict`` / ``get_optimizer_state_dict`` and a
  ``torch.distributed.checkpoint`` save and load between steps.
- A ``torch.no_grad()`` forward between passes (an eval forward for logging).
- Several heads sharing one trunk (multi-token prediction): one forward, one pass per
  head, each head its own unit.

Each runs ``keep_unsharded`` True and False (a probe pass first where it makes sense)
against an unsharded reference over 3 SGD-momentum steps.
"""

from __future__ import annotations

import copy
import functools
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from fsdp_retain import no_reshard_between_backwards
from tests.support import fsdp1_utils as f1
from tests.support import fsdp2_utils as f2
from tests.support.harness import Registry
from tests.support.parity import (
    LOSSES,
    TOL,
    Block,
    Net,
    assert_close_dicts,
    averaged_grads,
    batch,
    make_net,
    sgd,
)

registry = Registry()
STEPS = 3
FLAVOURS = ("fsdp2", "fsdp1_orig")
KEEPS = (True, False)


def _wrap(flavour: str, net: nn.Module) -> tuple[nn.Module, object]:
    if flavour == "fsdp2":
        return f2.wrap(net), f2.ADAPTER
    return f1.wrap(net, f1.FULL, use_orig_params=True), f1.ADAPTER


def _train(model, ref, adapter, passes, options: dict, steps: int = STEPS, between=None) -> None:
    """``passes(model, x, block)`` runs one step's forward and passes (``block`` is None
    for the reference), inside the block for the model; parameters compared per step.
    ``between(step, model, opt)`` runs after each step's optimizer step."""
    opt, ref_opt = sgd(model), sgd(ref)
    for step in range(steps):
        x = batch(step)
        passes(ref, x, None)
        grads = averaged_grads(ref)
        for name, param in ref.named_parameters():
            param.grad = grads.get(name)
        ref_opt.step()
        ref_opt.zero_grad()
        with no_reshard_between_backwards(model, **options) as block:
            passes(model, x, block)
        opt.step()
        opt.zero_grad()
        if between is not None:
            opt = between(step, model, opt) or opt
        ref_params = {n: p.detach() for n, p in ref.named_parameters()}
        assert_close_dicts(adapter.full_params(model), ref_params, f"step {step}: params")


def _case(flavour: str, keep: bool, passes, **kwargs) -> None:
    net = make_net()
    ref = copy.deepcopy(net)
    model, adapter = _wrap(flavour, net)
    _train(model, ref, adapter, passes, dict(keep_unsharded=keep), **kwargs)


def _add(name: str, fn) -> None:
    for flavour in FLAVOURS:
        for keep in KEEPS:
            tag = "keep" if keep else "regather"
            registry.add(f"{name}_{flavour}_{tag}", functools.partial(fn, flavour, keep))


# --- backward(gradient=) on a non-scalar output ----------------------------------


def _gradient_passes(model, x, block) -> None:
    out = model(x)
    g = torch.linspace(-1.0, 1.0, out.numel()).view_as(out)
    out.backward(g, retain_graph=True)
    LOSSES[1](out).backward()


_add("backward_gradient_non_scalar", lambda f, k: _case(f, k, _gradient_passes))


# --- autograd.grad on an activation ------------------------------------------------


def _hidden(model) -> nn.Module:
    block = model.blocks[1]
    return getattr(block, "module", block)  # FSDP1 wraps the block


def _activation_passes(penalty: bool, seen: dict, model, x, block) -> None:
    captured = []
    handle = _hidden(model).register_forward_hook(lambda m, a, o: captured.append(o))
    out = model(x)
    handle.remove()
    (h,) = captured
    loss = LOSSES[0](out)
    if block is not None and not penalty:
        block.backward(LOSSES[2](out), param_grads=False, retain_graph=True)
    (gh,) = torch.autograd.grad(loss, h, retain_graph=True, create_graph=penalty)
    key = "model" if block is not None else "ref"
    seen.setdefault(key, []).append(gh.detach().clone())
    total = LOSSES[1](out) + (gh.pow(2).sum() if penalty else 0.0)
    total.backward()


def _activation_case(penalty: bool, flavour: str, keep: bool) -> None:
    seen: dict = {}
    _case(flavour, keep, functools.partial(_activation_passes, penalty, seen))
    for got, want in zip(seen["model"], seen["ref"]):
        torch.testing.assert_close(got, want, **TOL)


_add("autograd_grad_on_activation", functools.partial(_activation_case, False))
for _flavour in FLAVOURS:  # create_graph=True needs the parameters kept
    registry.add(
        f"gradient_penalty_on_activation_{_flavour}_keep",
        functools.partial(_activation_case, True, _flavour, True),
    )


# --- FSDP2 explicit prefetch -------------------------------------------------------


def _explicit_prefetch(keep: bool) -> None:
    net = make_net()
    ref = copy.deepcopy(net)
    model = f2.wrap(net)
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        if i + 1 < len(blocks):
            block.set_modules_to_forward_prefetch([blocks[i + 1]])
        if i > 0:
            block.set_modules_to_backward_prefetch([blocks[i - 1]])

    def passes(m, x, block):
        out = m(x)
        if block is not None:
            block.backward(LOSSES[0](out), param_grads=False, retain_graph=True)
        LOSSES[0](out).backward(retain_graph=True)
        LOSSES[1](out).backward()

    _train(model, ref, f2.ADAPTER, passes, dict(keep_unsharded=keep))


for _keep in KEEPS:
    registry.add(
        f"fsdp2_explicit_prefetch_{'keep' if _keep else 'regather'}",
        functools.partial(_explicit_prefetch, _keep),
    )


def _two_passes(model, x, block) -> None:
    out = model(x)
    LOSSES[0](out).backward(retain_graph=True)
    LOSSES[1](out).backward()


# --- meta-device init --------------------------------------------------------------


def _meta_init(flavour: str, keep: bool) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    ref = make_net()
    full = {k: v.clone() for k, v in ref.state_dict().items()}
    with torch.device("meta"):
        net = Net()
    if flavour == "fsdp2":
        model = f2.wrap(net)
        model.to_empty(device="cpu")
        adapter = f2.ADAPTER
    else:
        model = FSDP(
            net,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            use_orig_params=True,
            device_id=torch.device("cpu"),
            param_init_fn=lambda m: m.to_empty(device=torch.device("cpu"), recurse=False),
        )
        adapter = f1.ADAPTER
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
    _train(model, ref, adapter, _two_passes, dict(keep_unsharded=keep))


_add("meta_device_init", _meta_init)


# --- state dicts and a distributed checkpoint between steps -----------------------


def _checkpoint_between(flavour: str, keep: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    path = [None]
    if dist.get_rank() == 0:
        path[0] = tempfile.mkdtemp(prefix="fsdp_retain_dcp_")
    dist.broadcast_object_list(path)

    def between(step, model, opt):
        state = {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, opt),
        }
        dcp.save(state, checkpoint_id=f"{path[0]}/step{step}")
        for p in model.parameters():  # scramble, then load back
            p.data.add_(1.0)
        dcp.load(state, checkpoint_id=f"{path[0]}/step{step}")
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
        return opt

    try:
        _case(flavour, keep, _two_passes, between=between)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(path[0], ignore_errors=True)


_add("dcp_save_load_between_steps", _checkpoint_between)


# --- a no_grad forward between passes ---------------------------------------------


def _no_grad_between(model, x, block) -> None:
    out = model(x)
    LOSSES[0](out).backward(retain_graph=True)
    with torch.no_grad():
        logged = LOSSES[2](model(x))  # an eval forward for logging
    assert torch.isfinite(logged)
    LOSSES[1](out).backward()


_add("no_grad_forward_between_passes", lambda f, k: _case(f, k, _no_grad_between))


# --- several heads over one trunk (multi-token prediction) -------------------------


class MTPNet(nn.Module):
    def __init__(self, heads: int = 3) -> None:
        super().__init__()
        torch.manual_seed(42)
        self.trunk = Net()
        self.heads = nn.ModuleList(Block(12) for _ in range(heads))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        h = self.trunk(x)
        return [head(h) for head in self.heads]


def _mtp(flavour: str, keep: bool) -> None:
    net = MTPNet()
    ref = copy.deepcopy(net)
    if flavour == "fsdp2":
        mesh = f2.init_device_mesh("cpu", (dist.get_world_size(),))
        for module in list(net.trunk.blocks) + list(net.heads):
            fully_shard(module, mesh=mesh)
        model, adapter = fully_shard(net, mesh=mesh), f2.ADAPTER
    else:
        model, adapter = _wrap(flavour, net)

    def passes(m, x, block):
        outs = m(x)
        if block is not None:
            block.backward(outs[0].pow(2).mean(), param_grads=False, retain_graph=True)
        for i, out in enumerate(outs):
            LOSSES[i % len(LOSSES)](out).backward(retain_graph=i < len(outs) - 1)
        if block is not None:
            assert block.backward_passes == len(outs) + 1

    _train(model, ref, adapter, passes, dict(keep_unsharded=keep))


_add("multi_token_heads_one_trunk", _mtp)
