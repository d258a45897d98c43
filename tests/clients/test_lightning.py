"""PyTorch Lightning's DDP strategies as a client (CPU, gloo, world size 2; the cases of
tests/clients/cases_lightning.py, in the session's launch): the Trainer with DDPStrategy
(default, static_graph, find_unused_parameters, manual gradient accumulation) and Fabric
with DDPStrategy, the block against the plain run, parameters against a one-process
replay, all-reduces per micro-batch by formula; refusals that name the Lightning object
to pass. Skipped without lightning (in the test extra)."""

import pytest

pytest.importorskip("lightning", reason="the lightning extra: pip install '.[lightning]'")

from tests.support.harness import case_tests  # noqa: E402

case_tests(globals(), "tests.clients.cases_lightning", {"test_lightning": (2, 600)})
