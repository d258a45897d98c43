"""examples/influence_bergson.py, FSDP2 and FSDP1, 2 CPU ranks: bergson's collector as a
probe pass plus the policy loss over one forward == bergson run the two-forward way.

Skipped when bergson is not installed; CI runs it in its own venv
(scripts/bergson_ci.sh), as the DeepSpeed cases run.
"""

import re

import pytest

from tests.support.installed import skip_unless_installed

skip_unless_installed("bergson", reason="bergson not installed (see docs/integrations/bergson.md)")
skip_unless_installed("transformers", reason="the bergson example uses a tiny transformers Qwen2")

from tests.docs.test_examples import _blocks, _check_ok, _number  # noqa: E402
from tests.support.examples import ExampleRun, batched, session_batch  # noqa: E402

STEPS = 8


def _bergson(fsdp):
    """The run (the session's batch runs it, tests/support/examples.py)."""
    return ExampleRun("influence_bergson.py", ("--fsdp", str(fsdp), "--steps", str(STEPS)))


@pytest.mark.parametrize("fsdp", [2, 1])
@batched(_bergson)
def test_influence_bergson(fsdp):
    """influence_bergson.py --fsdp {2,1} (3 layers + root), 2 CPU ranks, 8 steps."""
    steps, units = STEPS, 3 + 1
    out = _check_ok(session_batch().result(_bergson(fsdp)))
    assert f"FSDP{fsdp}, 2 ranks, cpu" in out
    # 7 Linear modules per decoder layer; FSDP1 puts its wrapper in the names.
    prefix = "layers.0." + ("_fsdp_wrapped_module." if fsdp == 1 else "")
    assert f"bergson: 21 modules, 8x8 projection each, first '{prefix}mlp.down_proj'" in out
    assert _number(r"projections: max relative difference block vs two-forward (\S+)", out) <= 1e-4
    diff = _number(r"max \|difference\| (\S+)", out)
    update = _number(r"largest update (\S+)\)", out)
    assert update > 0 and diff <= 1e-4 * update
    assert re.search(r"median step: two-forward \S+ ms, block \S+ ms", out)
    # keep_unsharded=True: one all-gather per unit; the probe pass reduces nothing,
    # the policy-loss pass reduce-scatters once per unit.
    expected = {"passes": 2, "all_gather": units, "reduce_scatter": units, "all_reduce": 0}
    assert _blocks(out) == [expected] * steps
