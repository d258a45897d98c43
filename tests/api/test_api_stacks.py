"""The stacks' wrappers and the refusals that name the fix there: accelerate's fallbacks
(plain processes refused, DDP run), ``accelerator.unwrap_model`` under accelerate and
transformers' ``Trainer`` (FSDP1 set up on CPU, and the Trainer's DDP fallback run),
Lightning's DDP (run) and wrappers, and no stack (CPU, gloo, world size 2;
tests/api/cases_api_stacks.py). And: telling the stacks apart imports none of them."""

import subprocess
import sys

import pytest
import torch

from tests.support.harness import ROOT, case_tests

# accelerate and the Trainer set up the GPU where there is one: these are the CPU fallbacks.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only fallbacks")

case_tests(globals(), "tests.api.cases_api_stacks", {"test_api_stacks": (2, 600)})

_NO_IMPORT = """
import os
import sys
import tempfile
import torch
import torch.distributed as dist
import torch.nn as nn
from fsdp_retain import no_reshard_between_backwards
try:
    no_reshard_between_backwards(nn.Linear(2, 2)).__enter__()
except ValueError as exc:
    print(str(exc)[:60])
else:
    raise SystemExit("no refusal")
store = tempfile.NamedTemporaryFile(delete=False).name
dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
ddp = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
with no_reshard_between_backwards(ddp):
    loss = ddp(torch.ones(1, 2)).sum()
    loss.backward(retain_graph=True)
    loss.backward()
print("DDP block ran")
dist.destroy_process_group()
stacks = ("accelerate", "transformers", "lightning", "pytorch_lightning", "lightning_fabric")
imported = sorted(m for m in sys.modules if m.split(".")[0] in stacks)
print(f"imported {imported}" if imported else "no stack imported", flush=True)
os._exit(1 if imported else 0)  # gloo can abort in the teardown after this: docs/limits.md
"""


def test_refusals_import_no_stack():
    """The refusal of a plain module and a block on a DDP model import no stack."""
    proc = subprocess.run([sys.executable, "-c", _NO_IMPORT], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("no_reshard_between_backwards got a") == 1, proc.stdout
    assert "DDP block ran" in proc.stdout, proc.stdout
    assert "no stack imported" in proc.stdout, proc.stdout
