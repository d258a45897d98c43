"""The report's ddp backend: ``python -m fsdp_retain.report --backend ddp`` on the tiny
Qwen2, CPU/gloo, world size 2, DDP buckets of 0.25 MiB (three buckets after DDP's first
step; its default 25 MiB holds the tiny model in one), 1 warm-up and 3 timed steps.

Rows: two_forward (the baseline) and the library's keep, probe and check rows ran; plain
DDP's naive row is marked wrong (the ranks' gradients disagree); the modes that only
change keep_unsharded or reshard_to are n/a; all-reduces per step follow a formula.
"""

from __future__ import annotations

import pytest

from fsdp_retain.report import ReportConfig
from fsdp_retain.report._figures import error_text
from fsdp_retain.report._results import unexpected_failures
from fsdp_retain.report._rows import ReportRow
from tests.report.report_runs import start_command, taken, written_report
from tests.support import background

RAN = ("two_forward", "keep:every", "keep:last", "probe:every", "probe:last", "check:every",
       "check:last")
NOT_APPLICABLE = ("regather:every", "keep25:every", "regather_node:every")
MODES = (*RAN[:1], "naive", *RAN[1:], *NOT_APPLICABLE, "fsdp2_recipe:every")


@background.starts_early("ddp_report_run")
def _start_report() -> background.BackgroundRun:
    return start_command("report_ddp_", "--backend", "ddp", "--size", "tiny", "--warmup", "1",
                         "--steps", "3", "--ddp-bucket-cap-mb", "0.25", "--node-size", "2",
                         "--timeout", "300", "--modes", *MODES)


@pytest.fixture(scope="module")
def ddp_report_run():
    with taken("ddp_report_run", timeout=300) as run:
        yield run


@pytest.fixture(scope="module")
def report(ddp_report_run):
    # Exit 0: the naive row's wrong gradients and the n/a rows are expected, not failures.
    return written_report(*ddp_report_run)


def test_rows_ran_and_within_their_bound(report):
    """Every row that means something on DDP ran, with its time against two_forward, and
    its memory within the DDP bound (nothing kept: the block's copy of the grads)."""
    data, rows, _ = report
    assert [r["label"] for r in data["rows"]] == list(MODES)
    assert not unexpected_failures(data)
    base = rows["two_forward"]
    unsharded = data["config"]["unsharded_param_bytes"]
    for label in RAN:
        r = rows[label]
        assert r["ok"] and r["expected_error"] is None, (label, r["error"])
        assert r["timed_steps"] == 3 and r["step_time_s"] > 0, label
        assert r["time_ratio"] == pytest.approx(r["step_time_s"] / base["step_time_s"]), label
        if label != "two_forward":
            assert r["within_bound"] is True, (label, r["memory_overhead_bytes"])
            assert r["memory_bound_bytes"] == int(1.1 * unsharded), label
            assert r["memory_bound"].startswith("DDP: "), r["memory_bound"]
    assert 0 < base["forward2_time_s"] < base["step_time_s"]


def test_naive_row_marked_wrong(report):
    """Plain DDP runs two backwards over one forward without an error, but reduces the
    first only: the replica check finds the ranks' gradients differ, and the row shows
    no time, memory or collectives to compare."""
    _, rows, md = report
    r = rows["naive"]
    assert not r["ok"] and "replica check" in r["error"] and "ReplicasDisagree" in r["error"]
    assert "silently wrong" in r["expected_error"], r["expected_error"]
    assert r["step_time_s"] is r["time_ratio"] is r["all_reduces_per_step"] is None
    assert error_text(ReportRow.from_json(r)) == "wrong gradients"
    assert "| ddp | `naive` | wrong gradients (see below) |" in md
    assert "- ddp `naive`: wrong gradients, as expected: plain DDP" in md


def test_not_applicable_rows(report):
    """The modes that only change keep_unsharded or reshard_to are not run on DDP, and say
    why; the FSDP2-only mode records FSDP2's ValueError, as on FSDP1."""
    _, rows, md = report
    for label in NOT_APPLICABLE:
        r = rows[label]
        assert not r["ok"] and r["error"] == "n/a on ddp: not run", r
        assert "DDP shards nothing" in r["expected_error"], r
        assert error_text(ReportRow.from_json(r)) == "n/a (nothing sharded)"
        assert f"| ddp | `{label}` | n/a (see below) |" in md
    recipe = rows["fsdp2_recipe:every"]
    assert "ValueError" in recipe["error"] and "FSDP2-only" in recipe["expected_error"]
    assert error_text(ReportRow.from_json(recipe)) == "n/a (FSDP2 only)"


def test_all_reduces_per_step(report):
    """One all-reduce per DDP bucket (B) per reduction, plus the used-map all-reduce where
    DDP tracks unused parameters (u; not here): two_forward reduces in each of its two
    backwards (2B), keep:every and check:every after each pass (2(B + u)), :last once per
    step (B + u), probe rows once (backward 1 is a probe pass). No all-gather, no
    reduce-scatter: nothing is sharded."""
    data, rows, md = report
    setup = data["config"]["ddp"]
    assert setup == {"bucket_cap_mb": 0.25, "find_unused_parameters": False,
                     "gradient_as_bucket_view": False, "static_graph": False}
    used = int(setup["find_unused_parameters"])
    buckets = rows["two_forward"]["fsdp_units"]
    assert buckets >= 2, "the formula needs several buckets: lower --ddp-bucket-cap-mb"
    expected = {"two_forward": 2 * buckets,
                "keep:every": 2 * (buckets + used), "check:every": 2 * (buckets + used),
                "keep:last": buckets + used, "check:last": buckets + used,
                "probe:every": buckets + used, "probe:last": buckets + used}
    got = {label: rows[label]["all_reduces_per_step"] for label in expected}
    assert got == expected, (buckets, got)
    for label in RAN:
        assert rows[label]["fsdp_units"] == buckets
        assert rows[label]["all_gathers_per_step"] == rows[label]["reduce_scatters_per_step"] == 0
    assert "| all-reduces |" in md and f"| {2 * buckets} |" in md


def test_ddp_is_real_ranks_only():
    with pytest.raises(ValueError, match="not ddp"):
        ReportConfig(size="tiny", backends=("ddp",), simulate_world_size=8)
    with pytest.raises(ValueError, match="ddp-bucket-cap-mb"):
        ReportConfig(size="tiny", backends=("ddp",), ddp_bucket_cap_mb=0)
