"""``keep_unsharded`` as a per-rank byte budget: the shared policy (no ranks), option
validation, and FSDP1/FSDP2 parity, kept units and all-gather counts on CPU/gloo at
world size 2 (tests/cases_budget.py)."""

import pytest

from fsdp_retain._common import RetainOptions, kept_units
from tests import cases_budget
from tests.harness import check_case, launch

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


@pytest.fixture(scope="module")
def results():
    return launch("tests.cases_budget", world_size=2, timeout=900)


@pytest.mark.parametrize("name", cases_budget.registry.names(world_size=2))
def test_budget(results, name):
    check_case(results, name)
