"""OLMo-core 3.0's own Transformer, apply_fsdp (FSDP2) and apply_ddp (composable
replicate()), 2 CPU ranks, 3 steps of a cross-entropy pass and a z-loss pass over one
forward, in the block with sync_grads "every" and "last" and without it: parity with one
process and collectives per step by formula (tests/clients/cases_olmo_core.py). Without the block
apply_fsdp agrees but gathers again per backward; apply_ddp is silently wrong.

Skipped when OLMo-core is not installed; run it in its own venv:
``scripts/venv_ci.sh olmo`` (ai2-olmo-core 3.0.0 next to torch 2.13.0).
"""

import pytest

pytest.importorskip("olmo_core", reason="ai2-olmo-core not installed (scripts/venv_ci.sh olmo)")

from tests.support.harness import case_tests  # noqa: E402

case_tests(globals(), "tests.clients.cases_olmo_core", {"test_olmo_core": (2, 600)})
