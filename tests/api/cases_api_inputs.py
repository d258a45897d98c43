"""``backward(inputs=...)`` and ``torch.autograd.grad`` naming the model's parameters
inside the block (CPU, gloo); see [Note: inputs that name parameters].

Run inside ranks by ``tests/api/test_api_surface.py``. The user names parameters as
``model.named_parameters()`` gives them: FSDP2's sharded DTensors, FSDP1's
original parameters (``use_orig_params=True``) or flat parameters. The
reference names the same parameters of an unsharded copy.

- **A pass over some parameters, then a full pass** (``inputs=`` the head:
  ``blocks.2.fc2.weight`` and ``out.weight``, parts of two units): after pass 1
  the named gradients equal the reference's, the others are still ``None``;
  after the step the parameters equal the reference's, over 3 SGD-momentum
  steps. FSDP2, FSDP1 FULL_SHARD / SHARD_GRAD_OP / NO_SHARD (original
  parameters), FSDP1 flat parameters (a whole unit named), every option,
  ``block.backward(..., inputs=)``, a ``GradientEdge`` of a parameter, a tied
  weight, an activation next to a parameter in ``inputs``, bf16 parameters
  (mixed precision: FSDP1 makes a new ``AccumulateGrad`` node per forward).
- **A step whose only pass names some parameters**: the others do not move
  (their ``.grad`` stays ``None``, so SGD skips them), also with momentum
  from earlier steps.
- **Refused before any gradient is written**: ``torch.autograd.grad`` on
  parameters (also ``materialize_grads=True``, which plain FSDP answers with
  zeros), an input that is a slice or ``to_local()`` of a parameter, a probe
  pass with ``inputs``; a plain step after the refusal is right.
- **Without the library** plain FSDP2 and FSDP1 silently compute nothing for
  the named parameters (the step equals a step on pass 2 alone).
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
from torch.distributed.fsdp._common_utils import clean_tensor_name

from fsdp_retain import no_reshard_between_backwards
from fsdp_retain._common import RetainError
from tests.support import fsdp1_utils as f1
from tests.support import fsdp2_utils as f2
from tests.support.harness import Registry
from tests.support.parity import (
    LOSSES,
    TOL,
    assert_close_dicts,
    averaged_grads,
    batch,
    make_net,
    sgd,
)

registry = Registry()

HEAD = ("blocks.2.fc2.weight", "out.weight")
OPTIONS = {
    "keep_every": dict(),
    "regather_every": dict(keep_unsharded=False),
    "keep_last": dict(sync_grads="last"),
    "regather_last_b2": dict(keep_unsharded=False, sync_grads="last", backwards=2),
    "budget_every_b2": dict(keep_unsharded=1, backwards=2),
}
FLAVOURS = {
    "fsdp2": lambda net: f2.wrap(net),
    "fsdp1_full_orig": lambda net: f1.wrap(net, f1.FULL, use_orig_params=True),
    "fsdp1_gradop_orig": lambda net: f1.wrap(net, f1.GRAD_OP, use_orig_params=True),
    "fsdp1_noshard_orig": lambda net: f1.wrap(net, f1.NO_SHARD, use_orig_params=True),
    "fsdp1_full_flat": lambda net: f1.wrap(net, f1.FULL),
}


def _adapter(flavour: str):
    return f2.ADAPTER if flavour == "fsdp2" else f1.ADAPTER


def _unit(name: str) -> str:
    """The FSDP1 unit a (clean) parameter name is in: ``blocks.<i>`` or the root."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" else ""


def _named(model, names) -> list[torch.Tensor]:
    """The parameters ``names`` as ``model.named_parameters()`` gives them. FSDP1
    flat parameters: the flat parameter of each unit holding one of them."""
    found = [p for n, p in model.named_parameters() if clean_tensor_name(n) in names]
    if found:
        return found
    units = {_unit(n) for n in names}
    return [p for n, p in model.named_parameters() if _unit(clean_tensor_name(n)) in units]


def _flat_names(flavour: str, names) -> tuple[str, ...]:
    """What the reference must name: with flat parameters, every parameter of the units."""
    if flavour != "fsdp1_full_flat":
        return tuple(names)
    units = {_unit(n) for n in names}
    return tuple(n for n, _ in make_net().named_parameters() if _unit(n) in units)


def _setup(flavour: str, tied: bool = False):
    net = make_net(tied=tied)
    ref = copy.deepcopy(net)
    model = FLAVOURS[flavour](net)
    return model, ref, sgd(model), sgd(ref)


def _ref_step(ref, opt, x, names, passes) -> dict:
    out = ref(x)
    after_first = {}
    for i in range(passes):
        kwargs = dict(inputs=[p for n, p in ref.named_parameters() if n in names]) if i == 0 else {}
        LOSSES[i](out).backward(retain_graph=i < passes - 1, **kwargs)
        if i == 0:
            after_first = averaged_grads(ref)
    final = averaged_grads(ref)
    for name, param in ref.named_parameters():
        param.grad = final[name].clone() if name in final else None
    opt.step()
    opt.zero_grad()
    return after_first


def _run(flavour, options, *, passes=2, tied=False, how="backward", use_block=True, steps=3):
    model, ref, opt, ref_opt = _setup(flavour, tied)
    adapter = _adapter(flavour)
    names = _flat_names(flavour, HEAD)
    orig = flavour != "fsdp1_full_flat"
    for step in range(steps):
        x = batch(step)
        ref_first = _ref_step(ref, ref_opt, x, names, passes)
        block = (
            no_reshard_between_backwards(model, **options)
            if use_block
            else contextlib.nullcontext()
        )
        head = _named(model, HEAD)  # before the block, as a user collects them
        with block as b:
            out = model(x)
            if how == "inside":  # FSDP2 shows the unsharded (graph) parameters here
                head = _named(model, HEAD)
            loss = LOSSES[0](out)
            if how == "block":
                b.backward(loss, retain_graph=passes > 1, inputs=head)
            elif how == "edge":
                from torch.autograd.graph import get_gradient_edge

                loss.backward(retain_graph=passes > 1, inputs=[get_gradient_edge(p) for p in head])
            else:
                loss.backward(retain_graph=passes > 1, inputs=head)
            if use_block:
                assert b.backward_passes == 1, b.backward_passes
            if options.get("sync_grads", "every") == "every" and use_block:
                got = adapter.full_grads(model)
                named = {n: g for n, g in got.items() if n in names}
                assert_close_dicts(named, ref_first, f"step {step}: named grads after pass 1")
                if orig:
                    stray = [
                        clean_tensor_name(n)
                        for n, p in model.named_parameters()
                        if clean_tensor_name(n) not in names and p.grad is not None
                    ]
                    assert not stray, f"step {step}: pass 1 wrote .grad of {stray}"
            for i in range(1, passes):
                LOSSES[i](out).backward(retain_graph=i < passes - 1)
        if orig and passes == 1:
            stray = [
                clean_tensor_name(n)
                for n, p in model.named_parameters()
                if clean_tensor_name(n) not in names and p.grad is not None
            ]
            assert not stray, f"step {step}: .grad of {stray} is not None after the block"
        opt.step()
        opt.zero_grad()
        ref_params = {n: p.detach() for n, p in ref.named_parameters()}
        assert_close_dicts(adapter.full_params(model), ref_params, f"step {step}: params")


def _add(name, fn) -> None:
    registry.add(name, fn)


for _flavour in FLAVOURS:
    for _opt_name, _options in OPTIONS.items():
        if _flavour == "fsdp1_noshard_orig" and _opt_name not in ("keep_every", "keep_last"):
            continue  # NO_SHARD gathers nothing: the keep options are the same
        _add(
            f"inputs_head_then_all_{_flavour}_{_opt_name}",
            lambda f=_flavour, o=_options: _run(f, o),
        )
    for _opt_name in ("keep_every", "keep_last", "regather_every"):
        _add(
            f"inputs_only_pass_{_flavour}_{_opt_name}",
            lambda f=_flavour, o=OPTIONS[_opt_name]: _run(f, {**o, "backwards": None}, passes=1),
        )
    _add(f"block_backward_inputs_{_flavour}", lambda f=_flavour: _run(f, {}, how="block"))


_add("inputs_named_inside_block_fsdp2", lambda: _run("fsdp2", {}, how="inside"))
for _flavour in ("fsdp2", "fsdp1_full_orig"):
    _add(f"inputs_gradient_edge_{_flavour}", lambda f=_flavour: _run(f, {}, how="edge"))
    _add(
        f"inputs_gradient_edge_regather_{_flavour}",
        lambda f=_flavour: _run(f, dict(keep_unsharded=False), how="edge"),
    )


@registry.case()
def inputs_tied_weight_fsdp1_full_orig() -> None:
    """``out.weight`` is ``inp.weight`` (one parameter, two names): FSDP1 keeps a
    tied duplicate apart from its primary; naming it names the primary."""
    _run("fsdp1_full_orig", {}, tied=True)


@registry.case()
def inputs_tied_weight_fsdp2() -> None:
    _run("fsdp2", {}, tied=True)


@registry.case()
def inputs_without_library_fsdp2_is_wrong() -> None:
    """Plain FSDP2: ``inputs=`` the sharded parameters computes nothing."""
    _expect_wrong("fsdp2")


@registry.case()
def inputs_without_library_fsdp1_orig_is_wrong() -> None:
    _expect_wrong("fsdp1_full_orig")


def _expect_wrong(flavour: str) -> None:
    try:
        _run(flavour, {}, use_block=False, steps=1)
    except AssertionError as e:
        assert "params" in str(e), e
    else:
        raise AssertionError(f"plain {flavour} matched the reference: the case shows nothing")


def _refused(flavour: str, act, match: str) -> None:
    """``act(out, params)`` inside the block raises ``match`` before any gradient is
    written; the step then goes on with a full pass and matches the reference."""
    model, ref, opt, ref_opt = _setup(flavour)
    adapter = _adapter(flavour)
    for step in range(2):
        x = batch(step)
        out_ref = ref(x)
        LOSSES[1](out_ref).backward()
        grads = averaged_grads(ref)
        for name, param in ref.named_parameters():
            param.grad = grads[name]
        ref_opt.step()
        ref_opt.zero_grad()
        with no_reshard_between_backwards(model) as b:
            out = model(x)
            params = list(model.parameters())
            try:
                act(out, params)
            except RetainError as e:
                assert match in str(e), str(e)
            else:
                raise AssertionError(f"not refused: {match}")
            assert b.backward_passes == 0, "the refused pass ran"
            assert all(p.grad is None for p in model.parameters()), "a gradient was written"
            LOSSES[1](out).backward()
        opt.step()
        opt.zero_grad()
        ref_params = {n: p.detach() for n, p in ref.named_parameters()}
        assert_close_dicts(adapter.full_params(model), ref_params, f"step {step}: params")


def _grad_of_params(out, params) -> None:
    torch.autograd.grad(LOSSES[0](out), params, retain_graph=True, allow_unused=True)


def _grad_materialized(out, params) -> None:
    torch.autograd.grad(
        LOSSES[0](out), params, retain_graph=True, allow_unused=True, materialize_grads=True
    )


def _slice_input(out, params) -> None:
    big = max(params, key=lambda p: p.numel())
    local = big.to_local() if hasattr(big, "to_local") else big
    LOSSES[0](out).backward(retain_graph=True, inputs=[local[:1]])


for _flavour in ("fsdp2", "fsdp1_full_orig", "fsdp1_full_flat"):
    registry.add(
        f"autograd_grad_on_params_refused_{_flavour}",
        lambda f=_flavour: _refused(f, _grad_of_params, "torch.autograd.grad"),
    )
    registry.add(
        f"autograd_grad_materialized_refused_{_flavour}",
        lambda f=_flavour: _refused(f, _grad_materialized, "torch.autograd.grad"),
    )
for _flavour in ("fsdp2", "fsdp1_full_orig"):
    registry.add(
        f"slice_of_param_input_refused_{_flavour}",
        lambda f=_flavour: _refused(f, _slice_input, "shares storage"),
    )


@registry.case()
def autograd_grad_materialized_without_library_is_zero_fsdp2() -> None:
    """Plain FSDP2: zeros for parameters the loss depends on (what the block refuses)."""
    model = f2.wrap(make_net())
    out = model(batch(0))
    grads = torch.autograd.grad(
        LOSSES[0](out), list(model.parameters()), allow_unused=True, materialize_grads=True
    )
    total = sum(float(g.to_local().abs().sum()) if hasattr(g, "to_local") else 0.0 for g in grads)
    total = torch.tensor(total)
    dist.all_reduce(total)
    assert total.item() == 0.0, total


@registry.case()
def probe_pass_with_inputs_refused() -> None:
    model = f2.wrap(make_net())
    with no_reshard_between_backwards(model) as b:
        out = model(batch(0))
        try:
            b.backward(LOSSES[0](out), param_grads=False, retain_graph=True, inputs=[out])
        except ValueError as e:
            assert "takes no inputs" in str(e), e
        else:
            raise AssertionError("a probe pass took inputs")
        LOSSES[1](out).backward()


@registry.case()
def inputs_param_and_activation_fsdp2() -> None:
    """An activation next to a parameter in ``inputs``: both get their gradients."""
    model, ref, _, _ = _setup("fsdp2")
    x = batch(0)
    captured = {}
    model.blocks[2].register_forward_hook(lambda m, a, o: captured.setdefault("h", o))
    ref.blocks[2].register_forward_hook(lambda m, a, o: captured.setdefault("r", o))
    out_ref = ref(x)
    ref_head = [p for n, p in ref.named_parameters() if n in HEAD]
    captured["r"].retain_grad()
    LOSSES[0](out_ref).backward(inputs=ref_head + [captured["r"]])
    head = _named(model, HEAD)
    with no_reshard_between_backwards(model):
        out = model(x)
        h = captured["h"]
        h.retain_grad()
        LOSSES[0](out).backward(inputs=head + [h])
    torch.testing.assert_close(h.grad, captured["r"].grad, **TOL)
    named = {n: g for n, g in f2.ADAPTER.full_grads(model).items() if n in HEAD}
    assert_close_dicts(named, averaged_grads(ref), "head grads")


def _mixed_precision_case(flavour: str) -> None:
    """bf16 parameters (FSDP1 ``MixedPrecision``, FSDP2 ``MixedPrecisionPolicy``):
    FSDP1's forward makes a new ``AccumulateGrad`` node for the cast flat
    parameter, so naming the flat parameter alone would compute nothing. The
    named gradients equal the fp32 reference's within bf16 rounding."""
    net = make_net()
    ref = copy.deepcopy(net)
    if flavour == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        model = f2.wrap(net, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    else:
        from torch.distributed.fsdp import MixedPrecision

        model = f1.wrap(
            net, f1.FULL, use_orig_params=True,
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16),
        )
    adapter = _adapter(flavour)
    head = _named(model, HEAD)
    for step in range(2):
        x = batch(step)
        ref.zero_grad()
        LOSSES[0](ref(x)).backward(inputs=[p for n, p in ref.named_parameters() if n in HEAD])
        expected = averaged_grads(ref)
        for keep in (True, False):
            with no_reshard_between_backwards(model, keep_unsharded=keep) as b:
                out = model(x)
                LOSSES[0](out).backward(retain_graph=True, inputs=head)
                assert b.backward_passes == 1
                got = {n: g.float() for n, g in adapter.full_grads(model).items() if n in HEAD}
                for name in HEAD:
                    scale = float(expected[name].abs().max())
                    torch.testing.assert_close(
                        got[name], expected[name], rtol=2e-2, atol=2e-2 * scale,
                        msg=lambda m, n=name: f"step {step} keep={keep}: {n}: {m}",
                    )
                stray = [
                    clean_tensor_name(n)
                    for n, p in model.named_parameters()
                    if clean_tensor_name(n) not in HEAD and p.grad is not None
                ]
                assert not stray, f"pass 1 wrote .grad of {stray}"
                LOSSES[1](out).backward()
            model.zero_grad()


registry.add("inputs_bf16_params_fsdp1_full_orig", lambda: _mixed_precision_case("fsdp1_full_orig"))
registry.add("inputs_bf16_params_fsdp2", lambda: _mixed_precision_case("fsdp2"))
