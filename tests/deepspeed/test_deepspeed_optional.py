"""fsdp_retain works without deepspeed and never imports it (the extra is optional)."""

import subprocess
import sys

from tests.support.harness import ROOT

_SCRIPT = """
import sys, torch.nn as nn
from fsdp_retain import no_reshard_between_backwards
try:
    with no_reshard_between_backwards(nn.Linear(2, 2)):
        pass
except ValueError as exc:
    assert "not wrapped by DDP or FSDP" in str(exc), exc
else:
    raise AssertionError("a plain module was accepted")
assert "deepspeed" not in sys.modules, "fsdp_retain imported deepspeed"
"""


def test_no_deepspeed_import():
    subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, check=True, timeout=300)
