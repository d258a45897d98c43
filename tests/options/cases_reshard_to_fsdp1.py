"""``reshard_to`` on FSDP1 (CPU, gloo, 4 ranks), run inside ranks by
``tests/options/test_reshard_to.py``: ``HYBRID_SHARD`` (and ``_HYBRID_SHARD_ZERO2``) on a
(replicate 2, shard 2) mesh with ``reshard_to=2``, and the refusals.

FSDP1 shards a hybrid unit inside its shard group of 2 ranks, so its re-gathers
between passes already stay inside that group: the block runs as without the option.
Each parity case trains the model and an unsharded reference through
``tests.support.parity.run_parity`` for ``STEPS`` SGD-momentum steps of ``PASSES`` passes
(losses, gradients after every pass with ``sync_grads="every"``, parameters within 1e-5)
and counts the collectives by phase and process-group size. Expected per step, with
``n`` units of which the block keeps ``k``: the forward all-gathers every unit inside
its group of 2 (``n``); pass 1 re-gathers the units FSDP1 freed after forward that are
not kept (``HYBRID_SHARD``: all but the root; ``_HYBRID_SHARD_ZERO2``: none); every
later pass re-gathers each unit not kept (``n - k``), inside its group of 2; nothing
all-gathers over all 4 ranks. Reductions: one reduce-scatter (shard group) and one
all-reduce (across the 2 replicas) per unit per pass (``"every"``) or per unit
(``"last"``). Between passes exactly the kept units hold unsharded storage.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch.distributed as dist

from fsdp_retain import no_reshard_between_backwards
from fsdp_retain._fsdp1._inspect import fsdp1_handles
from tests.support import fsdp1_utils as f1
from tests.options.cases_reshard_to import gathers_by_phase
from tests.support.fsdp1_checks import assert_restored
from tests.support.harness import Registry
from tests.support.parity import LOSSES, Scenario, batch, make_net, reference_copy, run_parity

registry = Registry()
WS = (4,)
GROUP = 2  # f1.wrap's shard dimension
PASSES = 3
STEPS = 3
_FREES_AFTER_FORWARD = {f1.HYBRID: True, f1.HYBRID_ZERO2: False}


def _budget(model) -> int:
    """Half the unsharded bytes of all units (before the first forward each flat
    parameter holds its padded shard): keeps some, re-gathers the others."""
    return sum(h.flat_param.numel() * GROUP * h.flat_param.element_size()
               for h in fsdp1_handles(model)) // 2


def _expected(model, block, frees_after_forward: bool) -> Counter:
    """All-gathers per (phase, group size) in one step (see the module docstring)."""
    units = block._units
    loose = [u for u in units if not u.kept]
    expected = Counter({("forward", GROUP): len(units)})
    first = sum(1 for u in loose if u.state is not model) if frees_after_forward else 0
    if first:
        expected["pass1", GROUP] = first
    for i in range(2, PASSES + 1):
        if loose:
            expected[f"pass{i}", GROUP] = len(loose)
    return expected


def _check_between_passes(block) -> None:
    """Exactly the kept units hold their unsharded flat parameter."""
    for unit in block._units:
        held = unit.flat_param._full_param_padded.untyped_storage().size() > 0
        assert held == unit.kept, f"{unit.name}: unsharded {held}, kept {unit.kept}"


def _parity(strategy, keep, sync):
    def run() -> None:
        model = make_net(depth=3)
        ref = reference_copy(model)
        model = f1.wrap(model, strategy)
        options = dict(keep_unsharded=_budget(model) if keep == "budget" else keep,
                       sync_grads=sync, reshard_to=GROUP)
        expected: list[Counter] = []  # read from the block between passes

        def between(model, block) -> None:
            _check_between_passes(block)
            expected.append(_expected(model, block, _FREES_AFTER_FORWARD[strategy]))

        def expect(counts) -> None:
            where = f"{strategy.name} options={options}"
            want, units = expected[-1], f1.units(model)
            if keep == "budget":
                assert 0 < units - want[f"pass{PASSES}", GROUP] < units, (
                    f"{where}: the budget keeps all or none")
            got = gathers_by_phase(counts)
            assert got == want, (
                f"{where}: all-gathers by (phase, group size) {dict(sorted(got.items()))}, "
                f"expected {dict(sorted(want.items()))}"
            )
            reductions = units * (PASSES if sync == "every" else 1)
            for kind in ("reduce_scatter", "all_reduce"):
                assert counts.groups(kind) == Counter({GROUP: reductions}), (
                    f"{where}: {kind} by group size {dict(counts.groups(kind))}, "
                    f"expected {reductions} over {GROUP} ranks")

        scenario = Scenario(passes=PASSES, steps=STEPS, options=options, between=between,
                            check_between=sync == "every")
        run_parity(model, ref, scenario, f1.ADAPTER, expect)
        assert_restored(model)

    return run


for _keep, _sync in itertools.product((False, True, "budget"), ("every", "last")):
    _label = {False: "regather", True: "keep"}.get(_keep, _keep)
    registry.add(f"hybrid_{_label}_{_sync}", _parity(f1.HYBRID, _keep, _sync), world_sizes=WS)
registry.add("hybrid_zero2_budget_every", _parity(f1.HYBRID_ZERO2, "budget", "every"),
             world_sizes=WS)


@registry.case(world_sizes=WS)
def refusals() -> None:
    """FULL_SHARD with ``reshard_to=2``, and HYBRID_SHARD (shard groups of 2) with
    ``reshard_to=4``: a ``ValueError`` that names the strategy, the group size and the
    fix, before the block touches the model (a plain step after it is FSDP1's own)."""
    full = f1.wrap(make_net(depth=2))
    hybrid = f1.wrap(make_net(depth=2), f1.HYBRID)
    for model, reshard_to, message in (
        (full, 2, r"whose unit '<root>' uses FULL_SHARD over 4 rank\(s\)\. .*"
                  r"sharding_strategy=ShardingStrategy\.HYBRID_SHARD and a device_mesh whose "
                  r"shard dimension has 2 ranks"),
        (hybrid, 4, r"whose unit '<root>' uses HYBRID_SHARD over 2 rank\(s\)\. .*"
                    r"shard group, here of 2 ranks: pass reshard_to=2"),
    ):
        fsdp2 = (rf"reshard_to={reshard_to}\) needs FSDP2 \(fully_shard\) or FSDP1 "
                 rf"HYBRID_SHARD over shard groups of {reshard_to} ranks, got a FSDP1 model ")
        with pytest.raises(ValueError, match=fsdp2 + message):
            with no_reshard_between_backwards(model, keep_unsharded=False,
                                              reshard_to=reshard_to):
                pass
        out = model(batch(0))
        LOSSES[0](out).backward()
        model.zero_grad()
        assert_restored(model)
    dist.barrier()
