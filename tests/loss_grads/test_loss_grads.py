"""Per-loss gradients under FSDP1 and FSDP2: ``block.grads(loss)`` against the
one-process method (PCGrad, inverse-norm weighting) on an unsharded reference
(tests/loss_grads/cases_loss_grads.py)."""

from tests.support.harness import case_tests

case_tests(globals(), "tests.loss_grads.cases_loss_grads", {"test_loss_grads": (2, 900)})
