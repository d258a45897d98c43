"""``reshard_to`` (CPU/gloo, world size 4, groups of 2).

FSDP2 (tests/options/cases_reshard_to.py): parity with an unsharded reference over 3
SGD-momentum steps of 3 passes for ``keep_unsharded`` False and a byte budget,
``sync_grads`` "every" and "last", an announced ``backwards``, a probe pass, and models
built with ``reshard_after_forward=2`` (the default between passes, no option); FSDP2's
all-gathers counted per process-group size and phase (none over all ranks after pass 1,
one per resharded unit per later pass inside the group); a group size that does not
divide the mesh refused.

FSDP1 (tests/options/cases_reshard_to_fsdp1.py): HYBRID_SHARD (and _HYBRID_SHARD_ZERO2) on a
(2, 2) mesh with ``reshard_to=2``, the same parity for ``keep_unsharded`` False, True and
a budget with both ``sync_grads``, every all-gather inside the shard group of 2;
FULL_SHARD, and HYBRID_SHARD with ``reshard_to`` other than its shard group, refused.
"""

import pytest

from fsdp_retain._policy import RetainOptions
from tests.support.harness import case_tests

case_tests(globals(), "tests.options.cases_reshard_to", {"test_reshard_to": (4, 240)})
case_tests(globals(), "tests.options.cases_reshard_to_fsdp1", {"test_reshard_to_fsdp1": (4, 180)})


@pytest.mark.parametrize("bad", [0, 1, -2, True, 2.5, "8"])
def test_reshard_to_validated(bad):
    with pytest.raises(ValueError, match="reshard_to must be an int >= 2"):
        RetainOptions(keep_unsharded=False, reshard_to=bad)


def test_reshard_to_without_effect_warns():
    with pytest.warns(UserWarning, match="has no effect with keep_unsharded=True"):
        RetainOptions(reshard_to=8)
    RetainOptions(keep_unsharded=0, reshard_to=8)  # a budget: no warning


def test_policy_between_passes_ranks():
    from fsdp_retain._policy import Policy

    def ranks(reshard_to, built_with):
        options = RetainOptions(keep_unsharded=False, reshard_to=reshard_to)
        return Policy(options).between_passes_ranks(built_with)

    assert ranks(None, None) is None  # every rank of the mesh, as before
    assert ranks(None, 2) == 2  # reshard_after_forward=2: its groups by default
    assert ranks(8, None) == 8
    assert ranks(8, 2) == 8  # the option wins
    assert Policy.regroups(freeing=False) and not Policy.regroups(freeing=True)


@pytest.mark.parametrize("backend", ["FSDP1", "DeepSpeed ZeRO-3"])
def test_refusal_names_fsdp2(backend):
    from fsdp_retain._policy import reshard_to_refusal

    message = str(reshard_to_refusal(8, backend))
    assert "reshard_to=8) needs FSDP2 (fully_shard)" in message
    assert f"got a {backend} model" in message
    assert "fully_shard(...)" in message


def test_fsdp1_needs_hybrid_groups_of_reshard_to():
    """FSDP1: accepted where every unit is hybrid with a shard group of ``reshard_to``
    ranks; otherwise refused, naming the first unit that is not and the fix."""
    from fsdp_retain._policy import ShardGroup

    options = RetainOptions(keep_unsharded=False, reshard_to=8)
    hybrid = [ShardGroup("<root>", "HYBRID_SHARD", 8), ShardGroup("layers.0", "_HYBRID_SHARD_ZERO2", 8)]
    options.check_reshard_to("FSDP1", hybrid)
    RetainOptions(keep_unsharded=False).check_reshard_to("FSDP1", [ShardGroup("<root>", "FULL_SHARD", 4)])
    with pytest.raises(ValueError, match=r"unit 'layers.1' uses FULL_SHARD over 16 rank\(s\)\. "
                                         r".*ShardingStrategy\.HYBRID_SHARD and a device_mesh"):
        options.check_reshard_to("FSDP1", hybrid + [ShardGroup("layers.1", "FULL_SHARD", 16)])
    with pytest.raises(ValueError, match=r"uses HYBRID_SHARD over 4 rank\(s\).*pass reshard_to=4"):
        options.check_reshard_to("FSDP1", [ShardGroup("<root>", "HYBRID_SHARD", 4)])
    with pytest.raises(ValueError, match="got a DeepSpeed ZeRO-3 model"):
        options.check_reshard_to("DeepSpeed ZeRO-3")


def test_deepspeed_engine_refused(monkeypatch):
    """A ZeRO-3 engine (a stand-in class: DeepSpeed itself is not run here) is refused
    before the block touches it."""
    import sys
    import types

    from fsdp_retain import no_reshard_between_backwards

    engine_module = types.ModuleType("deepspeed.runtime.engine")
    engine_module.DeepSpeedEngine = type(  # type: ignore[attr-defined]
        "DeepSpeedEngine", (), {"zero_optimization_stage": lambda self: 3})
    monkeypatch.setitem(sys.modules, "deepspeed", types.ModuleType("deepspeed"))
    monkeypatch.setitem(sys.modules, "deepspeed.runtime.engine", engine_module)
    with pytest.raises(ValueError, match="got a DeepSpeed ZeRO-3 model.*zero_hpz_partition_size"):
        with no_reshard_between_backwards(engine_module.DeepSpeedEngine(), keep_unsharded=False,
                                          reshard_to=8):
            pass
