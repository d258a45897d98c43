"""tests/support/examples.py's batch: several example runs in one 2-rank launch, each in a
process of its own forked after the shared imports, with its own output and status; a
run that fails is reported as its own and the runs after it still run; a rank left in a
collective by its failed peer is stopped (as torchrun stops it) and the batch goes on;
count_blocks.py's wrapper only around the runs that ask for it; runs whose scripts set
different environment variables before their imports get launches of their own."""

from __future__ import annotations

from pathlib import Path

from tests.support.examples import EXAMPLES, ExampleBatch, ExampleRun, script_env, script_imports

ONE_RANK_FAILS = str(Path(__file__).with_name("one_rank_fails.py"))


def test_batch_keeps_each_runs_output_and_status():
    counted = ExampleRun("quickstart.py", ("--steps", "1", "--warmup", "0"))
    uncounted = ExampleRun("tiled_mlp.py", ("--fsdp", "1", "--steps", "1"), count_blocks=False)
    failing = ExampleRun("mtp_heads.py", ("--fsdp", "1", "--no-library", "--steps", "1"),
                         count_blocks=False)
    left_behind = ExampleRun(ONE_RANK_FAILS, (), count_blocks=False)
    after = ExampleRun("quickstart.py", ("--fsdp", "1", "--steps", "1", "--warmup", "0"))
    batch = ExampleBatch([counted, uncounted, failing, left_behind, after])

    first = batch.result(counted)
    assert first.returncode == 0 and "agreement: OK" in first.stdout, first.stdout + first.stderr
    assert first.stdout.count("[count_blocks] passes=2") == 1  # rank 0 prints it, once a step
    second = batch.result(uncounted)
    assert second.returncode == 0 and "agreement: OK" in second.stdout
    assert "FSDP1, 2 ranks, cpu, block, 4 tiles" in second.stdout
    assert "[count_blocks]" not in second.stdout  # the wrapper was only in the first's process
    third = batch.result(failing)
    assert third.returncode != 0 and "setStorage" in third.stderr, third.stderr[-3000:]
    fourth = batch.result(left_behind)
    assert fourth.returncode == 1, fourth.stderr[-3000:]  # rank 0's own status comes first
    assert "rank 0 fails on purpose" in fourth.stderr
    assert "killed on rank 1: another rank's run failed" in fourth.stderr, fourth.stderr[-3000:]
    fifth = batch.result(after)  # a fresh process group on both ranks, after all that
    assert fifth.returncode == 0 and "agreement: OK" in fifth.stdout, fifth.stderr[-3000:]
    assert "[count_blocks] passes=2" in fifth.stdout


def test_scripts_imports_and_environment_read_off_the_source():
    imports = dict(script_imports(EXAMPLES / "hf_trainer.py"))
    assert "Trainer" in imports["transformers"]
    assert "deepspeed.utils" in imports  # imported inside a function: imported too
    assert "_deps" not in imports and "accelerate_cpu_fsdp" not in imports  # act on import
    assert script_env(EXAMPLES / "sentence_transformers_cached.py") == {"HF_HUB_OFFLINE": "1"}
    assert script_env(EXAMPLES / "trl_sft_aux.py") == {"HF_HUB_DISABLE_TELEMETRY": "1"}
    assert script_env(EXAMPLES / "hf_trainer.py") == {}
    batch = ExampleBatch([ExampleRun("hf_trainer.py", ("--ddp",)),
                          ExampleRun("trl_sft_aux.py", ("--ddp",)),
                          ExampleRun("quickstart.py", ())])
    assert [len(runs) for _, runs in batch._groups] == [2, 1]
