"""The report's FSDP2-only modes on a tiny Qwen2, CPU/gloo, world size 2.

One launch runs fsdp2 and fsdp1 with ``fsdp2_recipe`` (FSDP2 alone, pytorch #172543),
``accum`` and ``accum_gathered`` (two micro-batches of gradient accumulation, gradient
sync off for the first; ``accum_gathered`` with the user's
``set_reshard_after_backward(False)`` on every unit), the ``keep`` rows they compare
with, and ``two_forward`` last (its counts show the recipe put FSDP2's defaults back).
1 warm-up and 3 timed steps. Kept apart from ``test_report.py`` (a launch of its own, in
a process started when the tests are collected: tests/report/report_runs.py).
"""

from __future__ import annotations

import pytest

from fsdp_retain.report._modes import mode_legend
from fsdp_retain.report._results import unexpected_failures
from tests.report.report_runs import returned_report, start_report, taken
from tests.support import background

MODES = ("keep:every", "keep:last", "fsdp2_recipe:every", "fsdp2_recipe:last",
         "accum:every", "accum_gathered:every", "accum_gathered:last", "two_forward")
NEW = ("fsdp2_recipe", "accum", "accum_gathered")


@background.starts_early("fsdp2_modes_report_run")
def _start_report() -> background.BackgroundRun:
    return start_report("report_fsdp2_modes_", backends=("fsdp2", "fsdp1"), modes=MODES,
                        size="tiny", warmup=1, steps=3, timeout=600,
                        command="tests/report/test_report_fsdp2_modes.py")


@pytest.fixture(scope="module")
def fsdp2_modes_report_run():
    with taken("fsdp2_modes_report_run") as run:
        yield run


@pytest.fixture(scope="module")
def report(fsdp2_modes_report_run):
    """(what run_report returned, its folder)."""
    proc, out = fsdp2_modes_report_run
    return returned_report(proc), out


def row(report, backend, label):
    (found,) = [r for r in report[0]["rows"] if r["backend"] == backend and r["label"] == label]
    return found


def test_accumulation_keeps_the_users_gathered_groups(report):
    """Two micro-batches, keep_unsharded=True, n units: without the user's flag FSDP2
    reshards after each micro-batch and its forward gathers all n again (2n); with
    ``set_reshard_after_backward(False)`` the block leaves the groups gathered at exit
    as the user asked, so micro-batch 2 gathers nothing (n). A block that resharded the
    user's groups would count 2n. Reduce-scatters: micro-batch 2 only (sync off for 1),
    once per pass (every) or once (last)."""
    plain = row(report, "fsdp2", "accum:every")
    gathered = row(report, "fsdp2", "accum_gathered:every")
    n = gathered["fsdp_units"]
    assert plain["ok"] and gathered["ok"], (plain["error"], gathered["error"])
    assert plain["all_gathers_per_step"] == 2 * n, plain
    assert gathered["all_gathers_per_step"] == n < plain["all_gathers_per_step"], gathered
    assert plain["reduce_scatters_per_step"] == gathered["reduce_scatters_per_step"] == 2 * n
    last = row(report, "fsdp2", "accum_gathered:last")
    assert last["all_gathers_per_step"] == n and last["reduce_scatters_per_step"] == n, last
    for r in (plain, gathered, last):
        assert r["peak_bytes"] > 0 and r["within_bound"] is True, r


def test_recipe_counts_match_keep(report):
    """The recipe gathers each unit once per step, as ``keep``; reduce-scatters: one per
    unit per pass, or one with gradient sync off for backward 1 (as ``sync_grads="last"``)."""
    for sync, scatters in (("every", 2), ("last", 1)):
        recipe = row(report, "fsdp2", f"fsdp2_recipe:{sync}")
        keep = row(report, "fsdp2", f"keep:{sync}")
        n = recipe["fsdp_units"]
        assert recipe["ok"], recipe["error"]
        assert recipe["all_gathers_per_step"] == keep["all_gathers_per_step"] == n, recipe
        assert recipe["reduce_scatters_per_step"] == keep["reduce_scatters_per_step"] \
            == scatters * n, recipe
        assert recipe["within_bound"] is True and recipe["step_time_s"] > 0, recipe


def test_recipe_puts_fsdp2_defaults_back(report):
    """``two_forward`` runs after the recipe and accumulation steps on the same model:
    each forward gathers n units, each backward re-gathers the n - 1 that reshard after
    forward (the root keeps), so 2 (2n - 1); a flag left set would change that."""
    base = row(report, "fsdp2", "two_forward")
    n = base["fsdp_units"]
    assert base["all_gathers_per_step"] == 2 * (2 * n - 1), base


def test_library_rows_compared_with_the_recipe(report):
    """The recipe rows carry the step time of each library row of one forward with the
    same sync_grads over theirs (not ``accum``: two forwards); report.md prints them."""
    text = (report[1] / "report.md").read_text()
    for sync in ("every", "last"):
        keep = row(report, "fsdp2", f"keep:{sync}")
        recipe = row(report, "fsdp2", f"fsdp2_recipe:{sync}")
        ratios = recipe["library_time_ratios"]
        assert set(ratios) == {f"keep:{sync}"}, ratios
        assert ratios[f"keep:{sync}"] == pytest.approx(
            keep["step_time_s"] / recipe["step_time_s"]), ratios
        assert f"`keep:{sync}` {ratios[f'keep:{sync}']:.2f}x (of `fsdp2_recipe:{sync}`)" in text
        assert "library_time_ratios" not in keep
    assert "set_requires_gradient_sync(False) for backward 1" in mode_legend("fsdp2_recipe:last")
    assert "set_requires_gradient_sync" not in mode_legend("fsdp2_recipe:every")


def test_fsdp2_only_modes_expected_to_fail_elsewhere(report):
    """On FSDP1 the FSDP2-only modes record a ValueError naming the fix, labelled
    expected, so they do not fail the run; FSDP1's other rows still run."""
    for label in ("fsdp2_recipe:every", "accum:every", "accum_gathered:every"):
        r = row(report, "fsdp1", label)
        assert not r["ok"] and "ValueError" in r["error"], r
        assert "--backend fsdp2" in r["error"] and "FSDP2-only" in r["expected_error"], r
    assert row(report, "fsdp1", "two_forward")["ok"]
    assert all(r["ok"] for r in report[0]["rows"] if r["backend"] == "fsdp2")
    assert not [r for r in unexpected_failures(report[0]) if r.mode in NEW]
