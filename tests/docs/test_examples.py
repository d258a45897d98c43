"""The examples users copy, run as subprocesses on 2 CPU ranks (gloo), and their refusals.

Each example asserts its own agreement check and exits non-zero on disagreement;
these tests run them as subprocesses (``torchrun`` / ``accelerate launch``) and
check the exit code and the printed figures. The runs a test names (``batched``) share
the session's batch (tests/support/examples.py): each run is a process of its own, forked
after the shared imports, with the output, exit status and arguments it would have had
alone. ``CUDA_VISIBLE_DEVICES`` is empty,
so they take the CPU path on any machine. They run through
``tests/support/count_blocks.py``, which prints the collectives of every
``no_reshard_between_backwards`` block, checked against formulas below (under
FSDP2 a retained graph also works without this library, only with more
all-gathers, so agreement alone would not show that the block did anything).

- quickstart.py, FSDP2 and FSDP1: parameters and the first loss's gradient norm
  match the two-forward way; one all-gather per FSDP unit per step.
- multi_objective.py, FSDP2 and FSDP1: PCGrad (and torchjd's UPGrad on FSDP2) over
  3 tasks with ``block.grads`` and one forward matches a forward per task; one reduce-scatter per unit per task and
  one all-reduce (the Gramian) per step.
- accelerate/train.py with fsdp2.yaml and fsdp1.yaml, through
  ``examples/accelerate_cpu_fsdp.py`` (accelerate's FSDP setup on CPU; see its
  docstring): accelerate really wrapped the model (FSDP version, device, wrapper
  class and unit count printed by the script) and training with gradient
  accumulation 2 matches an unsharded single-process replay, which divides each
  loss by the accumulation steps itself; micro-batches inside
  ``accelerator.accumulate`` that do not sync reduce-scatter nothing.
- accelerate/train.py with ddp.yaml and ``ACCELERATE_USE_CPU=1`` (DDP, no shim):
  matches the replay; the block all-reduces DDP's one bucket per pass of a syncing
  micro-batch and nothing on the others.
- accelerate/train.py launched without the shim (accelerate falls back to
  independent processes): it refuses; with ``accelerate launch --cpu
  --num_processes 2`` (one process): it says so.
- hf_trainer.py (a transformers ``Trainer`` subclass, tiny Qwen2), FSDP2 and FSDP1
  from the Trainer's own fsdp arguments (through ``examples/accelerate_cpu_fsdp.py``),
  gradient accumulation 2: parity with a one-process replay over 3 steps; one
  all-gather per unit per micro-batch. Without the block FSDP1 fails. ``--ddp`` (the
  Trainer's own DDP, ``use_cpu=True``): parity with the block, and all-reduces counted
  per pass; without it the parameters end away from the replay.
- influence_trace.py at tiny size, FSDP2 and FSDP1, ``--mode both`` (2
  micro-batches per step, the first without gradient sync, backward 1 a probe
  pass): gradient projections and final parameters agree between the two
  ways; one all-gather per FSDP unit per micro-batch and one reduce-scatter
  per unit per step.
- chunked_ce.py (torchtitan's chunked cross-entropy), FSDP2 and FSDP1, with the block
  and without (``--no-library``): every way matches a one-process model trained on the
  unchunked loss to 1e-6 over 3 steps; with the block one all-gather and one
  reduce-scatter per unit per step (the lm_head's once, not once per chunk), without it
  two all-gathers and one reduce-scatter of the lm_head per chunk; ``keep_unsharded``
  a budget of the lm_head's bytes, and False, on FSDP2. Run without
  ``tests/support/count_blocks.py``: torch's ``CommDebugMode`` fails on a module that runs its
  forward once per chunk, so the example counts with a dispatch mode of its own.
- mtp_heads.py (multi-token prediction heads over one trunk), FSDP2 and FSDP1: with
  the block, parity with one backward of the summed loss and U all-gathers and U
  reduce-scatters per step (also counted by ``tests/support/count_blocks.py``); with
  ``--head-norms`` (``block.grads`` per head) each head's gradient norm matches the
  reference's; without the block FSDP2 re-gathers and reduces the trunk in every head's
  backward, and FSDP1 fails in the second.
- tiled_mlp.py (a tiled MLP as axolotl and Liger patch it: a backward per tile inside
  the backward), FSDP2 with each MLP its own unit and FSDP1: with the block, parity with
  the untiled model and one all-gather and one reduce-scatter per unit per step; plain
  FSDP1 fails in the second tile (its post-backward hook freed the parameters).
- An example whose package is missing (an ImportError shim on ``PYTHONPATH``) says
  so once, naming what installs it, before any rank starts work.
- The influence example's ``GradientProjector`` against per-sequence gradients
  computed one sequence at a time (in this process, no FSDP).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from tests.support.examples import (
    COUNT_BLOCKS, EXAMPLES, TIMEOUT, ExampleBatch, ExampleRun, accelerate_result, batched,
    early_accelerate, session_batch,
)
from tests.support.examples import free_port as _free_port
from tests.support.examples import run as _run
from tests.support.examples import torchrun as _torchrun
from tests.support.harness import ROOT, run_retrying_exit_abort

CPU_FSDP = str(ROOT / "examples" / "accelerate_cpu_fsdp.py")

@pytest.fixture(scope="module")
def example_batch() -> ExampleBatch:
    """The session's batch (tests/support/examples.py): the selected tests' planned runs."""
    return session_batch()


ACCELERATE_TRAIN = str(EXAMPLES / "accelerate" / "train.py")
# The accelerate launches (accelerate's own launcher: what these tests test), started when
# the tests are collected, beside the case launches.
for _config in ("fsdp2.yaml", "fsdp1.yaml"):
    early_accelerate("test_accelerate_train", f"accelerate {_config}", _config, CPU_FSDP,
                     COUNT_BLOCKS, ACCELERATE_TRAIN)
early_accelerate("test_accelerate_train_ddp", "accelerate ddp.yaml", "ddp.yaml", COUNT_BLOCKS,
                 ACCELERATE_TRAIN, env={"ACCELERATE_USE_CPU": "1"})
early_accelerate("test_accelerate_train_refuses_no_accelerator",
                 "accelerate fsdp2.yaml, no shim", "fsdp2.yaml", ACCELERATE_TRAIN)


def _number(pattern: str, out: str) -> float:
    match = re.search(pattern, out)
    assert match, f"no line matching {pattern!r} in the output"
    return float(match.group(1))


def _blocks(out: str) -> list[dict[str, int]]:
    """The per-block collective counts printed by tests/support/count_blocks.py (rank 0)."""
    lines = re.findall(r"\[count_blocks\] (.*)", out)
    return [{k: int(v) for k, v in (kv.split("=") for kv in line.split())} for line in lines]


def _steps(out: str) -> list[dict[str, int]]:
    """The per-step collective counts chunked_ce.py and mtp_heads.py print (rank 0)."""
    lines = re.findall(r"^step \d+: loss \S+ (.*)$", out, re.M)
    return [{k: int(v) for k, v in (kv.split("=") for kv in line.split())} for line in lines]


def _check_ok(proc: subprocess.CompletedProcess) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{out[-6000:]}"
    assert "agreement: OK" in proc.stdout, out[-6000:]
    return proc.stdout


QUICKSTART_STEPS = 6


def _quickstart(fsdp):
    return ExampleRun("quickstart.py", ("--fsdp", str(fsdp), "--steps", str(QUICKSTART_STEPS),
                                        "--warmup", "1"))


@pytest.mark.parametrize("fsdp", [2, 1])
@batched(_quickstart)
def test_quickstart(fsdp, example_batch):
    """quickstart.py --fsdp {2,1} (4 blocks + root), 2 CPU ranks: retain way == two-forward way.
    (The README's command itself, through torchrun: the next test.)"""
    steps, units = QUICKSTART_STEPS, 4 + 1
    out = _check_ok(example_batch.result(_quickstart(fsdp)))
    assert f"FSDP{fsdp}, 2 ranks, cpu" in out
    assert _number(r"max \|param difference\| vs two-forward: (\S+)", out) <= 1e-4
    assert _number(r"grad norm: (\S+)", out) <= 1e-4
    assert _number(r"speedup (\S+)x", out) > 0  # timing under count_blocks is not meaningful
    # keep_unsharded=True, sync_grads="every", 2 passes: U all-gathers, 2U reduce-scatters,
    # and the all-reduce of the gradient norm the example takes between the passes.
    expected = {"passes": 2, "all_gather": units, "reduce_scatter": 2 * units, "all_reduce": 1}
    assert _blocks(out) == [expected] * steps


def test_quickstart_first_screen_is_the_examples_own():
    """The README's quick-start command, as written (its OMP_NUM_THREADS=1 included, the
    rest of the environment without one): every line it prints, on stdout or stderr, is
    one of the example's own. Without OMP_NUM_THREADS torchrun prints a 4-line banner;
    without numpy torch warns "Failed to initialize NumPy" once per rank."""
    import shlex

    readme = (ROOT / "README.md").read_text()
    (command,) = [line for line in readme.splitlines() if line.endswith("examples/quickstart.py")
                  and "pip install" in line]
    words = shlex.split(command.rsplit("&& ", 1)[1])
    assignments = [w for w in words if "=" in w and not w.startswith("-")]
    program = words[len(assignments):]
    assert program[0] == ".venv/bin/torchrun", command
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(w.split("=", 1) for w in assignments)
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), *program[1:]]
    proc = run_retrying_exit_abort(cmd, cwd=ROOT, env=env, timeout=TIMEOUT)
    out = _check_ok(proc)
    own = re.compile(r"FSDP2, 2 ranks, cpu, |max \|param difference\| vs two-forward: |max "
                     r"relative difference of the task-loss grad norm: |median step: "
                     r"|agreement: OK$")
    lines = [line for line in (out + proc.stderr).splitlines() if line.strip()]
    assert lines and all(own.match(line) for line in lines), proc.stdout + proc.stderr


MULTI_OBJECTIVE_STEPS = 4


def _multi_objective(fsdp, method, shared):
    args = ("--fsdp", str(fsdp), "--steps", str(MULTI_OBJECTIVE_STEPS), "--warmup", "1",
            "--method", method)
    return ExampleRun("multi_objective.py", args + (("--shared-only",) if shared else ()))


@pytest.mark.parametrize(
    "fsdp, method, shared",
    [(2, "pcgrad", False), (1, "pcgrad", False), (2, "upgrad", False), (2, "upgrad", True),
     (1, "pcgrad", True)],
)
@batched(_multi_objective)
def test_multi_objective(fsdp, method, shared, example_batch):
    """multi_objective.py --fsdp {2,1} --method {pcgrad,upgrad} [--shared-only] (4 blocks
    + root, 3 tasks), 2 CPU ranks: one forward with block.grads per task == a forward per
    task; with --shared-only the method weighs the trunk's gradients and each head gets
    its own task's (torchjd's mtl_backward; tests/loss_grads/cases_loss_grads_stacks.py checks the
    library against torchjd itself)."""
    if method == "upgrad":
        pytest.importorskip("torchjd", reason="the mtl extra (in the test extra)")
    steps, units, tasks = MULTI_OBJECTIVE_STEPS, 4 + 1, 3
    out = _check_ok(example_batch.result(_multi_objective(fsdp, method, shared)))
    assert f"FSDP{fsdp}, 2 ranks, cpu, {tasks} tasks" in out
    assert ("weighing the shared trunk only" in out) == shared, out
    assert _number(r"max \|param difference\| vs 3 forwards: (\S+)", out) <= 1e-4
    # keep_unsharded=True: U all-gathers; one reduce-scatter per unit per task; the
    # Gramian's one all-reduce.
    expected = {"passes": tasks, "all_gather": units, "reduce_scatter": tasks * units,
                "all_reduce": 1}
    assert _blocks(out) == [expected] * steps


FROM_CLONE = "from a clone of this repository: pip install '.[{}]'"
MISSING = [  # script, its arguments, the package hidden, how the message says to install it
    ("multi_objective.py", ["--method", "upgrad"], "torchjd", f" {FROM_CLONE.format('mtl')}"),
    ("hf_trainer.py", [], "transformers", f" {FROM_CLONE.format('examples')}"),
    ("influence_trace.py", ["--size", "tiny"], "transformers", f" {FROM_CLONE.format('examples')}"),
    ("influence_bergson.py", [], "bergson",
     ": pip install bergson==2.5.1 (docs/integrations/bergson.md)"),
    ("lightning_manual.py", [], "lightning", f" {FROM_CLONE.format('lightning')}"),
]


@pytest.mark.parametrize("script, args, hidden, install", MISSING,
                         ids=[m[0].removesuffix(".py") for m in MISSING])
def test_missing_package_named_up_front(tmp_path, script, args, hidden, install):
    """An example whose package is missing (an import of it fails here) says so once,
    naming what installs it, before any rank starts work: no ImportError traceback on
    every rank, no abort."""
    (tmp_path / hidden).mkdir()
    (tmp_path / hidden / "__init__.py").write_text('raise ImportError("hidden by the test")')
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    if script == "lightning_manual.py":  # Lightning starts its ranks itself
        proc = _run([sys.executable, str(EXAMPLES / script), *args], env)
    else:
        proc = _torchrun(script, *args, count_blocks=False, env=env, via_torchrun=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    why = f"examples/{script}" + (" --method upgrad" if args[:1] == ["--method"] else "")
    message = f"error: {why} needs {hidden}, which is not installed. Install it{install}\n"
    assert out.count(message) == 1, out[-4000:]
    assert "hidden by the test" not in out and "SIGABRT" not in out, out[-4000:]
    assert "agreement" not in proc.stdout


@pytest.mark.skipif(importlib.util.find_spec("sentence_transformers") is not None,
                    reason="sentence-transformers is installed (tests/clients/test_sentence_transformers.py)")
def test_sentence_transformers_example_names_its_extra():
    """examples/sentence_transformers_cached.py where sentence-transformers is missing (the
    default venv): one message naming the st extra, before any rank starts work."""
    proc = _torchrun("sentence_transformers_cached.py", count_blocks=False, via_torchrun=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    assert out.count("error: examples/sentence_transformers_cached.py needs sentence_transformers") == 1, out[-4000:]
    assert f" {FROM_CLONE.format('st')}" in out, out[-4000:]
    assert "ModuleNotFoundError" not in out and "agreement" not in proc.stdout, out[-4000:]


@pytest.mark.parametrize(
    "config, version, wrapper",
    [("fsdp2.yaml", 2, "FSDPNet"), ("fsdp1.yaml", 1, "FullyShardedDataParallel")],
)
def test_accelerate_train(config, version, wrapper):
    """accelerate launch (fsdp{2,1}.yaml, 2 CPU ranks via the shim), gradient accumulation 2."""
    out = _check_ok(accelerate_result(f"accelerate {config}"))
    # accelerate wrapped the model itself: 3 Blocks from the config's wrap policy + the root.
    units = 3 + 1
    assert (
        f"accelerate: FSDP (fsdp_version {version}), 2 processes on cpu, "
        f"gradient_accumulation_steps 2; model {wrapper} with {units} FSDP units"
    ) in out, out
    # 128 samples / (8 per process * 2 processes) = 8 micro-batches per epoch, 2 epochs.
    micro_batches, accumulation = 16, 2
    assert _number(r"replay after (\d+) optimizer steps", out) == micro_batches // accumulation
    assert _number(r"optimizer steps: (\S+)", out) <= 1e-4
    # One all-gather per unit per micro-batch; accumulate's no_sync micro-batches
    # reduce-scatter nothing, the syncing one once per unit per backward (2 passes).
    no_sync = {"passes": 2, "all_gather": units, "reduce_scatter": 0, "all_reduce": 0}
    sync = dict(no_sync, reduce_scatter=2 * units)
    assert _blocks(out) == [no_sync, sync] * (micro_batches // accumulation)


def test_accelerate_train_ddp():
    """ACCELERATE_USE_CPU=1 accelerate launch (ddp.yaml, 2 CPU ranks, no shim): accelerate
    wraps the model in DDP (MULTI_CPU), gradient accumulation 2; the block all-reduces
    both passes of every syncing micro-batch, and training matches an unwrapped
    single-process replay."""
    out = _check_ok(accelerate_result("accelerate ddp.yaml"))
    assert ("accelerate: DDP (MULTI_CPU), 2 processes on cpu, gradient_accumulation_steps 2; "
            "model DistributedDataParallel around Net") in out, out
    micro_batches, accumulation = 16, 2
    assert _number(r"replay after (\d+) optimizer steps", out) == micro_batches // accumulation
    assert _number(r"optimizer steps: (\S+)", out) <= 1e-4
    # Net's ~0.4 MB of parameters are one DDP bucket. accumulate's no_sync micro-batches
    # all-reduce nothing; the syncing one one bucket per pass (sync_grads="every").
    buckets = 1
    no_sync = {"passes": 2, "all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    sync = dict(no_sync, all_reduce=2 * buckets)
    assert _blocks(out) == [no_sync, sync] * (micro_batches // accumulation)


def test_accelerate_train_refuses_no_accelerator():
    """No accelerator, no ACCELERATE_USE_CPU: accelerate falls back to independent
    processes (NO); the example refuses, naming the commands that work."""
    proc = accelerate_result("accelerate fsdp2.yaml, no shim")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    assert "error: accelerate set up NO with 1 process(es)" in out, out[-4000:]
    assert "not FSDP, DeepSpeed or DDP" in out
    # Said once (by rank 0), with the CPU commands that work.
    assert out.count("error: accelerate set up") == 1, out[-4000:]
    assert ("accelerate launch --config_file examples/accelerate/fsdp2.yaml "
            "examples/accelerate_cpu_fsdp.py examples/accelerate/train.py") in out
    assert ("ACCELERATE_USE_CPU=1 accelerate launch --config_file examples/accelerate/ddp.yaml "
            "examples/accelerate/train.py") in out
    assert "agreement" not in proc.stdout


def test_accelerate_train_says_one_process():
    """accelerate launch --cpu --num_processes 2 starts one process: the example says so."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2"]
    proc = _run(cmd + [str(EXAMPLES / "accelerate" / "train.py")])
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    assert "error: accelerate launch started 1 process: with --cpu" in out, out[-4000:]
    assert ("accelerate launch --config_file examples/accelerate/fsdp2.yaml "
            "examples/accelerate_cpu_fsdp.py examples/accelerate/train.py") in out
    assert "agreement" not in proc.stdout


HF_TRAINER_STEPS = 3


def _hf_trainer(fsdp):
    return ExampleRun("hf_trainer.py", ("--fsdp", str(fsdp), "--steps", str(HF_TRAINER_STEPS)))


def _hf_trainer_plain_fsdp1():
    return ExampleRun("hf_trainer.py", ("--fsdp", "1", "--no-library"), count_blocks=False)


def _hf_trainer_ddp(library):
    args = ("--ddp", "--steps", str(HF_TRAINER_STEPS)) + (() if library else ("--no-library",))
    return ExampleRun("hf_trainer.py", args, count_blocks=library)


# hf_trainer.py's own collectives in each training_step, for its check at the end: the
# batch gathered and the loss reduced over the ranks (inside the integration's block).
HF_TRAINER_CHECK = {"all_gather": 1, "all_reduce": 1}


@pytest.mark.parametrize("fsdp, wrapper, units", [
    # FSDP2 (accelerate 1.15): the embedding, each decoder layer and [final norm, lm_head]
    # are parameter groups, the root holds none; FSDP1: each decoder layer and the root.
    (2, "FSDPQwen2ForCausalLM with 6 FSDP modules", 4),
    (1, "FullyShardedDataParallel with 3 FSDP modules", 3),
], ids=["fsdp2", "fsdp1"])
@batched(_hf_trainer)
def test_hf_trainer(fsdp, wrapper, units, example_batch):
    """hf_trainer.py --fsdp {2,1}: a transformers Trainer (tiny Qwen2, FSDP from its fsdp
    arguments, on 2 CPU ranks through examples/accelerate_cpu_fsdp.py), training_step with
    two backward passes, gradient accumulation 2, 3 steps: parity with a one-process replay."""
    steps, accumulation = HF_TRAINER_STEPS, 2
    out = _check_ok(example_batch.result(_hf_trainer(fsdp)))
    assert (f"Trainer: FSDP (fsdp_version {fsdp}), 2 processes on cpu, "
            f"gradient_accumulation_steps {accumulation}; model {wrapper}") in out, out
    assert len(re.findall(r"^step \d: loss \S+, unsharded replay \S+$", out, re.M)) == steps
    assert _number(r"PARITY max_diff=(\S+)", out) <= 1e-5
    assert _number(r"largest update (\S+);", out) > 1e-3
    # One all-gather per unit per micro-batch; the Trainer's no_sync micro-batch
    # reduce-scatters nothing, the syncing one once per unit per backward (2 passes). The
    # integration's block holds the whole training_step: the example's own gather of the
    # batch and reduce of the loss for its check too.
    no_sync = {"passes": 2, "all_gather": units + HF_TRAINER_CHECK["all_gather"],
               "reduce_scatter": 0, "all_reduce": HF_TRAINER_CHECK["all_reduce"]}
    assert _blocks(out) == [no_sync, dict(no_sync, reduce_scatter=2 * units)] * steps


@batched(_hf_trainer_plain_fsdp1)
def test_hf_trainer_plain_fsdp1_fails(example_batch):
    """hf_trainer.py --fsdp 1 --no-library: the second backward needs parameters the
    first one freed."""
    proc = example_batch.result(_hf_trainer_plain_fsdp1())
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    assert "setStorage" in out and "out of bounds for storage of size 0" in out, out[-4000:]
    assert "agreement" not in proc.stdout


@pytest.mark.parametrize("library", [True, False], ids=["block", "plain"])
@batched(_hf_trainer_ddp)
def test_hf_trainer_ddp(library, example_batch):
    """hf_trainer.py --ddp (no fsdp arguments, use_cpu=True: the Trainer wraps the model in
    DDP, find_unused_parameters=True), gradient accumulation 2, 3 steps: with the block,
    parity with a one-process replay; without it, DDP all-reduces only the first backward
    and the parameters end away from the replay (~1e-4 here: the z-loss is small)."""
    accumulation = 2
    proc = example_batch.result(_hf_trainer_ddp(library))
    out = proc.stdout + proc.stderr
    assert (f"Trainer: DDP (MULTI_CPU), 2 processes on cpu, gradient_accumulation_steps "
            f"{accumulation}; model DistributedDataParallel around Qwen2ForCausalLM"
            ) in proc.stdout, out[-4000:]
    if library:
        _check_ok(proc)
        assert _number(r"PARITY max_diff=(\S+)", out) <= 1e-5
        assert _number(r"largest update (\S+);", out) > 1e-3
        # The tiny Qwen2 is one DDP bucket; the Trainer's no_sync micro-batch all-reduces
        # nothing, the syncing one per pass the bucket and DDP's used-parameter map.
        buckets, used_map = 1, 1
        no_sync = {"passes": 2, "reduce_scatter": 0, **HF_TRAINER_CHECK}
        sync = dict(no_sync, all_reduce=2 * (buckets + used_map) + HF_TRAINER_CHECK["all_reduce"])
        assert _blocks(out) == [no_sync, sync] * HF_TRAINER_STEPS
    else:
        assert proc.returncode != 0, out[-4000:]
        assert _number(r"PARITY max_diff=(\S+)", proc.stdout) > 1e-5
        assert "agreement: FAILED" in proc.stdout


INFLUENCE_STEPS = 6


def _influence_trace(fsdp):
    return ExampleRun("influence_trace.py",
                      ("--size", "tiny", "--fsdp", str(fsdp), "--steps", str(INFLUENCE_STEPS)))


@pytest.mark.parametrize("fsdp", [2, 1])
@batched(_influence_trace)
def test_influence_trace(fsdp, example_batch):
    """influence_trace.py --size tiny (2 layers + root) --mode both --fsdp {2,1}, 2 CPU ranks,
    2 micro-batches per step."""
    steps, units = INFLUENCE_STEPS, 2 + 1
    out = _check_ok(example_batch.result(_influence_trace(fsdp)))
    assert f"FSDP{fsdp}, 2 ranks, cpu, float32" in out
    assert _number(r"projections: max relative difference retain vs two_forward (\S+)", out) <= 1e-4
    diff = _number(r"max \|difference\| (\S+)", out)
    update = _number(r"largest update (\S+)\)", out)
    assert update > 0 and diff <= 1e-4 * update
    assert re.search(r"forward 2\s+\S+\s+-", out), "retain must not run a second forward"
    assert re.search(r"retain saves -?\d+% of the step", out)
    # One block per micro-batch (2 per step), each a probe pass and a normal pass
    # with keep_unsharded=True: U all-gathers; the probe pass reduces nothing, so
    # U reduce-scatters in the micro-batch that syncs and none in the no-sync one.
    no_sync = {"passes": 2, "all_gather": units, "reduce_scatter": 0, "all_reduce": 0}
    synced = {"passes": 2, "all_gather": units, "reduce_scatter": units, "all_reduce": 0}
    assert _blocks(out) == [no_sync, synced] * steps


CHUNKED_STEPS = 3


def _chunked_ce(fsdp, chunks, library):
    args = ("--fsdp", str(fsdp), "--chunks", str(chunks), "--steps", str(CHUNKED_STEPS))
    return ExampleRun("chunked_ce.py", args + (() if library else ("--no-library",)),
                      count_blocks=False)


@pytest.mark.parametrize("library", [True, False], ids=["block", "plain"])
@pytest.mark.parametrize("fsdp, chunks", [(2, 4), (1, 3)])
@batched(_chunked_ce)
def test_chunked_ce(fsdp, chunks, library, example_batch):
    """chunked_ce.py --fsdp {2,1} --chunks k (3 blocks + lm_head + root), 2 CPU ranks, with
    the block (sync_grads="last", backwards=k + 1) and without it (--no-library)."""
    steps, units = CHUNKED_STEPS, 3 + 2
    out = _check_ok(example_batch.result(_chunked_ce(fsdp, chunks, library)))
    mode = "block (keep_unsharded=True)" if library else "plain"
    assert f"FSDP{fsdp}, 2 ranks, cpu, {mode}, {chunks} chunks" in out
    assert _number(r"PARITY max_diff=(\S+)", out) < 1e-6
    if library:
        # keep_unsharded=True, sync_grads="last": one all-gather and one reduce-scatter
        # per unit per step, the lm_head's included, however many chunks.
        expected = {"all_gather": units, "reduce_scatter": units,
                    "lm_head_all_gather": 1, "lm_head_reduce_scatter": 1}
    else:
        # Each chunk is an iteration of its own for FSDP: the lm_head is gathered for its
        # forward and again for its backward, and reduced, per chunk; the trunk (U - 1
        # units) gathers in forward and again in backward, but FSDP1 keeps its root
        # gathered after forward.
        expected = {"all_gather": 2 * chunks + 2 * (units - 1) - (fsdp == 1),
                    "reduce_scatter": chunks + units - 1,
                    "lm_head_all_gather": 2 * chunks, "lm_head_reduce_scatter": chunks}
    assert _steps(out) == [expected] * steps


TILED_STEPS = 3


def _tiled_mlp(fsdp, mlp_units):
    args = ("--fsdp", str(fsdp), "--steps", str(TILED_STEPS))
    return ExampleRun("tiled_mlp.py", args + (("--mlp-units",) if mlp_units else ()),
                      count_blocks=False)


@pytest.mark.parametrize("fsdp, mlp_units", [(2, True), (1, False)])
@batched(_tiled_mlp)
def test_tiled_mlp(fsdp, mlp_units, example_batch):
    """tiled_mlp.py --fsdp {2,1} (4 tiles), 2 CPU ranks, with the block: parity with the
    untiled one-process model, one all-gather and one reduce-scatter per unit per step."""
    steps, units = TILED_STEPS, (2 * 2 if mlp_units else 2) + 1
    out = _check_ok(example_batch.result(_tiled_mlp(fsdp, mlp_units)))
    assert f"FSDP{fsdp}, 2 ranks, cpu, block, 4 tiles, {units} units" in out
    assert _number(r"PARITY max_diff=(\S+)", out) < 1e-6
    assert _steps(out) == [{"all_gather": units, "reduce_scatter": units}] * steps


def _tiled_mlp_plain_fsdp1():
    return ExampleRun("tiled_mlp.py", ("--fsdp", "1", "--no-library", "--steps", "1"),
                      count_blocks=False)


@batched(_tiled_mlp_plain_fsdp1)
def test_tiled_mlp_plain_fsdp1_fails(example_batch):
    """tiled_mlp.py --fsdp 1 --no-library: FSDP1's post-backward hook frees the block's
    parameters after the first tile's backward, the second tile computes with them."""
    proc = example_batch.result(_tiled_mlp_plain_fsdp1())
    assert proc.returncode != 0
    assert "RuntimeError: size mismatch" in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-4000:]


def _chunked_ce_keep(keep):
    return ExampleRun("chunked_ce.py", ("--keep-unsharded", keep, "--chunks", "4", "--steps",
                                        str(CHUNKED_STEPS)), count_blocks=False)


@pytest.mark.parametrize("keep", ["lm_head", "none"])
@batched(_chunked_ce_keep)
def test_chunked_ce_keep_unsharded(keep, example_batch):
    """chunked_ce.py --keep-unsharded {lm_head,none} --chunks 4, FSDP2, 2 CPU ranks: a
    budget of the lm_head's bytes keeps the lm_head gathered; False re-gathers it."""
    steps, blocks, chunks = CHUNKED_STEPS, 3, 4
    out = _check_ok(example_batch.result(_chunked_ce_keep(keep)))
    assert _number(r"PARITY max_diff=(\S+)", out) < 1e-6
    # The trunk's blocks gather in forward and again in backward, as plain FSDP2 does;
    # the root is gathered at every pass (k + 1), though no chunk goes through it; the
    # budget (12288 bytes: the root's 12544 do not fit) keeps the lm_head, False gathers
    # it for each chunk's forward and backward.
    lm_head = 1 if keep == "lm_head" else 2 * chunks
    expected = {"all_gather": 2 * blocks + (chunks + 1) + lm_head, "reduce_scatter": blocks + 2,
                "lm_head_all_gather": lm_head, "lm_head_reduce_scatter": 1}
    assert _steps(out) == [expected] * steps


MTP_STEPS, MTP_HEADS = 3, 3


def _mtp_heads(fsdp, norms):
    args = ("--fsdp", str(fsdp), "--heads", str(MTP_HEADS), "--steps", str(MTP_STEPS))
    return ExampleRun("mtp_heads.py", args + (("--head-norms",) if norms else ()))


@pytest.mark.parametrize("fsdp, norms", [(2, False), (1, True)], ids=["2-sum", "1-head_norms"])
@batched(_mtp_heads)
def test_mtp_heads(fsdp, norms, example_batch):
    """mtp_heads.py --fsdp 2 --heads 3 (3 blocks + 3 heads + root), 2 CPU ranks, with
    the block: sync_grads="last", backwards=3 (the trunk gathered and reduced once per
    step); --fsdp 1 --head-norms (block.grads per head, each head's gradient norm).
    The other two pairs: tests/loss_grads/cases_loss_grads.py (block.grads on FSDP2) and the
    sync_grads="last" grids of tests/fsdp1/cases_fsdp1_parity.py."""
    steps, layers, heads = MTP_STEPS, 3, MTP_HEADS
    units = layers + heads + 1
    out = _check_ok(example_batch.result(_mtp_heads(fsdp, norms)))
    mode = "block.grads" if norms else "block"
    assert f"FSDP{fsdp}, 2 ranks, cpu, {mode}, {heads} heads" in out
    assert _number(r"PARITY max_diff=(\S+)", out) < 1e-6
    if norms:
        # Against each head's gradient norm in the reference (a gradient of its own).
        assert _number(r"head gradient norms: max relative difference (\S+)", out) < 1e-5
        assert len(re.findall(r"^  head gradient norms: (?:\S+, ){2}\S+$", out, re.M)) == steps
    # keep_unsharded=True: U all-gathers. "last": one reduce-scatter per unit; block.grads
    # ("every"): each pass reduces the L + 2 units it reached, and the Gramian is one
    # all-reduce.
    reduce_scatter = heads * (layers + 2) if norms else units
    expected = {"all_gather": units, "reduce_scatter": reduce_scatter,
                "trunk_block_all_gather": layers,
                "trunk_block_reduce_scatter": layers * heads if norms else layers}
    assert _steps(out) == [expected] * steps
    # count_blocks' CommDebugMode agrees, and sees one pass per head.
    block = {"passes": heads, "all_gather": units, "reduce_scatter": reduce_scatter,
             "all_reduce": int(norms)}
    assert _blocks(out) == [block] * steps


def _mtp_heads_plain_fsdp2():
    return ExampleRun("mtp_heads.py", ("--heads", "4", "--steps", str(MTP_STEPS), "--no-library"),
                      count_blocks=False)


@batched(_mtp_heads_plain_fsdp2)
def test_mtp_heads_plain_fsdp2_regathers_the_trunk(example_batch):
    """mtp_heads.py --no-library --heads 4, FSDP2, 2 CPU ranks: right, but every head's
    backward all-gathers and reduce-scatters the trunk again."""
    steps, layers, heads = MTP_STEPS, 3, 4
    units = layers + heads + 1
    out = _check_ok(example_batch.result(_mtp_heads_plain_fsdp2()))
    assert _number(r"PARITY max_diff=(\S+)", out) < 1e-6
    # Each pass reduces the L + 2 units it goes through (trunk blocks, root, its head)
    # and, in the total, gathers as many: the forward's U, then L + 2 per pass (FSDP2
    # keeps the root gathered into the first pass, one fewer, and gathers one head once
    # more than its forward and backward need, one more).
    expected = {"all_gather": units + heads * (layers + 2), "reduce_scatter": heads * (layers + 2),
                "trunk_block_all_gather": layers * (heads + 1),
                "trunk_block_reduce_scatter": layers * heads}
    assert _steps(out) == [expected] * steps


def _mtp_heads_plain_fsdp1():
    return ExampleRun("mtp_heads.py", ("--fsdp", "1", "--no-library"), count_blocks=False)


@batched(_mtp_heads_plain_fsdp1)
def test_mtp_heads_plain_fsdp1_fails(example_batch):
    """mtp_heads.py --no-library --fsdp 1, 2 CPU ranks: the second head's backward needs
    parameters the first one freed."""
    proc = example_batch.result(_mtp_heads_plain_fsdp1())
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    assert "setStorage" in out and "out of bounds for storage of size 0" in out, out[-4000:]
    assert "agreement" not in proc.stdout


def _load_influence_trace():
    path = EXAMPLES / "influence_trace.py"
    spec = importlib.util.spec_from_file_location("influence_trace", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gradient_projector_matches_per_sequence_gradients():
    """Projections from one batched backward == P_out @ dW @ P_in.T of each sequence alone."""
    example = _load_influence_trace()
    device = torch.device("cpu")
    model = example.build_model("tiny", device)
    projector = example.GradientProjector(model.model.layers, 8, device)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(model.config.vocab_size, (3, 16), generator=gen)
    mask = (torch.arange(1, 16)[None] >= torch.tensor([[2], [5], [9]])).float()
    with projector.record_inputs():
        logp = example.token_logprobs(model, ids)
    with projector.collect():
        (logp * mask).sum().backward()
    got = projector.take()
    assert len(got) == len(model.model.layers)
    for seq in range(3):
        model.zero_grad()
        (example.token_logprobs(model, ids[seq : seq + 1]) * mask[seq : seq + 1]).sum().backward()
        for index, layer in enumerate(model.model.layers):
            parts = []
            for name, module in layer.named_modules():
                if isinstance(module, nn.Linear):
                    p_in, p_out = projector._proj[(index, name)]
                    parts.append((p_out @ module.weight.grad @ p_in.T).flatten())
            expected = torch.cat(parts)
            torch.testing.assert_close(got[index][seq], expected, rtol=1e-4, atol=1e-6)


# Each pair of (api, fsdp, wrap) values meets once.
LIGHTNING = [("trainer", 1, "lightning"), ("trainer", 2, "user"), ("fabric", 1, "user"),
             ("fabric", 2, "user")]
# The first starts its second rank through Lightning, as the example's docstring runs it;
# the other runs are in the session's batch of example runs, whose 2 ranks are started for
# Lightning (LOCAL_RANK set, as torchrun does), so it starts none: the same script and
# steps, its imports paid once (a run of its own: about 19 s in CI, most of it importing).
OWN_LAUNCH = LIGHTNING[0]


def _lightning(api: str, fsdp: int, wrap: str, *extra: str) -> subprocess.CompletedProcess:
    pytest.importorskip("lightning", reason="the lightning extra: pip install '.[lightning]'")
    args = ["--api", api, "--fsdp", str(fsdp), "--wrap", wrap, *extra]
    # Lightning starts the second rank itself; its port from the environment.
    return _run([sys.executable, str(EXAMPLES / "lightning_manual.py"), *args],
                env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())})


def _lightning_run(*args: str) -> ExampleRun | None:
    """The batch's run of these arguments (None where lightning is missing: the test skips)."""
    if not importlib.util.find_spec("lightning"):
        return None
    return ExampleRun("lightning_manual.py", args, count_blocks=False)


def _lightning_batched(api: str, fsdp: int, wrap: str) -> ExampleRun | None:
    if (api, fsdp, wrap) == OWN_LAUNCH:
        return None
    return _lightning_run("--api", api, "--fsdp", str(fsdp), "--wrap", wrap)


def _lightning_result(example_batch, run: ExampleRun | None, *args) -> subprocess.CompletedProcess:
    return _lightning(*args) if run is None else example_batch.result(run)


@pytest.mark.parametrize("api,fsdp,wrap", LIGHTNING)
@batched(_lightning_batched)
def test_lightning_manual(api, fsdp, wrap, example_batch):
    """lightning_manual.py, Lightning on 2 CPU ranks (its FSDP1 strategies subclassed
    with device_id=cpu): two manual_backward passes per step, 3 steps, every parameter
    within 1e-6 of the one-process reference; with Lightning's own FSDP1 wrapping the
    block opens inside the root's forward."""
    run = _lightning_batched(api, fsdp, wrap)
    out = _check_ok(_lightning_result(example_batch, run, api, fsdp, wrap))
    assert _number(r"PARITY max_diff=(\S+)", out) < 1e-6


def _lightning_plain_fsdp1() -> ExampleRun | None:
    return _lightning_run("--api", "trainer", "--fsdp", "1", "--wrap", "lightning", "--no-library")


@batched(_lightning_plain_fsdp1)
def test_lightning_manual_plain_fsdp1_fails(example_batch):
    """The same Trainer step without the block, Lightning's FSDP1 wrapping: FSDP1 refuses
    a backward inside its root's forward (Lightning issue #19685)."""
    proc = _lightning_result(example_batch, _lightning_plain_fsdp1(), "trainer", 1, "lightning",
                             "--no-library")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    assert "agreement" not in proc.stdout
