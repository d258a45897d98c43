"""DeepSpeed ZeRO-3 under the APIs of real training loops (part of ``tests/deepspeed/cases_deepspeed.py``).

- HF's own loss under gradient accumulation 2 with torch-style ``loss.backward()``:
  pass 1 is ``engine(ids, labels=ids).loss.backward()`` (that engine output's node is
  the pass's root, which autograd does not report as run: it was refused as an
  unscaled loss), pass 2 a loss on the logits; keep_unsharded x sync_grads, with and
  without a probe pass first.
- HF reentrant gradient checkpointing (``gradient_checkpointing_enable`` with
  ``use_reentrant=True``), keep_unsharded x sync_grads, 2 passes, the first from the
  logits or from the embedding's output (reaching no checkpointed layer: their
  gradient partitions must not keep the step before's). With keep_unsharded=False the
  block held size-0 ``AccumulateGrad`` nodes of the released, checkpointed
  parameters: ``invalid gradient ... expected [0]``.
- A pass that starts inside the model (decoder layer 0's output) after the block
  exited: a RetainError naming the fix before any gradient is written (it failed on
  ZeRO-3's released parameters), keep_unsharded x sync_grads; then the step and plain
  steps match the reference.

Parity with an unsharded reference (see ``tests/deepspeed/cases_deepspeed_common.py``) over 2
SGD-momentum steps.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from fsdp_retain import no_reshard_between_backwards
from fsdp_retain._common import RetainError
from tests.deepspeed.cases_deepspeed_common import (
    TOL,
    TOL_ACCUMULATED,
    Scenario,
    assert_all_released,
    assert_close,
    ds_config,
    engine_micro_step,
    full_grads,
    full_params,
    layer0_output,
    losses,
    make_engine,
    reference_step,
    tokens,
)
from tests.support.harness import Registry
from tests.support.parity import LOSSES, world

registry = Registry()
STEPS = 2


def _sgd(model) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)  # as make_engine's


def _run_parity(engine, ref, engine_micro, ref_micro, gas: int = 1) -> None:
    """``STEPS`` optimizer steps of ``gas`` micro-batches; ``*_micro(model, ids)`` runs
    one micro-batch's passes (the reference's scaled by ``1 / gas``)."""
    ref_opt = _sgd(ref)
    tol = TOL_ACCUMULATED if gas > 1 else TOL
    for step in range(STEPS):
        for micro in range(gas):
            ref_micro(ref, tokens(step, micro))
        for param in ref.parameters():
            dist.all_reduce(param.grad)
            param.grad /= world()
        expected = {n: p.grad.clone() for n, p in ref.named_parameters()}
        ref_opt.step()
        ref_opt.zero_grad()
        for micro in range(gas):
            engine_micro(engine, tokens(step, micro))
            if micro == gas - 1:
                assert_close(full_grads(engine), expected, f"step {step}: grads", tol=tol)
            engine.step()
        ref_params = {n: p.detach() for n, p in ref.named_parameters()}
        assert_close(full_params(engine), ref_params, f"step {step}: params", tol=tol)
        assert_all_released(engine)


# HF's out.loss under gradient accumulation, torch-style loss.backward() #
GAS = 2


def _hf_losses(out) -> list:
    return [out.loss, LOSSES[1](out.logits.float())]


def _hf_loss_case(keep: bool, sync: str, probe: bool):
    def engine_micro(engine, ids) -> None:
        with no_reshard_between_backwards(engine, keep_unsharded=keep, sync_grads=sync) as block:
            out = engine(ids, labels=ids)
            if probe:
                block.backward(LOSSES[0](out.logits.float()), param_grads=False,
                               retain_graph=True)
            first, second = _hf_losses(out)
            first.backward(retain_graph=True)  # DeepSpeed divides it by GAS on out.loss
            second.backward()
            assert block.backward_passes == 2 + probe, block.backward_passes

    def ref_micro(ref, ids) -> None:
        first, second = _hf_losses(ref(ids, labels=ids))
        (first / GAS).backward(retain_graph=True)
        (second / GAS).backward()

    def run() -> None:
        engine, ref = make_engine(ds_config(gas=GAS))
        _run_parity(engine, ref, engine_micro, ref_micro, gas=GAS)

    return run


for keep, sync, probe in itertools.product((True, False), ("every", "last"), (False, True)):
    name = f"hf_loss_gas2_loss_backward_keep{int(keep)}_{sync}" + ("_probe" if probe else "")
    registry.add(name, _hf_loss_case(keep, sync, probe))


# HF reentrant gradient checkpointing #
def _has_reentrant_checkpoint(loss: torch.Tensor) -> bool:
    stack, seen = [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "CheckpointFunctionBackward":
            return True
        stack.extend(next_node for next_node, _ in node.next_functions)
    return False


def _embedding_output(model, kept: list):
    def keep(module, args, output):
        kept.append(output)

    return model.model.embed_tokens.register_forward_hook(keep)


def _reentrant_losses(model, hf_model, ids, from_embedding: bool) -> list:
    """Two losses; with ``from_embedding`` the first starts at the embedding's output,
    so its pass reaches none of the checkpointed decoder layers."""
    kept: list = []
    handle = _embedding_output(hf_model, kept)
    try:
        first, second = losses(model(ids).logits, 2)
    finally:
        handle.remove()
    if from_embedding:
        first = torch.tanh(kept[0].float()).pow(2).mean()
    return [first, second]


def _reentrant_case(keep: bool, sync: str, from_embedding: bool):
    def engine_micro(engine, ids) -> None:
        with no_reshard_between_backwards(engine, keep_unsharded=keep, sync_grads=sync):
            first, second = _reentrant_losses(engine, engine.module, ids, from_embedding)
            assert _has_reentrant_checkpoint(second)
            engine.backward(first, retain_graph=True)
            second.backward()

    def ref_micro(ref, ids) -> None:  # no checkpointing: the same gradients
        first, second = _reentrant_losses(ref, ref, ids, from_embedding)
        first.backward(retain_graph=True)
        second.backward()

    def run() -> None:
        engine, ref = make_engine(ds_config())
        engine.module.gradient_checkpointing_enable({"use_reentrant": True})
        engine.module.train()
        _run_parity(engine, ref, engine_micro, ref_micro)

    return run


for keep, sync, from_embedding in itertools.product(
    (True, False), ("every", "last"), (False, True)
):
    name = f"hf_reentrant_checkpointing_keep{int(keep)}_{sync}"
    registry.add(name + ("_first_from_embedding" if from_embedding else ""),
                 _reentrant_case(keep, sync, from_embedding))


# A pass from inside the model after the block exited #
def _inner_after_exit_case(keep: bool, sync: str):
    def run() -> None:
        engine, ref = make_engine(ds_config())
        ref_opt = _sgd(ref)
        with layer0_output(engine.module) as kept:
            with no_reshard_between_backwards(engine, keep_unsharded=keep, sync_grads=sync):
                out = engine(tokens(0)).logits
                engine.backward(losses(out, 1)[0], retain_graph=True)
        before = full_grads(engine)
        try:
            torch.tanh(kept[0].float()).pow(2).mean().backward()
        except RetainError as exc:
            assert "Move this backward inside the block" in str(exc), exc
        else:
            raise AssertionError("a pass from inside the model after the block exited was accepted")
        assert_close(full_grads(engine), before, "grads after the refused pass",
                     tol=dict(rtol=0, atol=0))
        assert_all_released(engine)
        # The block's own pass is right, and so are plain steps after it.
        expected = reference_step(ref, ref_opt, Scenario(passes=1), 0)
        assert_close(full_grads(engine), expected, "step 0: grads")
        engine.step()
        plain = Scenario(passes=1, use_block=False)
        for step in range(1, STEPS + 1):
            expected = reference_step(ref, ref_opt, plain, step)
            engine_micro_step(engine, plain, step, 0)
            assert_close(full_grads(engine), expected, f"plain step {step}: grads")
            engine.step()
        ref_params = {n: p.detach() for n, p in ref.named_parameters()}
        assert_close(full_params(engine), ref_params, "params")

    return run


for keep, sync in itertools.product((True, False), ("every", "last")):
    registry.add(f"inner_pass_after_exit_is_rejected_keep{int(keep)}_{sync}",
                 _inner_after_exit_case(keep, sync))
