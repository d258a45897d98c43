"""Property-based parity with hypothesis (CPU, gloo, world size 2).

Random depth, width, which blocks are wrapped, a tied weight, number of passes,
before which passes ``zero_grad()`` runs, the block's options and the backend.
Every rank draws the same examples (``derandomize=True``); a failure names the
drawn configuration and hypothesis prints the falsifying example.
Run inside ranks by ``tests/test_property.py``.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import fsdp2_utils as f2
from tests.harness import Registry
from tests.parity import LOSSES, Scenario, make_net, reference_copy, run_parity

registry = Registry()
EXAMPLES = int(os.environ.get("FSDP_RETAIN_PROPERTY_EXAMPLES", "40"))


@st.composite
def configurations(draw):
    depth = draw(st.integers(1, 4))
    passes = draw(st.integers(1, len(LOSSES)))
    sync = draw(st.sampled_from(["every", "last"]))
    return dict(
        backend=draw(st.sampled_from(_backends())),
        depth=depth,
        dim=draw(st.sampled_from([5, 8, 12])),
        wrapped=sorted(draw(st.sets(st.integers(0, depth - 1)))),
        tied=draw(st.booleans()),
        raf=draw(st.booleans()),
        passes=passes,
        zero_before=tuple(sorted(draw(st.sets(st.integers(1, passes - 1))) if passes > 1 else ())),
        keep=draw(st.booleans()),
        sync=sync,
        backwards=draw(st.sampled_from([None, passes])),
    )


def _backends() -> list[str]:
    return ["fsdp2"]


def _check(config: dict) -> None:
    model = make_net(depth=config["depth"], tied=config["tied"], dim=config["dim"])
    ref = reference_copy(model)
    f2.wrap(model, reshard_after_forward=config["raf"], wrapped_blocks=config["wrapped"])
    scenario = Scenario(
        passes=config["passes"],
        zero_before=config["zero_before"],
        steps=2,
        dim=config["dim"],
        options=dict(
            keep_unsharded=config["keep"],
            sync_grads=config["sync"],
            backwards=config["backwards"],
        ),
        check_between=config["sync"] == "every",
    )

    def expect(counts) -> None:
        if config["keep"]:
            assert counts.all_gather == f2.units(model), (counts.by_op, config)
        rs = f2.units(model) * (config["passes"] if config["sync"] == "every" else 1)
        assert counts.reduce_scatter == rs, (counts.by_op, config)

    try:
        run_parity(model, ref, scenario, f2.ADAPTER, expect)
    except AssertionError as exc:
        raise AssertionError(f"configuration {config}: {exc}") from exc


@registry.case()
def property_parity() -> None:
    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )
    @given(configurations())
    def prop(config):
        _check(config)

    prop()
