"""FSDP2 cases, run inside ranks by ``tests/test_fsdp2.py`` (CPU, gloo)."""

from __future__ import annotations


from tests import fsdp2_utils as f2
from tests.case_parts import covering
from tests.harness import Registry
from tests.parity import Scenario, make_net, reference_copy, run_parity

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
