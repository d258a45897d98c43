"""The report's ``--node-size`` and mode ``regather_node`` (``reshard_to=<--node-size>``):
flag checks, and a simulated run of the tiny preset on 8 ranks in nodes of 4 (FSDP2,
fake process group, one process) whose all-gathers are split by the size of their group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdp_retain.report._cli import parse_args
from fsdp_retain.report._config import ReportConfig
from fsdp_retain.report._modes import Mode, mode_legend
from tests.report.report_runs import (
    returned_report, start_command, start_report, taken, written_report,
)
from tests.support import background

ROOT = Path(__file__).resolve().parents[2]
MODES = ["two_forward", "keep:every", "regather:every", "regather_node:every"]


def _usage_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_node_size_must_divide_the_world_size(capsys):
    err = _usage_error(capsys, ["--simulate-world-size", "8", "--node-size", "3"])
    assert "--node-size 3 does not divide the world size 8" in err
    assert "Pass a divisor of 8" in err
    err = _usage_error(capsys, ["--nproc", "2", "--node-size", "4"])
    assert "does not divide the world size 2" in err
    with pytest.raises(ValueError, match="Pass a divisor of 64"):
        ReportConfig(simulate_world_size=64, node_size=6)


def test_node_size_is_at_least_two(capsys):
    err = _usage_error(capsys, ["--simulate-world-size", "8", "--node-size", "1"])
    assert "--node-size must be an int >= 2" in err


def test_regather_node_needs_node_size(capsys):
    err = _usage_error(capsys, ["--simulate-world-size", "8", "--modes", "two_forward",
                                "regather_node:every"])
    assert "pass --node-size N" in err


def test_node_size_checked_against_a_launch_world_size(monkeypatch):
    """Without a world size at parse time (one rank per GPU), ``run_report`` checks it
    against the launch's before any rank starts."""
    from fsdp_retain.report import _launch

    cfg = ReportConfig(node_size=4, backends=("fsdp2",), size="tiny")
    monkeypatch.setattr(_launch, "check_dependencies", lambda backends: [])
    monkeypatch.setattr(ReportConfig, "world_size", lambda self: 6)
    with pytest.raises(ValueError, match="--node-size 4 does not divide the world size 6"):
        _launch.run_report(cfg)


def test_regather_node_passes_node_size_as_reshard_to():
    cfg = parse_args(["--simulate-world-size", "8", "--node-size", "4", "--modes",
                      "two_forward", "regather_node:last"])
    mode = cfg.mode_list()[1]
    assert mode == Mode("regather_node", "last", reshard_to=4)
    assert mode.block_options() == dict(keep_unsharded=False, sync_grads="last", backwards=2,
                                        reshard_to=4)
    assert "reshard_to=4" in mode_legend("regather_node:every", node_size=4)
    assert "reshard_to=<--node-size>" in mode_legend("regather_node:every")


@background.starts_early("node_report_run")
def _start_node_report() -> background.BackgroundRun:
    """Tiny preset, batch 1 x 16 (the parameters outweigh the activations), 8 simulated
    ranks in nodes of 4."""
    return start_command("report_node_", "--size", "tiny", "--batch", "1", "--seq-len", "16",
                         "--simulate-world-size", "8", "--node-size", "4", "--backend", "fsdp2",
                         "--modes", *MODES)


@pytest.fixture(scope="module")
def node_report_run():
    with taken("node_report_run", timeout=300) as run:
        yield run


@pytest.fixture(scope="module")
def report(node_report_run):
    return written_report(*node_report_run)


def test_regather_node_gathers_inside_the_node_between_passes(report):
    """regather_node's all-gathers after backward 1 are on groups of 4 ranks: none leaves
    a node; regather's are on all 8 ranks; keep re-gathers nothing."""
    data, rows, _ = report
    assert data["config"]["node_size"] == 4
    node, regather, keep = rows["regather_node:every"], rows["regather:every"], rows["keep:every"]
    assert node["reshard_to"] == 4 and regather["reshard_to"] is None
    assert node["inter_node_all_gather_bytes_between_passes"] == 0
    assert set(node["all_gather_bytes_between_passes"]) == {"4"}
    assert regather["inter_node_all_gather_bytes_between_passes"] > 0
    assert set(regather["all_gather_bytes_between_passes"]) == {"8"}
    assert keep["inter_node_all_gather_bytes_between_passes"] == 0
    # The same all-gathers and bytes, only on smaller groups.
    assert node["all_gathers_per_step"] == regather["all_gathers_per_step"]
    assert (node["all_gather_bytes_between_passes"]["4"]
            == regather["all_gather_bytes_between_passes"]["8"])
    assert sum(node["all_gather_bytes_by_group"].values()) == node["all_gather_bytes_per_step"]


def test_regather_node_peak_between_regather_and_keep(report):
    """Between passes each rank holds 1/4 of the unsharded parameters: more than
    regather, less than keep (all of them), within its bound."""
    _, rows, _ = report
    node = rows["regather_node:every"]
    assert rows["regather:every"]["peak_bytes"] <= node["peak_bytes"]
    assert node["peak_bytes"] <= rows["keep:every"]["peak_bytes"]
    assert node["within_bound"], node["memory_bound"]


def test_report_md_has_the_inter_node_column(report):
    _, _, text = report
    assert "## All-gathers by group (per rank, one step; 4 ranks per node)" in text
    assert "inter-node all-gather bytes between passes" in text
    line = next(x for x in text.splitlines() if x.startswith("| fsdp2 | `regather_node:every`")
                and "ranks:" in x)
    assert line.endswith("| 0 |"), line


def test_committed_70b_on_64_ranks_fits_with_no_inter_node_all_gathers():
    """The will-it-fit run of Llama-3-70B on 64 ranks (bf16, 1 x 4096, activation
    checkpointing, nodes of 8): reshard_to=8 peaks within 80 GiB per rank and issues no
    all-gather between passes that leaves a node; keep_unsharded=False alone does."""
    data = json.loads((ROOT / "docs/report/fit/llama3_70b_64/report.json").read_text())
    cfg = data["config"]
    assert (cfg["world_size"], cfg["node_size"], cfg["dtype"], cfg["batch_per_rank"],
            cfg["seq_len"], cfg["activation_checkpointing"]) == (64, 8, "bf16", 1, 4096, True)
    rows = {r["label"]: r for r in data["rows"]}
    node = rows["regather_node:every"]
    assert node["ok"] and node["reshard_to"] == 8
    assert node["peak_bytes"] <= 80 * 2**30
    assert node["inter_node_all_gather_bytes_between_passes"] == 0
    assert rows["regather:every"]["inter_node_all_gather_bytes_between_passes"] > 0


@background.starts_early("hybrid_report_run")
def _start_hybrid_report() -> background.BackgroundRun:
    return start_report("report_hybrid_", backends=("fsdp1",), size="tiny", nproc=4,
                        node_size=2, fsdp1_sharding="HYBRID_SHARD", warmup=1, steps=2,
                        timeout=300, modes=("two_forward", "keep:every", "regather_node:every"))


@pytest.fixture
def hybrid_report_run():
    with taken("hybrid_report_run", timeout=300) as run:
        yield run


def test_fsdp1_hybrid_shard_launch_gathers_inside_the_node(hybrid_report_run):
    """--fsdp1-sharding HYBRID_SHARD on 4 real gloo ranks in nodes of 2: FSDP1 sharded over
    groups of 2 ranks, so every all-gather (the forward's too) is on a group of 2; the
    block's reshard_to=2 (regather_node) runs there, with 0 inter-node bytes between
    passes. (The gradients of HYBRID_SHARD under the block are checked for parity in
    tests/options/cases_reshard_to_fsdp1.py.)"""
    proc, out = hybrid_report_run
    data = returned_report(proc)
    assert data["config"]["fsdp1_sharding"] == "HYBRID_SHARD"
    rows = {r["label"]: r for r in data["rows"]}
    for label, row in rows.items():
        assert row["ok"], (label, row["error"])
        assert set(row["all_gather_bytes_by_group"]) == {"2"}, row
        assert row["inter_node_all_gather_bytes_between_passes"] == 0, row
    assert (rows["regather_node:every"]["all_gathers_per_step"]
            > rows["keep:every"]["all_gathers_per_step"])
    assert "`HYBRID_SHARD` over shard groups of 2 ranks" in (out / "report.md").read_text()


def test_regather_node_on_fsdp1_full_shard_names_hybrid_shard(tmp_path):
    """Without --fsdp1-sharding HYBRID_SHARD, FSDP1's regather_node row records the
    library's refusal, and the report's reason names the flag that runs it."""
    from fsdp_retain.report import run_report

    data = run_report(ReportConfig(
        backends=("fsdp1",), size="tiny", simulate_world_size=4, node_size=2,
        out=str(tmp_path), modes=("two_forward", "regather_node:every")))
    row = next(r for r in data["rows"] if r["label"] == "regather_node:every")
    assert not row["ok"] and "HYBRID_SHARD" in row["error"], row
    assert "--fsdp1-sharding HYBRID_SHARD" in row["expected_error"], row
