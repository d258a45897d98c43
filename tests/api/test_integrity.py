"""``check_saved_tensors=True``: the fingerprint on its own (one process), then the
flash-attn in-place-backward pattern and a sample of parity scenarios under FSDP1
and FSDP2 (CPU/gloo, world size 2; see tests/api/cases_integrity.py)."""

import gc
import weakref

import pytest
import torch

from fsdp_retain._policy import RetainOptions
from fsdp_retain._saved_tensors import SavedTensorCheck, fingerprint
from tests.api.cases_integrity import InplaceLogProb
from tests.support.harness import case_tests


case_tests(globals(), "tests.api.cases_integrity", {"test_integrity": (2, 900)})


class _Checked:
    def __enter__(self):
        self.check = SavedTensorCheck()
        self.check.push()

    def __exit__(self, *exc):
        self.check.pop()


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(64, 33),
        lambda: torch.randn(33, 64).t(),  # non-contiguous
        lambda: torch.randn(5, 6, 7, 8)[:, ::2, :, 1:],
        lambda: torch.randn(1000).to(torch.bfloat16),
        lambda: torch.randn(1000).to(torch.float16),
        lambda: torch.randn(10, dtype=torch.float64),
        lambda: torch.randint(0, 100, (40, 3)),
        lambda: torch.tensor(3.5),
    ],
)
def test_fingerprint_sees_a_change_anywhere(make):
    """One element changed, far from the sampled ones, changes the fingerprint."""
    t = make()
    before = fingerprint(t)
    assert torch.equal(before, fingerprint(t)), "not deterministic"
    flat_index = t.numel() // 2 + 1 if t.numel() > 1 else 0
    index = torch.unravel_index(torch.tensor(flat_index), t.shape)
    t[index] = t[index] + 7
    assert not torch.equal(before, fingerprint(t))


def test_fingerprint_nan_bool_empty():
    t = torch.tensor([1.0, float("nan"), 3.0])
    assert torch.equal(fingerprint(t), fingerprint(t.clone())), "NaN must compare equal to itself"
    b = torch.zeros(20, dtype=torch.bool)
    before = fingerprint(b)
    b[13] = True
    assert not torch.equal(before, fingerprint(b))
    assert fingerprint(torch.empty(0, 4)) is None
    assert fingerprint(torch.randn(3, dtype=torch.complex64)) is None


def _two_passes_inplace():
    torch.manual_seed(0)
    w = torch.randn(8, 12, requires_grad=True)
    logp = InplaceLogProb.apply(torch.randn(5, 8) @ w, torch.tensor([0, 3, 5, 7, 11]))
    logp.sum().backward(retain_graph=True)
    first = w.grad.clone()
    logp.sum().backward()
    return first, w.grad - first


def test_inplace_backward_is_silent_without_the_check_and_raises_with_it():
    first, second = _two_passes_inplace()
    assert (first - second).abs().max() > 1e-2, "the pattern no longer corrupts pass 2"
    with _Checked(), pytest.raises(RuntimeError) as info:
        _two_passes_inplace()
    message = str(info.value)
    for text in ("InplaceLogProbBackward", "shape (5, 12)", "2nd time", "inplace_backward=False"):
        assert text in message, (text, message)


def test_freed_storage_is_reported():
    x = torch.randn(4, 4, requires_grad=True)
    with _Checked():
        y = torch.randn(4, 4) @ x  # saves the random matrix
        saved = torch.randn(4, 4, requires_grad=True)
        z = (saved * 2).sin()  # saves saved * 2
    (saved * 0).sum()
    z.grad_fn._saved_self.untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match="freed storage"):
        z.sum().backward()
    y.sum().backward()  # untouched tensors still pass


def test_version_check_is_kept():
    """Saved-tensor hooks turn off torch's version check; the check does it itself."""
    a = torch.randn(3, requires_grad=True)
    with _Checked():
        e = (a * 1).exp()
    e.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        e.sum().backward()


def test_double_backward_and_no_reference_cycle():
    a = torch.randn(5, requires_grad=True)
    with _Checked():
        y = torch.tanh(a * 2)
        (g,) = torch.autograd.grad(y.pow(2).sum(), a, create_graph=True)
        g.sum().backward()
    expected = a.detach().clone().requires_grad_()
    (ge,) = torch.autograd.grad(torch.tanh(expected * 2).pow(2).sum(), expected, create_graph=True)
    ge.sum().backward()
    torch.testing.assert_close(a.grad, expected.grad)
    ref = weakref.ref(y)
    del y, g
    gc.collect()
    assert ref() is None, "a saved output keeps itself alive through the check"


def test_option_is_validated():
    with pytest.raises(TypeError, match="check_saved_tensors must be a bool"):
        RetainOptions(check_saved_tensors="yes")
