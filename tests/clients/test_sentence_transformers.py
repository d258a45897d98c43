"""examples/sentence_transformers_cached.py on 2 CPU ranks: sentence-transformers'
``SentenceTransformerTrainer`` with ``CachedMultipleNegativesRankingLoss`` (GradCache: the
mini-batches' forwards under no_grad, then a forward and a backward per mini-batch from a
hook on the loss, inside the Trainer's backward), FSDP2 and FSDP1 from the Trainer's own
fsdp arguments, with the block around ``training_step`` and without it.

Every run matches an unsharded one-process replay with the uncached
``MultipleNegativesRankingLoss`` (float64 on FSDP2; float32 on FSDP1, whose
``clip_grad_norm_`` refuses float64 gradients). The all-gathers per step follow the
formulas below: with the block one per FSDP unit, however many mini-batches.

Skipped when sentence-transformers is not installed; run it in its own venv:
``scripts/venv_ci.sh deepspeed`` (sentence-transformers 6.2.0 and DeepSpeed next to torch 2.13.0).
"""

import pytest

from tests.support.installed import skip_unless_installed

skip_unless_installed("sentence_transformers",
                      reason="sentence-transformers not installed (scripts/venv_ci.sh deepspeed)")
skip_unless_installed("datasets", reason="the SentenceTransformerTrainer needs datasets")

import re  # noqa: E402

from tests.docs.test_examples import _check_ok, _number  # noqa: E402
from tests.support.examples import ExampleRun, batched, session_batch  # noqa: E402

STEPS = 3
LAYERS = 2  # BertLayer units; the root (embeddings, pooling) is the third
UNITS = LAYERS + 1
# 8 pairs per rank, mini_batch_size 2, two columns (anchor, positive): 8 mini-batches,
# each embedded once under no_grad and replayed once (a forward and a backward).
MINIBATCHES = 2 * 8 // 2


def _cached(*args: str) -> ExampleRun:
    """The run (the session's batch runs it, tests/support/examples.py)."""
    return ExampleRun("sentence_transformers_cached.py", ("--steps", str(STEPS), *args),
                      count_blocks=False)


def _block(fsdp, sync):
    return _cached("--fsdp", str(fsdp), "--sync-grads", sync)


def _plain(fsdp):
    return _cached("--fsdp", str(fsdp), "--no-library")


def _ddp():
    return _cached("--ddp")


def _deepspeed(stage, sync):
    return _cached("--deepspeed", str(stage), "--sync-grads", sync)


def _plain_zero2():
    return ExampleRun("sentence_transformers_cached.py",
                      ("--deepspeed", "2", "--no-library", "--steps", "1"), count_blocks=False)


def _run(example: ExampleRun) -> tuple[str, list[dict[str, int]]]:
    out = _check_ok(session_batch().result(example))
    assert _number(r"largest update (\S+);", out) > 1e-2
    lines = re.findall(r"^step \d+: loss \S+, uncached replay \S+, (.*)$", out, re.M)
    steps = [{k: int(v) for k, v in (kv.split("=") for kv in line.split())} for line in lines]
    assert len(steps) == STEPS, out
    return out, steps


def _parity(out: str, fsdp: int) -> None:
    dtype, tolerance = ("float64", 1e-10) if fsdp == 2 else ("float32", 1e-5)
    assert "PARITY max_diff=" in out and f"({dtype}, every parameter" in out, out
    assert _number(r"PARITY max_diff=(\S+)", out) <= tolerance
    assert _number(r"losses: (\S+)\)", out) <= tolerance


@pytest.mark.parametrize("fsdp, sync", [(2, "every"), (1, "every"), (2, "last")],
                         ids=["fsdp2", "fsdp1", "fsdp2-sync-last"])
@batched(_block)
def test_cached_loss_block(fsdp, sync):
    """--fsdp {2,1} [--sync-grads last], 2 CPU ranks, 3 steps, the block around
    training_step: parity; one all-gather per unit per step, all of them in the no-grad
    forwards (the replays gather nothing); one reduce-scatter per unit per replay, or
    per step with sync_grads="last"."""
    out, steps = _run(_block(fsdp, sync))
    model = "FSDPSentenceTransformer" if fsdp == 2 else "FullyShardedDataParallel"
    assert (f"SentenceTransformerTrainer: FSDP{fsdp}, 2 processes on cpu, block "
            f"(sync_grads='{sync}'); model {model} with {UNITS} FSDP units") in out, out
    _parity(out, fsdp)
    reduces = UNITS * (MINIBATCHES if sync == "every" else 1)
    expected = {"all_gather": UNITS, "reduce_scatter": reduces, "all_reduce": 0,
                "forward_all_gather": UNITS, "backward_all_gather": 0}
    assert steps == [expected] * STEPS


@pytest.mark.parametrize("fsdp", [2, 1])
@batched(_plain)
def test_cached_loss_plain(fsdp):
    """--fsdp {2,1} --no-library: the same training without the block agrees too, but
    gathers per mini-batch. In the no-grad forwards: the root once (FSDP keeps the root
    gathered after forward), each layer per mini-batch. In the replays: each layer per
    forward, and again per backward on FSDP1 (FSDP2 takes a forward inside a backward for
    a recomputation and keeps it gathered); the root again per replay but the first (its
    backward reshards it)."""
    out, steps = _run(_plain(fsdp))
    assert f"FSDP{fsdp}, 2 processes on cpu, plain (no block)" in out, out
    _parity(out, fsdp)
    forward = 1 + MINIBATCHES * LAYERS
    backward = MINIBATCHES * LAYERS * (1 if fsdp == 2 else 2) + MINIBATCHES - 1
    expected = {"all_gather": forward + backward, "reduce_scatter": UNITS * MINIBATCHES,
                "all_reduce": 0, "forward_all_gather": forward, "backward_all_gather": backward}
    assert steps == [expected] * STEPS
    assert forward + backward == {2: 40, 1: 56}[fsdp]  # vs UNITS (3) with the block


def _parity_of(out: str, dtype: str) -> None:
    tolerance = 1e-10 if dtype == "float64" else 1e-5
    assert f"({dtype}, every parameter" in out, out
    assert _number(r"PARITY max_diff=(\S+)", out) <= tolerance
    assert _number(r"losses: (\S+)\)", out) <= tolerance


@batched(_ddp)
def test_cached_loss_ddp():
    """--ddp (the Trainer's DDP, use_cpu=True) with the Trainer integration: right
    (float64), with the 2 all-reduces per step plain DDP makes (plain is right too:
    sentence-transformers syncs DDP itself, once, at the last replay)."""
    out, steps = _run(_ddp())
    assert ("SentenceTransformerTrainer: DDP, 2 processes on cpu, block (sync_grads='every')"
            in out), out
    _parity_of(out, "float64")
    assert [s["all_reduce"] for s in steps] == [2] * STEPS, steps


# engine.step()'s own collectives on ZeRO-1/2 (counted with the step: the integration
# steps the engine after the block, inside training_step): 2 all-reduces (the overflow
# check and the gradient norm) and 2 all-gathers (the updated partitions).
ZERO12_STEP = {"all_reduce": 2, "all_gather": 2}


@pytest.mark.parametrize("stage, sync", [(1, "every"), (2, "every"), (2, "last"), (3, "every")],
                         ids=["zero1", "zero2", "zero2-sync-last", "zero3"])
@batched(_deepspeed)
def test_cached_loss_deepspeed(stage, sync):
    """--deepspeed STAGE (the Trainer's deepspeed= config, fp32) with the Trainer
    integration: right (plain ZeRO-2 fails, sentence-transformers#3173). ZeRO-1/2 reduce
    once per replayed mini-batch ("every") or once per step ("last"); ZeRO-3 reduce-scatters
    once per replay (a cached loss needs "every" there)."""
    out, steps = _run(_deepspeed(stage, sync))
    assert (f"SentenceTransformerTrainer: DeepSpeed ZeRO-{stage}, 2 processes on cpu, block "
            f"(sync_grads='{sync}')") in out, out
    _parity_of(out, "float32")
    if stage == 3:
        assert [s["reduce_scatter"] for s in steps] == [MINIBATCHES] * STEPS, steps
        return
    reductions = MINIBATCHES if sync == "every" else 1
    assert [s["all_reduce"] for s in steps] == [reductions + ZERO12_STEP["all_reduce"]] * STEPS
    assert [s["all_gather"] for s in steps] == [ZERO12_STEP["all_gather"]] * STEPS


@batched(_plain_zero2)
def test_cached_loss_deepspeed_plain_zero2_fails():
    """--deepspeed 2 --no-library: sentence-transformers#3173, the replays reduce each
    parameter once per mini-batch and ZeRO-2 asserts."""
    proc = session_batch().result(_plain_zero2())
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    assert "Gradient computed twice for this partition" in out, out[-4000:]
