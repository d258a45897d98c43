"""Property-based parity with hypothesis (CPU, gloo, world size 2).

Random depth, width, which blocks are wrapped, a tied weight, number of passes,
before which passes ``zero_grad()`` runs, the block's options and the backend
(FSDP2, or FSDP1 FULL_SHARD / SHARD_GRAD_OP / NO_SHARD, flat or original params).
Every rank draws the same examples (``derandomize=True``); a failure names the
drawn configuration and hypothesis prints the falsifying example.
Run inside ranks by ``tests/api/test_property.py``.
"""

from __future__ import annotations

import functools
import os

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

from tests.support import fsdp1_utils as f1
from tests.support import fsdp2_utils as f2
from tests.support.harness import Registry
from tests.support.parity import LOSSES, Scenario, make_net, reference_copy, run_parity

registry = Registry()
EXAMPLES = int(os.environ.get("FSDP_RETAIN_PROPERTY_EXAMPLES", "60"))


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
    return ["fsdp2", "fsdp1_full", "fsdp1_gradop", "fsdp1_noshard", "fsdp1_full_orig"]


def _wrap(model, config):
    """Wraps the drawn blocks and the root; returns (adapter, units, counts check)."""
    backend = config["backend"]
    if backend == "fsdp2":
        f2.wrap(model, reshard_after_forward=config["raf"], wrapped_blocks=config["wrapped"])
        return model, f2.ADAPTER, f2.units(model), True
    strategy = {
        "full": f1.FULL, "gradop": f1.GRAD_OP, "noshard": f1.NO_SHARD
    }[backend.split("_")[1]]
    chosen = {model.blocks[i] for i in config["wrapped"]}
    policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: m in chosen)
    wrapped = FSDP(
        model,
        auto_wrap_policy=policy,
        sharding_strategy=strategy,
        use_orig_params=backend.endswith("_orig"),
        device_id=torch.device("cpu"),
    )
    units = f1.units(wrapped)
    sharded = strategy != f1.NO_SHARD
    return wrapped, f1.ADAPTER, units, sharded


def _check(config: dict) -> None:
    model = make_net(depth=config["depth"], tied=config["tied"], dim=config["dim"])
    ref = reference_copy(model)
    model, adapter, units, sharded = _wrap(model, config)
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
        reductions = units * (config["passes"] if config["sync"] == "every" else 1)
        if sharded:
            if config["keep"]:
                assert counts.all_gather == units, (counts.by_op, config)
            assert counts.reduce_scatter == reductions, (counts.by_op, config)
        else:
            assert counts.all_gather == counts.reduce_scatter == 0, (counts.by_op, config)
            assert counts.all_reduce == reductions, (counts.by_op, config)

    try:
        run_parity(model, ref, scenario, adapter, expect)
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
        seen.add(config["backend"])
        _check(config)

    seen: set[str] = set()
    prop()
    assert seen == set(_backends()), f"examples did not cover every backend: {seen}"
