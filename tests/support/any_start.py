"""Backward passes that start anywhere in the forward, for both backends (in ranks).

A pass may start from a tensor computed inside an FSDP unit (the output of
``blocks[1].fc1``), from a non-root unit's output (``blocks[0]``), or from a
tensor that reaches only the root unit's own parameters (the output of
``inp``), not only from the root's outputs. Forward hooks capture those
tensors on the FSDP model and on its unsharded reference alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn as nn

from tests.support.parity import LOSSES, averaged_grads, batch, make_net, reference_copy, sgd

# Where a pass starts: a submodule path of ``tests.support.parity.Net`` (or the output).
STARTS = {
    "inner": "blocks.1.fc1",  # inside the unit blocks[1]
    "unit_out": "blocks.0",  # a non-root unit's output
    "root_only": "inp",  # reaches only the root unit's own parameters
    "out": "",
}
# The passes of one step, by start: inside a unit first; from the output then
# inside; ending with passes that never reach some units.
START_SETS = (["inner", "out"], ["out", "inner", "root_only"], ["unit_out", "root_only"])


def _aux(t: torch.Tensor) -> torch.Tensor:
    return torch.tanh(t).pow(2).mean()


class Captured:
    """Forward hooks that keep the latest output of each start module."""

    def __init__(self, net: nn.Module) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._hooks = []
        modules = dict(net.named_modules())
        for name, path in STARTS.items():
            if path:
                hook = modules[path].register_forward_hook(self._keep(name))
                self._hooks.append(hook)

    def _keep(self, name: str):
        def hook(module, args, output):
            self.tensors[name] = output

        return hook


def pass_losses(captured: Captured, out: torch.Tensor, starts: list[str]) -> list[Callable]:
    """One loss per pass; ``"out"`` is the usual loss on the model output."""
    losses = []
    for i, start in enumerate(starts):
        if start == "out":
            losses.append(lambda i=i: LOSSES[i % len(LOSSES)](out))
        else:
            losses.append(lambda s=start: _aux(captured.tensors[s]))
    return losses


# The units (root, blocks[i]) whose parameters a pass from each start reaches.
REACHED = {
    "inner": {"root", "b0", "b1"},
    "unit_out": {"root", "b0"},
    "root_only": {"root"},
    "out": {"root", "b0", "b1", "b2"},
}


def reductions(starts: list[str], sync_grads: str) -> int:
    """Gradient reductions per step: each pass reduces the units it reached
    ("every"), or each unit any pass reached is reduced once ("last")."""
    if sync_grads == "every":
        return sum(len(REACHED[s]) for s in starts)
    return len(set().union(*(REACHED[s] for s in starts)))


def step(model, captured, opt, x, starts, block, read_grads, counts=None) -> list[dict]:
    """One forward, one backward per start; the gradients after each pass."""
    grads = []
    excluded = counts.excluded if counts is not None else contextlib.nullcontext
    with block:
        out = model(x)
        for i, loss in enumerate(pass_losses(captured, out, starts)):
            loss().backward(retain_graph=i < len(starts) - 1)
            with excluded():
                grads.append(read_grads(model))
    with excluded():
        grads[-1] = read_grads(model)  # after the block: what the optimizer sees
    if read_grads is averaged_grads:  # the reference steps on what FSDP reduces
        for name, param in model.named_parameters():
            param.grad = grads[-1].get(name)
    opt.step()
    opt.zero_grad()
    return grads


def parity(wrap, adapter, starts, options, *, steps=3, check_between=True, expect=None):
    """Trains a wrapped model and its reference ``steps`` steps; compares after each
    pass, and hands each step's collective counts to ``expect(model, counts)``."""
    from fsdp_retain import no_reshard_between_backwards
    from fsdp_retain._measure import count_collectives
    from tests.support.parity import assert_close_dicts

    net = make_net()
    ref = reference_copy(net)
    ref_captured, captured = Captured(ref), Captured(net)
    model = wrap(net)
    opt, ref_opt = sgd(model), sgd(ref)
    for s in range(steps):
        x = batch(s)
        ref_grads = step(
            ref, ref_captured, ref_opt, x, starts, contextlib.nullcontext(), averaged_grads
        )
        block = no_reshard_between_backwards(model, **options)
        with count_collectives() as counts:
            grads = step(model, captured, opt, x, starts, block, adapter.full_grads, counts)
        where = f"step {s} starts={starts} options={options}"
        pairs = list(zip(grads, ref_grads)) if check_between else [(grads[-1], ref_grads[-1])]
        for i, (a, b) in enumerate(pairs):
            a, b = _zero_filled(a, b), _zero_filled(b, a)
            assert_close_dicts(a, b, f"{where}: grads after pass {i + 1}")
        ref_params = {n: p.detach() for n, p in ref.named_parameters()}
        assert_close_dicts(adapter.full_params(model), ref_params, f"{where}: params")
        if expect is not None:
            expect(model, counts)
    return model


def _zero_filled(grads: dict, other: dict) -> dict:
    """A parameter the passes so far did not reach: no ``.grad`` on the reference,
    zeros in FSDP1's flat gradient."""
    return {**{n: torch.zeros_like(g) for n, g in other.items()}, **grads}


def plain_fails_or_is_wrong(wrap, adapter, starts) -> str:
    """The same step without the block: the error it raises, or how it is wrong
    (raises AssertionError if it is right)."""
    net = make_net()
    ref = reference_copy(net)
    ref_captured, captured = Captured(ref), Captured(net)
    model = wrap(net)
    x = batch(0)
    ref_grads = step(ref, ref_captured, sgd(ref), x, starts, contextlib.nullcontext(), averaged_grads)
    try:
        grads = step(model, captured, sgd(model), x, starts, contextlib.nullcontext(), adapter.full_grads)
    except (RuntimeError, ValueError, AssertionError) as exc:
        return f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    want, got = ref_grads[-1], grads[-1]
    if set(want) != set(got):
        return f"gradients missing for {sorted(set(want) ^ set(got))}"
    worst = max((got[n] - want[n]).abs().max().item() for n in want)
    assert worst > 1e-4, f"plain run matched the reference (max error {worst:.2e})"
    return f"wrong by up to {worst:.3g}"


def penalty_across_passes(model, x, block, passes: int = 3) -> None:
    """An input-gradient penalty built with ``create_graph=True`` in pass 1 and
    backpropagated in the last pass; plain losses on the output in between."""
    x = x.clone().requires_grad_()
    with block:
        out = model(x)
        (grad_x,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        for i in range(passes - 2):
            LOSSES[i](out).backward(retain_graph=True)
        (0.01 * grad_x.pow(2).sum()).backward()


def penalty_parity(wrap, adapter, options, *, passes: int = 3, steps: int = 3) -> nn.Module:
    """``penalty_across_passes`` in the block against the unsharded reference."""
    from tests.support.parity import assert_close_dicts
    from fsdp_retain import no_reshard_between_backwards

    net = make_net()
    ref = reference_copy(net)
    model = wrap(net)
    opt, ref_opt = sgd(model), sgd(ref)
    for s in range(steps):
        x = batch(s)
        penalty_across_passes(ref, x, contextlib.nullcontext(), passes)
        ref_grads = averaged_grads(ref)
        for name, param in ref.named_parameters():
            param.grad = ref_grads[name]
        penalty_across_passes(model, x, no_reshard_between_backwards(model, **options), passes)
        where = f"step {s} penalty passes={passes} options={options}"
        assert_close_dicts(adapter.full_grads(model), ref_grads, f"{where}: grads")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        ref_params = {n: p.detach() for n, p in ref.named_parameters()}
        assert_close_dicts(adapter.full_params(model), ref_params, f"{where}: params")
    return model
