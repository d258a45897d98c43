"""``keep_unsharded`` as a per-rank byte budget: the shared policy (no ranks), option
validation, and FSDP1/FSDP2 parity, kept units and all-gather counts on CPU/gloo at
world size 2 (tests/options/cases_budget.py)."""

import random

import pytest

from fsdp_retain._policy import RetainOptions, kept_units, regathers_saved
from tests.support.harness import case_tests

# (unit, unsharded bytes, freed after forward) in backward order: a root (embedding
# and output layer) twice a block's bytes, kept through pass 1 by FSDP itself.
UNITS = [("root", 100, False), ("b2", 50, True), ("b1", 50, True), ("b0", 50, True)]


@pytest.mark.parametrize(
    "budget, kept",
    [
        (True, {"root", "b2", "b1", "b0"}),
        (False, set()),
        (0, set()),
        (49, set()),
        (50, {"b2"}),  # a block avoids 2 all-gathers per step, the root 1: blocks first
        (99, {"b2"}),
        (100, {"b2", "b1"}),  # not the root, which would save 1 all-gather for these bytes
        (150, {"b2", "b1", "b0"}),
        (249, {"b2", "b1", "b0"}),
        (250, {"root", "b2", "b1", "b0"}),
        (10**12, {"root", "b2", "b1", "b0"}),
    ],
)
def test_kept_units_keeps_the_most_all_gathers_saved_per_byte(budget, kept):
    assert kept_units(UNITS, budget) == kept


def test_kept_units_keeps_units_that_free_nothing():
    units = [("root", 0, False), ("b1", 10, True), ("b0", 0, True)]
    assert kept_units(units, 5) == {"root", "b0"}


def _saved(units, budget, passes):
    return sum(regathers_saved(frees, passes)
               for unit, _, frees in units if unit in kept_units(units, budget, passes))


@pytest.mark.parametrize("seed", range(40))
def test_kept_units_never_save_less_with_a_larger_budget(seed):
    """All-gathers avoided never fall as the budget grows (each size a step), on random
    unit sizes, roots and pass counts; the committed report's keep75 once kept the root
    and one layer and made more all-gathers than keep50 (all four layers)."""
    rng = random.Random(seed)
    passes = rng.choice([2, 3, 4])
    units = [(i, rng.randint(1, 40), i > 0 or rng.random() < 0.5)
             for i in range(rng.randint(2, 7))]
    saved = [_saved(units, budget, passes) for budget in range(sum(n for _, n, _ in units) + 1)]
    assert saved == sorted(saved), (units, passes, saved)


@pytest.mark.parametrize("bad, error", [(-1, ValueError), (1.5, TypeError), ("1GiB", TypeError)])
def test_bad_budget_names_the_fix(bad, error):
    with pytest.raises(error, match="keep_unsharded"):
        RetainOptions(keep_unsharded=bad)


case_tests(globals(), "tests.options.cases_budget", {"test_budget": (2, 900)})


def test_report_budget_modes_pass_a_byte_budget():
    from fsdp_retain.report._modes import Mode

    options = Mode.parse("keep50:last").block_options(unsharded_bytes=1000)
    assert options["keep_unsharded"] == 500 and options["sync_grads"] == "last"
    with pytest.raises(AssertionError):
        Mode.parse("keep25").block_options()


def test_report_gpu_memory_sizes():
    from fsdp_retain.report._fit import parse_bytes

    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("141 GiB") == 141 * 2**30
    assert parse_bytes("80e9") == 80 * 10**9
    with pytest.raises(ValueError, match="80GiB"):
        parse_bytes("lots")


def test_report_budget_fit_picks_the_largest_mode_that_fits():
    from fsdp_retain.report._fit import all_gathers, render_budget_fit

    units = [400, 100, 100, 100]  # root, then layers last to first
    # kept: nothing -> 4 + 3 + 4; the three layers (the root saves one all-gather for
    # 400 bytes, a layer two for 100) -> 4 + 0 + 1; all -> 4.
    assert all_gathers(units, 0, True) == 11
    assert all_gathers(units, 400, True) == 5
    assert all_gathers(units, 700, True) == 4
    gib = 2**30
    rows = [
        dict(backend="fsdp2", label=label, ok=True, peak_bytes=peak * gib)
        for label, peak in [("two_forward", 50), ("regather:every", 49),
                            ("keep25:every", 60), ("keep75:every", 75), ("keep:every", 90)]
    ]
    config = dict(unit_bytes=units, model="m", dtype="bf16", batch_per_rank=2,
                  seq_len=2048, world_size=8, simulated=True)
    table = render_budget_fit({"config": config, "rows": rows}, 80 * gib)
    line = next(line for line in table.splitlines() if line.startswith("| fsdp2"))
    assert "`keep75:every`" in line and "| 75.0 |" in line, line
    # 75% of 700 bytes = 525 keeps the three layers, not the root: 4 + 0 + (4 - 3).
    assert "| 3 of 4 |" in line and line.endswith("| 5 |"), line


def test_report_model_all_gathers_never_rise_with_the_budget():
    """On the committed report's model (a root of 60% of the bytes), the all-gathers per
    step from regather through every byte budget to keep never rise, in the formula and
    in the committed rows of each backend."""
    import json
    from pathlib import Path

    from fsdp_retain.report._fit import all_gathers

    report = json.loads((Path(__file__).resolve().parents[2] / "docs/report/report.json").read_text())
    units = report["config"]["unit_bytes"]
    total = sum(units)
    counts = [all_gathers(units, total * i // 100, True) for i in range(101)]
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1], counts
    for backend in report["config"]["backends"]:
        rows = {r["label"]: r for r in report["rows"] if r["backend"] == backend and r["ok"]}
        labels = ["regather:every", "keep25:every", "keep50:every", "keep75:every", "keep:every"]
        found = [rows[label]["all_gathers_per_step"] for label in labels if label in rows]
        assert len(found) == len(labels) and found == sorted(found, reverse=True), (
            backend, found)
