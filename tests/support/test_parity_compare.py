"""tests/support/parity.py's ``assert_close_dicts``: its one-comparison path for plain fp32
and fp64 tensors passes and fails where ``torch.testing.assert_close`` does, with its
message (the parity cases' verdicts rest on it)."""

from __future__ import annotations

import pytest
import torch

from tests.support.parity import TOL, _plainly_close, assert_close_dicts


def _pair(**changes):
    expected = {"a": torch.linspace(-1, 1, 12).reshape(3, 4), "b": torch.ones(5, dtype=torch.float64)}
    actual = {name: t.clone() for name, t in expected.items()}
    actual.update(changes)
    return actual, expected


def test_close_values_pass_in_one_comparison():
    actual, expected = _pair()
    actual["a"] = actual["a"] + 5e-6  # within rtol=atol=1e-5
    assert _plainly_close(actual, expected, **TOL)
    assert_close_dicts(actual, expected, "grads")


@pytest.mark.parametrize("change, message", [
    (lambda t: t + torch.eye(3, 4) * 1e-3, "Mismatched elements: 3 / 12"),
    (lambda t: t.masked_fill(t > 0.9, float("nan")), "Mismatched elements: 1 / 12"),
    (lambda t: t.double(), "dtype"),
    (lambda t: t.reshape(4, 3), "shape"),
    (lambda t: t.bfloat16(), "dtype"),
])
def test_what_assert_close_fails_fails_with_its_message(change, message):
    actual, expected = _pair()
    actual["a"] = change(actual["a"])
    assert not _plainly_close(actual, expected, **TOL)
    with pytest.raises(AssertionError, match=message) as failed:
        assert_close_dicts(actual, expected, "grads")
    assert str(failed.value).startswith("grads: a: ")


def test_other_dtypes_are_left_to_assert_close():
    expected = {"w": torch.ones(4, dtype=torch.bfloat16)}
    actual = {"w": expected["w"] + 1e-6}
    assert not _plainly_close(actual, expected, **TOL)
    assert_close_dicts(actual, expected, "params")  # assert_close's own verdict: close
