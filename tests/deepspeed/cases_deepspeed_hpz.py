"""DeepSpeed ZeRO-3 with ZeRO++'s hierarchical partitioning (hpZ,
``zero_hpz_partition_size=2`` on 4 ranks), run by ``tests/deepspeed/test_deepspeed.py``.

hpZ keeps a secondary copy of each parameter partitioned inside groups of N ranks,
released to after the forward, and backward all-gathers read it. The block re-gathers
between passes the same way (``keep_unsharded=False`` or a unit not kept): the cases
check parity with an unsharded reference over 3 steps for every ``keep_unsharded`` and
``sync_grads`` value, and count each pass's all-gathers by the size of their process
group: all inside the groups of 2, none over the 4 ranks (``count_collectives``).
"""

from __future__ import annotations

from collections import Counter

from fsdp_retain import no_reshard_between_backwards
from fsdp_retain._measure import count_collectives
from tests.deepspeed.cases_deepspeed_common import Scenario, ds_config, losses, make_engine, run_parity, tokens
from tests.support.harness import Registry

registry = Registry()
GROUP = 2


def _parity(**fields):
    return lambda: run_parity(Scenario(hpz=GROUP, **fields))


for _keep in (False, True):
    for _sync in ("every", "last"):
        registry.add(f"hpz_parity_keep{int(_keep)}_{_sync}",
                     _parity(keep=_keep, sync=_sync, passes=3), world_sizes=(4,))


def _gathers_by_group(keep: bool) -> None:
    engine, _ = make_engine(ds_config(zero_hpz_partition_size=GROUP))
    for step in range(3):
        with count_collectives(modules=False) as counts:
            with no_reshard_between_backwards(engine, keep_unsharded=keep):
                logits = engine(tokens(step)).logits
                first, second = losses(logits, 2)
                counts.mark("pass1")
                engine.backward(first, retain_graph=True)
                counts.mark("pass2")
                engine.backward(second)
                counts.mark("exit")
        engine.step()
        # The forward's all-gathers (one per module it fetches; over all 4 ranks after
        # an optimizer step, the secondary partition being stale then).
        forward = sum(counts.groups("all_gather", None).values())
        assert forward > 0, dict(counts.by_group)
        for phase in ("pass1", "pass2"):
            got = counts.groups("all_gather", phase)
            # Kept: nothing to gather. Re-gathered: what the forward gathered, from the
            # secondary partition, inside its group of 2 (none over all 4 ranks).
            want = Counter() if keep else Counter({GROUP: forward})
            assert got == want, (
                f"step {step} {phase}: all-gathers by group size {dict(got)}, expected "
                f"{dict(want)}"
            )
        assert not counts.groups("all_gather", "exit"), dict(counts.groups("all_gather", "exit"))


registry.add("hpz_regathers_inside_the_group", lambda: _gathers_by_group(False), world_sizes=(4,))
registry.add("hpz_keep_gathers_nothing_between_passes", lambda: _gathers_by_group(True),
             world_sizes=(4,))


def _plain_fails() -> None:
    """Without the block, hpZ does not help: pass 2 meets released parameters."""
    try:
        run_parity(Scenario(hpz=GROUP, use_block=False), check_counts=False)
    except RuntimeError as err:
        assert "size of tensor a (0)" in str(err), err
    else:
        raise AssertionError("two passes over one forward ran without the block")


registry.add("hpz_without_the_block_fails", _plain_fails, world_sizes=(4,))
