"""``covering`` (tests/case_parts.py), which the option grids use in place of their full
product: every ``strength`` factors meet in each combination of their values."""

import itertools

import pytest

from tests.case_parts import covering


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
