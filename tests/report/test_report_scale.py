"""The report at scale: ``--simulate-world-size`` on Llama-3-70B shapes
(docs/report/configs/llama3_70b.json) cut to 2 layers, 8 simulated ranks, bf16, batch
1 x 4096, activation checkpointing, FSDP2, four modes. The run builds the model under
fake tensors (nothing is materialized: 2 layers and the root of that shape would be
7.6 GB of bf16 weights), prints a progress line per mode and ends in seconds; the full
80 layers on 64 ranks take about a minute (docs/report/README.md)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "docs/report/configs/llama3_70b.json"
MODES = ["two_forward", "keep:every", "regather:every", "keep50:every"]

# Runs the report's command line in this process (its main: ``python -m`` would leave
# before the print), then prints its peak resident memory.
_RUN = """
import resource, sys
from fsdp_retain.report._cli import main
code = main(sys.argv[1:])
print("MAXRSS_KIB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
sys.exit(code)
"""


def test_llama3_70b_config_is_the_published_shape():
    config = json.loads(CONFIG.read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert {k: config[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size",
                                   "num_attention_heads", "num_key_value_heads",
                                   "vocab_size")} == dict(
        hidden_size=8192, num_hidden_layers=80, intermediate_size=28672,
        num_attention_heads=64, num_key_value_heads=8, vocab_size=128256)


def test_simulated_70b_layers_finish_with_a_line_per_mode(tmp_path):
    args = ["--model-config", str(CONFIG), "--layers", "2", "--simulate-world-size", "8",
            "--dtype", "bf16", "--batch", "1", "--seq-len", "4096",
            "--activation-checkpointing", "--backend", "fsdp2", "--modes", *MODES,
            "--gpu-memory", "80GiB", "141GiB", "--out", str(tmp_path)]
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _RUN, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "fsdp2 3 FSDP units" in out, out[-4000:]
    for label in MODES:
        assert re.search(rf"fsdp2 {re.escape(label)}: peak [0-9.]+ GiB per rank \(\d+s\)", out), (
            label, out[-4000:])
    maxrss_gib = int(re.search(r"MAXRSS_KIB (\d+)", out).group(1)) / 2**20
    assert maxrss_gib < 3, f"{maxrss_gib:.1f} GiB resident: were the weights materialized?"
    assert elapsed < 120, f"{elapsed:.0f} s"
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["config"]["hidden"] == 8192 and report["config"]["world_size"] == 8
    assert (tmp_path / "budget_fit.md").is_file()
