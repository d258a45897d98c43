"""``keep_unsharded`` as a per-rank byte budget: the shared policy (no ranks), option
validation, and FSDP1/FSDP2 parity, kept units and all-gather counts on CPU/gloo at
world size 2 (tests/cases_budget.py)."""

import pytest

from fsdp_retain._policy import RetainOptions, kept_units
from tests.harness import case_tests

UNITS = [("root", 100), ("b2", 50), ("b1", 50), ("b0", 50)]


@pytest.mark.parametrize(
    "budget, kept",
    [
        (True, {"root", "b2", "b1", "b0"}),
        (False, set()),
        (0, set()),
        (49, set()),
        (99, {"b2"}),  # the root does not fit: skipped, the next unit that fits is kept
        (100, {"root"}),
        (149, {"root"}),
        (150, {"root", "b2"}),
        (199, {"root", "b2"}),
        (250, {"root", "b2", "b1", "b0"}),
        (10**12, {"root", "b2", "b1", "b0"}),
    ],
)
def test_kept_units_keeps_what_fits_in_backward_order(budget, kept):
    assert kept_units(UNITS, budget) == kept


def test_kept_units_keeps_units_that_free_nothing():
    assert kept_units([("root", 0), ("b1", 10), ("b0", 0)], 5) == {"root", "b0"}


@pytest.mark.parametrize("bad, error", [(-1, ValueError), (1.5, TypeError), ("1GiB", TypeError)])
def test_bad_budget_names_the_fix(bad, error):
    with pytest.raises(error, match="keep_unsharded"):
        RetainOptions(keep_unsharded=bad)


case_tests(globals(), "tests.cases_budget", {"test_budget": (2, 900)})


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
    # kept: nothing -> 4 + 3 + 4; the root only -> 4 + 3 + 3; all -> 4.
    assert all_gathers(units, 0, True) == 11
    assert all_gathers(units, 400, True) == 10
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
    # 75% of 700 bytes = 525 keeps the root and one layer: 4 + 2 + (4 - 2) all-gathers.
    assert "| 2 of 4 |" in line and line.endswith("| 8 |"), line
