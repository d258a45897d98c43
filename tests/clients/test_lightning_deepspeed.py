"""PyTorch Lightning's DeepSpeedStrategy, ZeRO stages 1 to 3, as a client (CPU, gloo,
world size 2; the cases of tests/clients/cases_lightning_deepspeed.py, in a launch of
their own: Lightning initializes DeepSpeed's communication backend there, which
tests/deepspeed's cases initialize themselves in the shared launch, after wrapping
torch.distributed's collectives to count them). The block on self.trainer.strategy.model
against the plain run, parameters against a one-process replay.

Skipped without deepspeed; run it in the DeepSpeed venv (scripts/venv_ci.sh deepspeed).
"""

import pytest

pytest.importorskip("deepspeed", reason="deepspeed not installed (the deepspeed extra)")
pytest.importorskip("lightning", reason="the lightning extra: pip install '.[lightning]'")

from tests.support.harness import case_tests  # noqa: E402

case_tests(globals(), "tests.clients.cases_lightning_deepspeed",
           {"test_lightning_deepspeed": (2, 600)}, isolated=True)
