"""``covering`` (tests/support/case_parts.py), which the option grids use in place of their full
product: every ``strength`` factors meet in each combination of their values."""

import itertools

import pytest

from tests.support.case_parts import covering
from tests.support.harness import LaunchResult, check_case


@pytest.mark.parametrize("strength", [2, 3])
def test_covering_meets_every_combination(strength):
    factors = {"a": (0, 1, 2), "b": (True, False), "c": ("x", "y"), "d": (1, 2), "e": (5, 6)}
    rows = covering(factors, strength)
    product = 3 * 2 ** 4
    assert len(rows) < product
    for group in itertools.combinations(factors, strength):
        seen = {tuple(row[n] for n in group) for row in rows}
        assert seen == set(itertools.product(*(factors[n] for n in group))), group


def test_covering_is_deterministic_and_full_at_full_strength():
    factors = {"a": (0, 1), "b": (0, 1), "c": (0, 1)}
    assert covering(factors, 3) == covering(factors, 3)
    assert len(covering(factors, 3)) == 8


def _result(*entries: dict) -> LaunchResult:
    return LaunchResult(len(entries), [0] * len(entries), [{"c": e} for e in entries],
                        [""] * len(entries), False)


def test_check_case_skips_only_where_every_rank_skipped():
    """A case that needs what this machine lacks (``skip_case``) is a pytest skip with its
    reason; skipped on one rank and run on the other, it fails."""
    skipped = {"ok": True, "error": None, "skipped": "no fp16 here"}
    with pytest.raises(pytest.skip.Exception, match="no fp16 here"):
        check_case(_result(skipped, skipped), "c")
    with pytest.raises(AssertionError, match="skipped on some ranks only"):
        check_case(_result(skipped, {"ok": True, "error": None}), "c")
    check_case(_result({"ok": True, "error": None}, {"ok": True, "error": None}), "c")
