"""``reshard_to`` cases (FSDP2, CPU, gloo, 4 ranks, groups of 2), run inside ranks by
``tests/options/test_reshard_to.py``.

Each parity case trains an FSDP2 model and an unsharded reference (seed 42, inputs
``42 + rank + 1``, SGD with momentum) for ``STEPS`` steps of ``PASSES`` backward passes
over one forward through ``tests.support.parity.run_parity`` (losses, gradients after every pass
with ``sync_grads="every"`` and parameters within 1e-5), and counts FSDP2's all-gathers
by the size of their process group, per phase (the forward, each pass, the exit: none
there). Expected, per
step, from FSDP2's rules: the forward gathers every unit over all 4 ranks; pass 1
gathers each unit the budget does not keep ("loose") that FSDP2 resharded after
forward and the root is not, over 4 ranks (bool ``reshard_after_forward``) or inside
its group of 2 (``reshard_after_forward=2``); every later pass gathers each loose unit
once inside its group of 2 and nothing over all 4 ranks.
"""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch.distributed as dist

from fsdp_retain import no_reshard_between_backwards
from fsdp_retain._fsdp2._inspect import fsdp2_all_sharded, fsdp2_param_groups
from fsdp_retain._fsdp2._compat import param_groups
from tests.support import fsdp2_utils as f2
from tests.support.harness import Registry
from tests.support.parity import Scenario, batch, make_net, reference_copy, run_parity

registry = Registry()
WS = (4,)
GROUP = 2
PASSES = 3
STEPS = 3


def _expected(model, block, raf) -> Counter:
    """All-gathers per (phase, group size) in one step, from FSDP2's rules (see the
    module docstring)."""
    groups = fsdp2_param_groups(model)
    root = {id(g) for g in param_groups(model._get_fsdp_state())}
    loose = [g for g in groups if id(g) not in block._kept]
    first = sum(1 for g in loose if id(g) not in root)
    expected = Counter({("forward", 4): len(groups)})
    if first:
        expected["pass1", GROUP if raf == GROUP else 4] = first
    for i in range(2, PASSES + 1):
        if loose:
            expected[f"pass{i}", GROUP] = len(loose)
    return expected


def _check_between_passes(model, block) -> None:
    """Each loose unit holds 1/GROUP of its padded unsharded parameters (FSDP2's
    post-forward state), and the modules show the sharded parameters."""
    for group in fsdp2_param_groups(model):
        if id(group) in block._kept:
            continue
        assert group.is_sharded_post_forward, f"{group._module_fqn}: {group._sharded_state}"
        for fp in group.fsdp_params:
            held = fp._sharded_post_forward_param_data.numel()
            assert held * GROUP == fp.padded_sharded_param_size.numel() * 4, (held, fp._param_fqn)
            info = fp._module_info
            assert getattr(info.module, info.param_name) is fp.sharded_param, fp._param_fqn


def _owner_state(model) -> list:
    """What the block must leave as it found it, per group and parameter."""
    return [
        (g.post_forward_mesh_info, "reshard" in g.__dict__, str(g._sharded_state))
        + tuple((fp.post_forward_mesh_info, getattr(fp, "sharded_post_forward_size", None),
                 getattr(fp, "_sharded_post_forward_param_data", None) is None)
                for fp in g.fsdp_params)
        for g in fsdp2_param_groups(model)
    ]


def _budget(model) -> int:
    """Half the unsharded bytes of all units: keeps some, reshards the others."""
    return sum(fp._orig_size.numel() * fp.sharded_param.element_size()
               for g in fsdp2_param_groups(model) for fp in g.fsdp_params) // 2


def gathers_by_phase(counts) -> Counter:
    """All-gathers per (phase, process-group size), from ``run_parity``'s counts."""
    return Counter({(phase, ranks): n for (phase, kind, ranks), n in counts.by_group.items()
                    if kind == "all_gather" and n})


def _parity(keep, sync="every", raf=True, reshard_to=GROUP, backwards=False, probe=False,
            zero_between=False):
    def run() -> None:
        model = make_net(depth=3)
        ref = reference_copy(model)
        f2.wrap(model, reshard_after_forward=raf)
        options = dict(
            keep_unsharded=_budget(model) if keep == "budget" else keep,
            sync_grads=sync,
            backwards=PASSES if backwards else None,
        )
        if reshard_to is not None:
            options["reshard_to"] = reshard_to
        expected: list[Counter] = []  # read from the block between passes

        def between(model, block) -> None:
            _check_between_passes(model, block)
            expected.append(_expected(model, block, raf))

        def expect(counts) -> None:
            where = f"options={options} raf={raf} probe={probe}"
            assert fsdp2_all_sharded(model), f"{where}: a unit left unsharded after exit"
            want = expected[-1]
            if keep == "budget":
                assert 0 < want[f"pass{PASSES}", GROUP] < len(fsdp2_param_groups(model)), (
                    f"{where}: the budget keeps all or none")
            got = gathers_by_phase(counts)
            assert got == want, (
                f"{where}: all-gathers by (phase, group size) {dict(sorted(got.items()))}, "
                f"expected {dict(sorted(want.items()))}"
            )

        scenario = Scenario(passes=PASSES, steps=STEPS, options=options,
                            zero_between=zero_between, probe_first=probe, between=between,
                            check_between=sync == "every" and not probe)
        run_parity(model, ref, scenario, f2.ADAPTER, expect)

    return run


for _name, _case in {
    "regather_every": _parity(False),
    "regather_every_zero_between": _parity(False, zero_between=True),
    "regather_last": _parity(False, sync="last"),
    "regather_every_backwards": _parity(False, backwards=True),
    "budget_every": _parity("budget"),
    "budget_last": _parity("budget", sync="last"),
    "probe_regather": _parity(False, probe=True),
    "raf2_default": _parity(False, raf=GROUP, reshard_to=None),
    "raf2_budget_last": _parity("budget", sync="last", raf=GROUP, reshard_to=None),
    "raf2_reshard_to": _parity(False, raf=GROUP),
}.items():
    registry.add(_name, _case, world_sizes=WS)


@registry.case(world_sizes=WS)
def keep_all_is_unchanged() -> None:
    """``keep_unsharded=True``: nothing is resharded between passes; a warning says so."""
    _parity_keep = _parity(True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _parity_keep()
    assert any("has no effect with keep_unsharded=True" in str(w.message) for w in seen)


@registry.case(world_sizes=WS)
def exception_between_passes_restores() -> None:
    """An exception after pass 1 (units on their group mesh): the block leaves FSDP2 as it
    found it (no collectives), and the next step is right (parity, counts)."""
    for raf in (True, GROUP):
        model = f2.wrap(make_net(depth=2), reshard_after_forward=raf)
        model(batch(0)).sum().backward()  # lazy init; FSDP2's own state after a step
        model.zero_grad()
        before = _owner_state(model)
        with pytest.raises(KeyError, match="boom"):
            with no_reshard_between_backwards(model, keep_unsharded=False, reshard_to=GROUP):
                out = model(batch(0))
                out.pow(2).mean().backward(retain_graph=True)
                assert any(g.is_sharded_post_forward for g in fsdp2_param_groups(model))
                raise KeyError("boom")
        assert fsdp2_all_sharded(model)
        assert _owner_state(model) == before, "the block changed FSDP2's state"
        model.zero_grad()
    _parity(False)()


@registry.case(world_sizes=WS)
def refusals() -> None:
    """A bad group size: a ``ValueError`` that names the fix; the model is left as it
    was (FSDP1's refusals: ``tests/options/cases_reshard_to_fsdp1.py``)."""
    model = f2.wrap(make_net(depth=2))
    with pytest.raises(ValueError, match=r"reshard_to=3\): 3 does not divide the 4 ranks"):
        with no_reshard_between_backwards(model, keep_unsharded=False, reshard_to=3):
            model(batch(0)).sum().backward()
    assert fsdp2_all_sharded(model)
    for bad in (1, True, 2.0):
        with pytest.raises(ValueError, match="reshard_to must be an int >= 2"):
            no_reshard_between_backwards(model, reshard_to=bad).__enter__()
    # Still usable: a plain step after the refusals.
    model(batch(0)).sum().backward()
    assert fsdp2_all_sharded(model)
    dist.barrier()
