"""tests/support/examples.py's batch: several example runs in one 2-rank launch, each
with its own output and status, a run that fails reported as its own, the runs after it
reported as not run (not passed), and count_blocks.py's wrapper only around the runs that
ask for it."""

from __future__ import annotations

from tests.support.examples import ExampleBatch, ExampleRun


def test_batch_keeps_each_runs_output_and_status():
    counted = ExampleRun("quickstart.py", ("--steps", "1", "--warmup", "0"))
    uncounted = ExampleRun("tiled_mlp.py", ("--fsdp", "1", "--steps", "1"), count_blocks=False)
    failing = ExampleRun("mtp_heads.py", ("--fsdp", "1", "--no-library", "--steps", "1"),
                         count_blocks=False)
    after = ExampleRun("quickstart.py", ("--fsdp", "1", "--steps", "1", "--warmup", "0"))
    batch = ExampleBatch([counted, uncounted, failing, after])

    first = batch.result(counted)
    assert first.returncode == 0 and "agreement: OK" in first.stdout, first.stdout + first.stderr
    assert first.stdout.count("[count_blocks] passes=2") == 1  # rank 0 prints it, once a step
    second = batch.result(uncounted)
    assert second.returncode == 0 and "agreement: OK" in second.stdout
    assert "FSDP1, 2 ranks, cpu, block, 4 tiles" in second.stdout
    assert "[count_blocks]" not in second.stdout  # the wrapper was taken off after the first
    third = batch.result(failing)
    assert third.returncode != 0 and "setStorage" in third.stderr, third.stderr[-3000:]
    fourth = batch.result(after)
    assert fourth.returncode != 0 and "agreement" not in fourth.stdout
    assert "did not end on rank 0" in fourth.stderr, fourth.stderr[-3000:]
