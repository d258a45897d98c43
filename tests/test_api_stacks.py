"""Refusals that name the fix in the user's stack: accelerate's fallbacks (plain
processes, DDP), ``accelerator.unwrap_model`` under accelerate and transformers'
``Trainer`` (FSDP1 set up on CPU), Lightning's DDP and wrappers, and no stack (CPU,
gloo, world size 2; tests/cases_api_stacks.py). And: telling the stacks apart imports
none of them."""

import subprocess
import sys

import pytest
import torch

from tests.harness import ROOT, case_tests

# accelerate and the Trainer set up the GPU where there is one: these are the CPU fallbacks.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only fallbacks")

case_tests(globals(), "tests.cases_api_stacks", {"test_api_stacks": (2, 600)})

_NO_IMPORT = """
import sys
import torch.nn as nn
from fsdp_retain import no_reshard_between_backwards
for model in (nn.Linear(2, 2), nn.parallel.DistributedDataParallel.__new__(
        nn.parallel.DistributedDataParallel)):
    try:
        no_reshard_between_backwards(model).__enter__()
    except ValueError as exc:
        print(str(exc)[:60])
    else:
        raise SystemExit("no refusal")
stacks = ("accelerate", "transformers", "lightning", "pytorch_lightning", "lightning_fabric")
imported = sorted(m for m in sys.modules if m.split(".")[0] in stacks)
raise SystemExit(f"imported {imported}" if imported else 0)
"""


def test_refusals_import_no_stack():
    """The refusals of a plain module and of a DDP model import no stack."""
    proc = subprocess.run([sys.executable, "-c", _NO_IMPORT], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("no_reshard_between_backwards got a") == 2, proc.stdout
