"""examples/trl_sft_aux.py on 2 CPU ranks: TRL's ``SFTTrainer`` with its defaults (the fused,
chunked LM head, non-reentrant gradient checkpointing, bf16), a ``training_step`` that
backpropagates SFT's own loss and an entropy bonus over one forward, under the Trainer's
DDP and DeepSpeed ZeRO-2, with the Trainer integration (``retaining_trainer``) and without.

Each run replays its global micro-batches on an unwrapped copy in one process (the plain
math in place of the fused head) and compares every parameter after 3 optimizer steps
(gradient accumulation 2, TRL's clipping at 1.0), within 3% of the largest update (bf16
rounding, which the replay does not share exactly), and the ranks' parameters with each
other (equal, bit for bit). Four launches:

- DDP and ZeRO-2 with the integration: right.
- DDP without it: DDP all-reduces only SFT's pass, each rank keeps its own entropy
  gradient and the ranks' parameters drift apart (rank 0's stays within the bf16
  tolerance of the replay; with ``--fp32`` the replay check catches it too).
- ZeRO-2 without it: accelerate steps the engine after SFT's pass, so the parameters end
  far from the replay (over ten times the tolerance).

Skipped without trl (and without deepspeed for ZeRO-2); CI runs it in the DeepSpeed venv
with ``trl==1.16.0``.
"""

import pytest

from tests.support.installed import skip_unless_installed

skip_unless_installed("trl", reason="trl not installed (pip install trl==1.16.0)")
skip_unless_installed("datasets", reason="TRL's SFTTrainer needs datasets")

from tests.docs.test_examples import _check_ok, _number  # noqa: E402
from tests.support.examples import ExampleRun, batched, session_batch  # noqa: E402

STEPS = 3
TRL_DEFAULTS = ("bf16 True, gradient checkpointing on 3 modules (use_reentrant=False), "
                "outputs FusedCausalLMOutput, gradient_accumulation_steps 2")


def _example(backend: tuple[str, ...], library: bool) -> ExampleRun:
    """The run (the session's batch runs it, tests/support/examples.py)."""
    args = (*backend, "--steps", str(STEPS)) + (() if library else ("--no-library",))
    return ExampleRun("trl_sft_aux.py", args, count_blocks=False)


def _ddp(library):
    return _example(("--ddp",), library)


def _zero2(library):
    return _example(("--deepspeed", "2"), library)


def _run(example: ExampleRun):
    proc = session_batch().result(example)
    return proc, proc.stdout + proc.stderr


def _right(proc, out: str) -> None:
    """Parity within the bf16 tolerance, and the ranks' parameters equal."""
    _check_ok(proc)
    update = _number(r"largest update (\S+);", out)
    assert update > 1e-2
    assert _number(r"PARITY max_diff=(\S+)", out) <= 0.03 * update
    assert _number(r"RANKS max_diff=(\S+)", out) == 0


@pytest.mark.parametrize("library", [True, False], ids=["block", "plain"])
@batched(_ddp)
def test_trl_sft_aux_ddp(library):
    """--ddp (the Trainer's DDP, use_cpu=True), TRL's defaults: with the block right;
    without it the second pass is never all-reduced and the ranks' parameters differ."""
    proc, out = _run(_ddp(library))
    name = "RetainingEntropyBonusSFTTrainer" if library else "EntropyBonusSFTTrainer"
    assert (f"{name}: DDP, 2 processes on cpu, {TRL_DEFAULTS}; model DistributedDataParallel"
            in proc.stdout), out[-4000:]
    if library:
        _right(proc, out)
        return
    assert proc.returncode != 0, out[-4000:]
    assert "agreement: FAILED" in proc.stdout, out[-4000:]
    assert _number(r"RANKS max_diff=(\S+)", proc.stdout) > 1e-4


@pytest.mark.parametrize("library", [True, False], ids=["block", "plain"])
@batched(_zero2)
def test_trl_sft_aux_deepspeed_zero2(library):
    """--deepspeed 2 (the Trainer's deepspeed= config through examples/accelerate_cpu_fsdp.py,
    the engine's bf16 with fp32 master weights), TRL's defaults: with the block right;
    without it the engine steps after SFT's pass and the parameters end over ten times
    the tolerance away from the replay."""
    pytest.importorskip("deepspeed", reason="deepspeed not installed (the deepspeed extra)")
    proc, out = _run(_zero2(library))
    name = "RetainingEntropyBonusSFTTrainer" if library else "EntropyBonusSFTTrainer"
    assert (f"{name}: DeepSpeed ZeRO-2, 2 processes on cpu, {TRL_DEFAULTS}; "
            "model DeepSpeedEngine") in proc.stdout, out[-4000:]
    if library:
        _right(proc, out)
        return
    assert proc.returncode != 0, out[-4000:]
    assert "agreement: FAILED" in proc.stdout, out[-4000:]
    # Ten times the tolerance: clipping (TRL's default, 1.0) bounds each extra step.
    update = _number(r"largest update (\S+);", proc.stdout)
    assert _number(r"PARITY max_diff=(\S+)", proc.stdout) > 10 * 0.03 * update
