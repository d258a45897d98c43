"""What a probe pass leaves ``model.parameters()`` showing, FSDP2 (part of
``tests/options/cases_probe.py``; CPU, gloo, world size 2, and 4 for ``reshard_to``).

FSDP2 registers on its modules a unit's unsharded parameters while the unit is
unsharded (after its forward; after a backward that did not reshard), the sharded ones
otherwise, and after the forward of a model built with ``reshard_after_forward=<int>``
the post-forward shards; the block shows the sharded ones between passes. Under
``set_requires_gradient_sync(False)`` the unsharded parameters' ``.grad`` holds what the
earlier micro-batches accumulated. A probe pass changes no gradient, so it leaves the
registered parameters as it found them (issue 62: a probe pass that ran first ended with
the sharded parameters shown, and ``.grad`` read through ``model.parameters()`` was
``None``).

Each case runs 2 SGD-momentum steps of 3 micro-batches, two under
``set_requires_gradient_sync(False)`` and a syncing one (``PATTERNS``: a probe pass
last; first and between; first in the syncing micro-batch), with FSDP2's default
reshard flags or its accumulation recipe (``set_reshard_after_backward(False)`` until
the syncing micro-batch). It checks:

- after each probe pass, every parameter ``model.parameters()`` gives is the same
  tensor (unsharded, sharded or post-forward shard) with the same ``.grad`` as before
  it, except in a unit the budget does not keep, which the pass frees as every pass
  does: the unit then shows its sharded parameters, and the block warns where they
  had a gradient before (and only there);
- in the no-sync micro-batches, every unsharded parameter shown holds the gradient the
  unsharded reference accumulated on this rank;
- after the forward, after each normal pass and after the block, what
  ``model.parameters()`` shows equals a run without the probe passes (with ``backwards``
  announced, which the probe passes change: after the forward and the block only);
- at the end of each window, ``.grad`` read through ``model.parameters()`` equals the
  reference's, averaged over ranks; the parameters after every step too.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn as nn

from fsdp_retain import no_reshard_between_backwards
from fsdp_retain._fsdp2._inspect import fsdp2_param_groups
from tests.support import fsdp2_utils as f2
from tests.support.case_parts import covering
from tests.support.harness import Registry
from tests.support.parity import (
    LOSSES,
    TOL,
    assert_close_dicts,
    averaged_grads,
    batch,
    make_net,
    reference_copy,
    sgd,
)

registry = Registry()

STEPS = 2
PATTERNS = ("np", "pnp", "pn")  # per micro-batch (p: probe pass, n: normal pass); the last syncs
FREED = "freed the unsharded parameters"
# Which tensor of its FSDPParam a module shows.
_KINDS = (("sharded", "sharded_param"), ("unsharded", "_unsharded_param"),
          ("post_forward", "_sharded_post_forward_param"))

Shown = dict[str, tuple[str, Any]]  # name -> (kind, local .grad or None)


def shown(model: nn.Module) -> Shown:
    """Per parameter ``model.parameters()`` gives: which of FSDP2's tensors it is, and
    its ``.grad`` (the local tensor, cloned)."""
    kinds = {}
    for group in fsdp2_param_groups(model):
        for fsdp_param in group.fsdp_params:
            for kind, attr in _KINDS:
                tensor = getattr(fsdp_param, attr, None)
                if tensor is not None:
                    kinds[id(tensor)] = kind
    found = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is not None:
            grad = getattr(grad, "_local_tensor", grad).detach().clone()
        found[name] = (kinds.get(id(param), "unknown"), grad)
    return found


def _unit(name: str) -> str:
    return ".".join(name.split(".")[:2]) if name.startswith("blocks.") else "root"


def _group(model: nn.Module, unit: str) -> Any:
    module = model if unit == "root" else model.get_submodule(unit)
    return fsdp2_param_groups(module)[0]


def _same_grad(grad: Any, want: Any) -> bool:
    if grad is None or want is None:
        return grad is None and want is None
    return grad.shape == want.shape and torch.allclose(grad, want, **TOL)


def _grad_text(grad: Any) -> str:
    return "None" if grad is None else f"a {tuple(grad.shape)} tensor"


def differences(got: Shown, want: Shown, names: Any = None) -> list[str]:
    """What ``got`` shows otherwise than ``want`` (for ``names``, else every name)."""
    found = []
    for name in sorted(want if names is None else names):
        (kind, grad), (want_kind, want_grad) = got[name], want[name]
        if kind != want_kind:
            found.append(f"{name}: shows the {kind} parameter, expected the {want_kind} one")
        elif not _same_grad(grad, want_grad):
            found.append(f"{name} ({kind}): .grad {_grad_text(grad)}, expected "
                         f"{_grad_text(want_grad)}")
    return found


def check_probe(model: nn.Module, before: Shown, after: Shown, caught: list,
                keep: Any, where: str) -> None:
    """A probe pass left each unit as it found it, or freed a unit the budget does not
    keep (which then shows its sharded parameters) and warned if they had a gradient."""
    units: dict[str, list[str]] = {}
    for name in before:
        units.setdefault(_unit(name), []).append(name)
    lost_grads = False
    for unit, names in units.items():
        diffs = differences(after, before, names)
        if not diffs:
            continue
        freed = (
            keep is not True
            and not _group(model, unit).is_unsharded
            and all(before[n][0] == "unsharded" and after[n][0] == "sharded" for n in names)
        )
        assert freed, f"{where}: {unit} shows other parameters than before: {diffs}"
        lost_grads = lost_grads or any(before[n][1] is not None for n in names)
    warned = [str(w.message) for w in caught if FREED in str(w.message)]
    assert bool(warned) == lost_grads, (
        f"{where}: warnings {warned}; a freed unit showed a gradient: {lost_grads}")


def check_accumulated(seen: Shown, ref: nn.Module, where: str) -> None:
    """Each unsharded parameter shown holds what the reference accumulated on this rank."""
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    diffs = differences(seen, {n: (kind, ref_grads[n]) for n, (kind, _) in seen.items()},
                        [n for n, (kind, _) in seen.items() if kind == "unsharded"])
    assert not diffs, f"{where}: unsharded .grad is not the accumulated gradient: {diffs}"


def probed_micro_batch(model, ref, x, pattern, options, synced, keep, where) -> list[Shown]:
    """One micro-batch with its probe passes, the reference in step; what the model
    shows after the forward, each normal pass and the block."""
    points = []
    ref_out = ref(x)
    with no_reshard_between_backwards(model, **options) as block:
        out = model(x)
        points.append(shown(model))
        if not synced:
            check_accumulated(points[0], ref, f"{where} after the forward")
        for i, kind in enumerate(pattern):
            loss, retain = LOSSES[i % len(LOSSES)], i < len(pattern) - 1
            before = shown(model)
            if kind == "n":
                loss(ref_out).backward(retain_graph=True)
                block.backward(loss(out), retain_graph=retain)
                points.append(shown(model))
            else:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    block.backward(loss(out), param_grads=False, retain_graph=retain)
                check_probe(model, before, shown(model), caught, keep,
                            f"{where} pass {i + 1} (probe)")
            if not synced:
                check_accumulated(shown(model), ref, f"{where} after pass {i + 1}")
    points.append(shown(model))
    if not synced:
        check_accumulated(points[-1], ref, f"{where} after the block")
    return points


def plain_micro_batch(model, x, pattern, options) -> list[Shown]:
    """The same micro-batch without its probe passes."""
    points = []
    with no_reshard_between_backwards(model, **options):
        out = model(x)
        points.append(shown(model))
        for i, kind in enumerate(pattern):
            if kind == "n":
                LOSSES[i % len(LOSSES)](out).backward(retain_graph=i < len(pattern) - 1)
                points.append(shown(model))
    points.append(shown(model))
    return points


def _budget(model: nn.Module) -> int:
    """The root and one block (units' unsharded bytes): the rest is freed."""
    units = [model.inp, model.out, model.blocks[0]]
    return sum(p.numel() * p.element_size() for m in units for p in m.parameters())


def _set_flags(model: nn.Module, synced: bool, accumulate: bool) -> None:
    model.set_requires_gradient_sync(synced)
    if accumulate:  # FSDP2's recipe: stay gathered until the syncing micro-batch
        model.set_reshard_after_backward(synced)


def run_shown(raf: bool | int, accumulate: bool, keep: Any, sync: str, backwards: bool,
              reshard_to: int | None = None) -> None:
    model = make_net()
    ref = reference_copy(model)
    options = dict(keep_unsharded=_budget(model) if keep == "budget" else keep,
                   sync_grads=sync)
    if reshard_to is not None:
        options["reshard_to"] = reshard_to
    f2.wrap(model, reshard_after_forward=raf)
    plain = f2.wrap(make_net(), reshard_after_forward=raf)
    opts = [sgd(model), sgd(plain), sgd(ref)]
    for step in range(STEPS):
        for micro, pattern in enumerate(PATTERNS):
            synced = micro == len(PATTERNS) - 1
            where = (f"raf={raf} accumulate={accumulate} keep={keep} sync={sync} "
                     f"backwards={backwards} reshard_to={reshard_to} step {step} "
                     f"micro-batch {micro} ({pattern})")
            x = batch(10 * step + micro)
            _set_flags(model, synced, accumulate)
            _set_flags(plain, synced, accumulate)
            got = probed_micro_batch(
                model, ref, x, pattern,
                dict(options, backwards=len(pattern) if backwards else None), synced, keep, where)
            want = plain_micro_batch(
                plain, x, pattern,
                dict(options, backwards=pattern.count("n") if backwards else None))
            if backwards:  # the probe passes change which pass is the last
                got, want = [got[0], got[-1]], [want[0], want[-1]]
            for i, (one, other) in enumerate(zip(got, want)):
                diffs = differences(one, other)
                assert not diffs, f"{where}: point {i}, not what it shows without probes: {diffs}"
        ref_grads = averaged_grads(ref)
        for name, param in ref.named_parameters():
            param.grad = ref_grads[name]
        assert_close_dicts(f2.full_grads(model), ref_grads, f"{where}: window grads")
        for opt in opts:
            opt.step()
            opt.zero_grad()
        ref_params = {n: p.detach() for n, p in ref.named_parameters()}
        assert_close_dicts(f2.full_params(model), ref_params, f"{where}: params")
    model.set_requires_gradient_sync(True)


def _name(raf, accumulate, keep, sync, backwards) -> str:
    keep_name = {True: "keep", False: "regather", "budget": "budget"}[keep]
    return (f"probe_shows_fsdp2_{'raf' if raf else 'noraf'}_"
            f"{'accumulate' if accumulate else 'defaults'}_{keep_name}_{sync}_"
            f"{'backwards' if backwards else 'nbackwards'}")


# Every 2 of the factors meet in each combination of their values.
for _row in covering(dict(
    raf=(True, False), accumulate=(False, True), keep=(True, "budget", False),
    sync=("every", "last"), backwards=(False, True),
), strength=2):
    registry.add(_name(**_row), lambda row=_row: run_shown(**row))

# reshard_to: units not kept are resharded to groups of 2 of the 4 ranks between passes;
# a model built with reshard_after_forward=2 shows the post-forward shards after forward.
registry.add("probe_shows_fsdp2_reshard_to_budget",
             lambda: run_shown(True, False, "budget", "every", False, reshard_to=2),
             world_sizes=(4,))
registry.add("probe_shows_fsdp2_raf2_regather_accumulate",
             lambda: run_shown(2, True, False, "last", False), world_sizes=(4,))
