"""DeepSpeed ZeRO-3 backend, CPU/gloo, world size 2: the cases of
``tests/deepspeed/cases_deepspeed.py`` in one launch, the hpZ cases of
``tests/deepspeed/cases_deepspeed_hpz.py`` on 4 ranks, then the accelerate example with
``zero3.yaml`` and the report's ``deepspeed`` rows.

Skipped when deepspeed is not installed (it is an optional extra:
``DS_BUILD_OPS=0 pip install '.[deepspeed]'`` from a clone); CI runs it in its own venv.
"""

import importlib.util
import os

import pytest

pytest.importorskip("deepspeed", reason="deepspeed not installed (the deepspeed extra)")
pytest.importorskip("transformers", reason="the DeepSpeed cases use a tiny transformers Qwen2")

from tests.support import background  # noqa: E402
from tests.support.examples import (  # noqa: E402
    EXAMPLES, ExampleRun, accelerate_result, batched, early_accelerate, session_batch,
)
from tests.support.harness import case_tests  # noqa: E402


case_tests(globals(), "tests.deepspeed.cases_deepspeed", {"test_deepspeed": (2, 900)})
case_tests(globals(), "tests.real_stacks.cases_real_stacks_ds_kernels",
           {"test_real_stacks_ds_kernels": (2, 600)})
case_tests(globals(), "tests.deepspeed.cases_deepspeed_hpz", {"test_deepspeed_hpz": (4, 600)})


# The accelerate launches (accelerate's own launcher, what these tests test), started when
# the tests are collected, beside the case launches (tests/support/background.py).
_TRAIN = str(EXAMPLES / "accelerate" / "train.py")
if importlib.util.find_spec("accelerate") is not None:
    for _stage, _test in ((3, "test_accelerate_zero3_train"), (1, "test_accelerate_zero1_train")):
        early_accelerate(_test, f"accelerate zero{_stage}.yaml", f"zero{_stage}.yaml",
                         str(EXAMPLES / "accelerate_cpu_fsdp.py"), _TRAIN)
    early_accelerate("test_accelerate_zero3_refuses_cpu_without_shim",
                     "accelerate zero3.yaml, no shim", "zero3.yaml", _TRAIN)


def _accelerate_deepspeed_train(stage: int, clip: str) -> None:
    """accelerate launch zero{stage}.yaml (2 CPU ranks via the shim), gradient accumulation 2
    inside accelerator.accumulate, fsdp_retain.integrations.accelerate.retaining: the engine
    steps after the block at the boundary (8 steps)."""
    pytest.importorskip("accelerate", reason="the accelerate example needs accelerate")
    from tests.docs.test_examples import _check_ok, _number

    out = _check_ok(accelerate_result(f"accelerate zero{stage}.yaml"))
    assert (
        f"accelerate: DEEPSPEED (zero_stage {stage}), 2 processes on cpu, "
        "gradient_accumulation_steps 2; model Net"
    ) in out, out
    assert _number(r"replay after (\d+) optimizer steps", out) == 8
    assert _number(r"optimizer steps" + clip + r": (\S+)", out) <= 1e-4


def test_accelerate_zero3_train():
    """accelerate launch zero3.yaml (2 CPU ranks via the shim), gradient accumulation 2."""
    _accelerate_deepspeed_train(3, "")


def test_accelerate_zero1_train():
    """accelerate launch zero1.yaml: ZeRO-1 with accumulate() (DeepSpeed's no_sync off the
    boundary, where the example's step used to be refused), clipping from the DeepSpeed
    config; the replay clips the same."""
    _accelerate_deepspeed_train(1, ", clipped to 0.05")


def test_accelerate_zero3_refuses_cpu_without_shim():
    """On CPU accelerate gives every DeepSpeed rank a world of its own; the example refuses."""
    pytest.importorskip("accelerate", reason="the accelerate example needs accelerate")
    proc = accelerate_result("accelerate zero3.yaml, no shim")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    assert "error: accelerate set up DEEPSPEED with 1 process(es)" in out, out[-4000:]
    assert "agreement" not in proc.stdout


@background.starts_early("zero3_report_run")
def _start_report() -> background.BackgroundRun:
    from tests.report.report_runs import start_report

    return start_report("report_zero3_", backends=("deepspeed",), size="tiny", warmup=1,
                        steps=3, timeout=600, command="tests/deepspeed/test_deepspeed.py")


@pytest.fixture
def zero3_report_run():
    from tests.report.report_runs import taken

    with taken("zero3_report_run") as run:
        yield run


def test_report_zero3_rows(zero3_report_run):
    """The report's deepspeed backend: memory and collectives per mode; plain DeepSpeed fails.
    Its run starts when the tests are collected (tests/report/report_runs.py)."""
    from tests.report.report_runs import returned_report

    rows = {r["label"]: r for r in returned_report(zero3_report_run[0])["rows"]}
    assert "size of tensor a (0)" in rows["naive"]["error"], rows["naive"]
    for label in ("two_forward", "keep:every", "keep:last", "probe:every", "regather:every"):
        assert rows[label]["ok"], rows[label]
        assert rows[label]["peak_bytes"] > 0, rows[label]
    ok = [label for label in rows if label != "naive"]
    gathers = {label: rows[label]["all_gathers_per_step"] for label in ok}
    reduces = {label: rows[label]["reduce_scatters_per_step"] for label in ok}
    # ZeRO-3 prefetches the whole (tiny) model in one coalesced all-gather per forward.
    assert gathers["two_forward"] == 2 * gathers["keep:every"] > 0, gathers
    assert gathers["regather:every"] > gathers["two_forward"], gathers
    assert reduces["keep:every"] == 2 * reduces["keep:last"] == reduces["two_forward"], reduces
    assert reduces["probe:every"] == reduces["keep:last"], reduces


# One run per stage, each with one more of the Trainer's settings: clipping (the
# engine's gradient_clipping, "auto" from max_grad_norm) on ZeRO-0/1, bf16 (the engine's
# bf16 with fp32 master weights) with clipping on ZeRO-2, bf16 on ZeRO-3. fp32 ZeRO-2/3
# run in test_sentence_transformers' cached-loss cases and by hand (docs/integrations).
HF_TRAINER_DS = {
    0: ("--max-grad-norm", "0.05"),
    1: ("--max-grad-norm", "0.05"),
    2: ("--bf16", "--max-grad-norm", "0.2", "--lr", "0.5"),
    3: ("--bf16", "--lr", "0.5"),
}


def _hf_trainer_ds(stage):
    """The run (the session's batch runs it, tests/support/examples.py)."""
    return ExampleRun("hf_trainer.py", ("--deepspeed", str(stage), *HF_TRAINER_DS[stage]))


def _hf_trainer_ds_plain(stage):
    return ExampleRun("hf_trainer.py", ("--deepspeed", str(stage), "--no-library"),
                      count_blocks=False)


@pytest.mark.parametrize("stage", sorted(HF_TRAINER_DS))
@batched(_hf_trainer_ds)
def test_hf_trainer_deepspeed(stage):
    """examples/hf_trainer.py --deepspeed STAGE: the Trainer's own deepspeed= config (2 CPU
    ranks through examples/accelerate_cpu_fsdp.py), a two-backward training_step under the
    Trainer integration (RetainTrainerMixin: the block around it, the engine's step after
    it), gradient accumulation 2, 3 steps, clipping or bf16 (HF_TRAINER_DS): parity with
    a one-process replay (fp32: 1e-5; bf16: 3% of the largest update: by hand, 1.3%,
    as for the two losses summed in one backward, and 75% without the block). Collectives per block: ZeRO-0/1 reduce nothing off the boundary and once per
    pass at it; ZeRO-2 one all-reduce per pass in every micro-batch (it partitions
    gradients); ZeRO-3 gathers what the first forward needs and reduce-scatters once per
    pass."""
    from tests.docs.test_examples import HF_TRAINER_CHECK, _blocks, _check_ok, _number

    out = _check_ok(session_batch().result(_hf_trainer_ds(stage)))
    assert (f"Trainer: DeepSpeed ZeRO-{stage} (DEEPSPEED), 2 processes on cpu, "
            "gradient_accumulation_steps 2; model DeepSpeedEngine") in out, out
    update = _number(r"largest update (\S+);", out)
    tolerance = 0.03 * update if "--bf16" in HF_TRAINER_DS[stage] else 1e-5
    assert _number(r"PARITY max_diff=(\S+)", out) <= tolerance
    assert update > 1e-4
    # Each block also holds the example's own gather and reduce for its check.
    blocks = [{k: v - HF_TRAINER_CHECK.get(k, 0) for k, v in b.items()} for b in _blocks(out)]
    assert len(blocks) == 6 and all(b["passes"] == 2 for b in blocks), blocks
    per_pass = {"passes": 2, "all_gather": 0, "reduce_scatter": 0, "all_reduce": 2}
    if stage < 2:  # off the boundary (micro-batches 1, 3, 5) no reduction
        assert blocks[1::2] == [per_pass] * 3, blocks
        assert blocks[0::2] == [dict(per_pass, all_reduce=0)] * 3, blocks
    elif stage == 2:
        assert blocks == [per_pass] * 6, blocks
    else:  # the first forward gathers every module; small parameters then persist
        assert blocks[0]["all_gather"] > 0, blocks
        per_pass = dict(per_pass, reduce_scatter=2, all_reduce=0)
        assert blocks[1:] == [per_pass] * 5, blocks


@pytest.mark.parametrize("stage", [2, 3])
@batched(_hf_trainer_ds_plain)
def test_hf_trainer_deepspeed_plain(stage):
    """--deepspeed STAGE --no-library: the same training_step without the integration:
    accelerate steps the engine after the first pass's backward, so ZeRO-2 ends away from
    the replay, and ZeRO-3's second pass finds its parameters released."""
    from tests.docs.test_examples import _number

    proc = session_batch().result(_hf_trainer_ds_plain(stage))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    if stage == 2:
        assert "agreement: FAILED" in proc.stdout, out[-4000:]
        assert _number(r"PARITY max_diff=(\S+)", proc.stdout) > 1e-4
    else:
        assert "size of tensor a (0)" in out and "agreement" not in proc.stdout, out[-4000:]


@background.starts_early("kit_stacks_run")
def _start_kit_stacks() -> background.BackgroundRun:
    """The kit's stacks stage, started when the tests are collected: one rank's processes
    one after another, beside the case launches (tests/support/background.py)."""
    import sys
    import tempfile
    from pathlib import Path

    from tests.support.harness import ROOT

    folder = Path(tempfile.mkdtemp(prefix="gpu_validate_ds_"))
    return background.BackgroundRun(
        ["bash", str(ROOT / "scripts" / "gpu_validate.sh"), "--dry-run", "--nproc", "1",
         "--out", str(folder / "results"), "--stage", "stacks", "summary"],
        payload=folder, cwd=ROOT, env=dict(os.environ, PYTHON=sys.executable))


@pytest.fixture
def kit_stacks_run():
    from tests.support.harness import timeout_scale

    with background.taken("kit_stacks_run", 600 * timeout_scale()) as (proc, folder):
        yield proc, folder / "results"


def test_gpu_kit_stacks_stage_with_deepspeed(kit_stacks_run):
    """The GPU kit's stacks stage where deepspeed is installed (the default venv's dry run,
    tests/repo/test_gpu_validate.py, has none): a dry run on one CPU rank runs the DDP and
    ZeRO-2/3 parity cases of tests/repo/cases_device_stacks.py and the report's ddp and
    deepspeed runs, each with its one_pass row against one_backward."""
    import json

    proc, out = kit_stacks_run
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    parity = json.loads((out / "stacks_parity.json").read_text())
    assert parity["failed"] == parity["skipped"] == 0 and parity["passed"] == 6, parity
    assert json.loads((out / "stacks.json").read_text())["deepspeed"].startswith("deepspeed was")
    one_pass = json.loads((out / "summary.json").read_text())["one_pass"]
    assert set(one_pass) == {"ddp", "deepspeed"}, one_pass


def test_ci_venv_builds_no_shm_op():
    """CI's DeepSpeed venv (scripts/venv_ci.sh) imports scripts/deepspeed_no_shm_op.py in every
    process: DeepSpeed's own probe lists its CPU shm all-reduce op as buildable, the hook
    marks it not, so ``build_shm_op`` returns None; and none of the launches before this test
    (ZeRO-0..3 cases, accelerate, the report, the GPU kit's stacks stage) built it."""
    import importlib.util
    import os
    import subprocess
    import sys

    from tests.support.harness import ROOT

    if importlib.util.find_spec("fsdp_retain_ci_no_shm_op") is None:
        pytest.skip("not CI's DeepSpeed venv (scripts/venv_ci.sh deepspeed installs the hook)")
    code = (
        "import sys, deepspeed.ops\n"
        "from deepspeed.comm.torch import build_shm_op\n"
        "assert 'fsdp_retain_ci_no_shm_op' in sys.modules\n"
        "print(deepspeed.ops._probe_compatible_ops()['deepspeed_shm_comm'],\n"
        "      deepspeed.ops.__compatible_ops__['deepspeed_shm_comm'], build_shm_op())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.split()[-3:] == ["True", "False", "None"], proc.stdout
    extensions = os.environ.get("TORCH_EXTENSIONS_DIR")
    if extensions and os.path.isdir(extensions):
        assert not [d for d in os.listdir(extensions) if "shm" in d], os.listdir(extensions)
