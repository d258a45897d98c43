"""FSDP2 cases, run inside ranks by ``tests/fsdp2/test_fsdp2.py`` (CPU, gloo): ``fully_shard``,
and ``replicate_with_fsdp``'s ``replicate`` (DDP on FSDP2's machinery, an FSDP2 module to
the block)."""

from __future__ import annotations


from tests.support import any_start
from tests.support import fsdp2_utils as f2
from tests.support.case_parts import covering
from tests.support.harness import Registry
from tests.support.parity import Scenario, make_net, reference_copy, run_parity

registry = Registry()


def _parity_case(passes, zero_between, keep, sync, backwards, raf, tied):
    def run() -> None:
        model = make_net(tied=tied)
        ref = reference_copy(model)
        f2.wrap(model, reshard_after_forward=raf)
        options = dict(
            keep_unsharded=keep,
            sync_grads=sync,
            backwards=passes if backwards else None,
        )
        scenario = Scenario(
            passes=passes,
            zero_between=zero_between,
            options=options,
            check_between=sync == "every",
        )

        def expect(counts) -> None:
            ag = f2.expected_all_gathers(model, passes, keep, raf)
            rs = f2.expected_reduce_scatters(model, passes, sync)
            assert counts.all_gather == ag, f"all-gathers {counts.by_op}, expected {ag}"
            assert counts.reduce_scatter == rs, f"reduce-scatters {counts.by_op}, expected {rs}"

        run_parity(model, ref, scenario, f2.ADAPTER, expect)

    return run


# Every 3 of the 7 options meet in each combination of their values (16 of the 128).
for passes, zero_between, keep, sync, backwards, raf, tied in (tuple(row.values()) for row in covering(dict(
    passes=(2, 3), zero_between=(False, True), keep=(True, False), sync=("every", "last"),
    backwards=(False, True), raf=(True, False), tied=(False, True),
), strength=3)):
    name = (
        f"parity_p{passes}_{'zero' if zero_between else 'accum'}_"
        f"{'keep' if keep else 'regather'}_{sync}_"
        f"{'backwards' if backwards else 'nbackwards'}_"
        f"{'raf' if raf else 'noraf'}_{'tied' if tied else 'untied'}"
    )
    registry.add(name, _parity_case(passes, zero_between, keep, sync, backwards, raf, tied))


# replicate_with_fsdp: every unit replicated, its gradients all-reduced per unit when a
# pass reduces. Without the block these plain passes are right (FSDP2 all-reduces every
# pass) at one all-reduce per unit per pass; the passes it gets wrong are below. #
def _replicate_case(passes, keep, sync, backwards):
    def run() -> None:
        options = dict(keep_unsharded=keep, sync_grads=sync,
                       backwards=passes if backwards else None)
        for use_block in (True, False):
            model = make_net()
            ref = reference_copy(model)
            f2.wrap_replicate(model)
            scenario = Scenario(passes=passes, options=options, use_block=use_block,
                                check_between=sync == "every" or not use_block)

            def expect(counts, use_block=use_block) -> None:
                # Without the block every pass all-reduces, whatever sync_grads.
                reduced = passes if sync == "every" or not use_block else 1
                ar = f2.units(model) * reduced
                assert counts.all_reduce == ar, f"all-reduces {counts.by_op}, expected {ar}"

            run_parity(model, ref, scenario, f2.ADAPTER, expect)

    return run


for passes, keep, sync, backwards in (tuple(row.values()) for row in covering(dict(
    passes=(2, 3), keep=(True, False), sync=("every", "last"), backwards=(False, True),
), strength=2)):
    registry.add(
        f"replicate_with_fsdp_p{passes}_{'keep' if keep else 'regather'}_{sync}_"
        f"{'backwards' if backwards else 'nbackwards'}",
        _replicate_case(passes, keep, sync, backwards),
    )


@registry.case()
def replicate_with_fsdp_any_start_and_penalty() -> None:
    """replicate_with_fsdp, passes that start inside a unit (blocks[1].fc1), at a unit's
    inner output (blocks[0]) or reach the root only (inp), and an input-gradient penalty
    (create_graph=True in pass 1): without the block FSDP2's replicate raises (freed
    storage) or is wrong; in the block each matches the reference over 3 steps, one
    all-reduce per unit a pass reaches ("every") or per unit reached (``"last"``)."""
    for starts in (["out", "inner", "root_only"], ["unit_out", "root_only"]):
        outcome = any_start.plain_fails_or_is_wrong(f2.wrap_replicate, f2.ADAPTER, starts)
        assert outcome.startswith(("raised", "wrong")), outcome
    for i, starts in enumerate(any_start.START_SETS):
        sync = ("every", "last")[i % 2]

        def expect(model, counts, starts=starts, sync=sync) -> None:
            ar = any_start.reductions(starts, sync)
            assert counts.all_reduce == ar, f"{counts.by_op}, expected {ar} all-reduces"

        any_start.parity(f2.wrap_replicate, f2.ADAPTER, starts, dict(sync_grads=sync),
                         check_between=sync == "every", expect=expect)
    for sync in ("every", "last"):
        any_start.penalty_parity(f2.wrap_replicate, f2.ADAPTER, dict(sync_grads=sync))
