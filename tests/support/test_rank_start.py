"""The harness's ranks are forks of a process that imported their cases modules once
(tests/support/rank_start.py): each starts as ``subprocess.Popen`` would have started it
(its environment, whole; its working directory; its output in its log) and its exit code
is the launch's."""

from __future__ import annotations

import os

from tests.support.harness import launch

MODULE = "tests.support.cases_rank_start"


def test_forked_rank_has_the_launchs_environment_and_output(monkeypatch):
    # Set before the session's fork server may start (then inherited by it), dropped before
    # the launch: a forked rank must not keep it.
    os.environ["FSDP_RETAIN_RANK_START_DROPPED"] = "server"
    launch(MODULE, 2, cases=[], timeout=120)  # starts the server if none runs yet
    monkeypatch.delenv("FSDP_RETAIN_RANK_START_DROPPED")
    monkeypatch.setenv("FSDP_RETAIN_RANK_START_PROBE", "session")
    result = launch(MODULE, 2, cases=["environment_as_popen_gives_it"], timeout=120,
                    env={"FSDP_RETAIN_RANK_START_PROBE": "launch"})
    assert result.returncodes == [0, 0], result.output_tail()
    for rank, entries in enumerate(result.per_rank):
        assert entries["environment_as_popen_gives_it"]["ok"], result.output_tail()
        assert f"rank {rank} says hello" in result.outputs[rank]
        assert f"rank {rank} on stderr" in result.outputs[rank]


def test_a_rank_that_exits_gives_its_code():
    result = launch(MODULE, 2, cases=["rank_one_exits_three"], timeout=120)
    assert result.returncodes[1] == 3, result.output_tail()
    assert "rank_one_exits_three" not in result.per_rank[1]
