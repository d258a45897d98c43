"""DeepSpeed ZeRO-3 passes whose ``inputs=`` name parameters (part of
``tests/deepspeed/cases_deepspeed.py``); see [Note: inputs that name parameters].

- ``loss.backward(inputs=head)`` (the LM head and the last layer's ``down_proj``):
  refused before the pass, keep_unsharded x sync_grads (with keep_unsharded=True
  the next pass failed inside ZeRO-3's coordinator after gradients were written);
  a loss over everything then trains right, 2 SGD-momentum steps.
- ``torch.autograd.grad`` naming parameters: refused before the pass (it would
  return the local, unreduced gradient and skip ZeRO-3's reduction); the step then
  goes on right.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from fsdp_retain import no_reshard_between_backwards
from fsdp_retain._common import RetainError
from tests.deepspeed.cases_deepspeed_common import (
    assert_close,
    ds_config,
    full_grads,
    full_params,
    losses,
    make_engine,
    tokens,
)
from tests.support.harness import Registry
from tests.support.parity import world

registry = Registry()
STEPS = 2
HEAD = ("lm_head.weight", "model.layers.1.mlp.down_proj.weight")


def _averaged(ref) -> dict:
    grads = {}
    for name, param in ref.named_parameters():
        if param.grad is not None:
            grad = param.grad.detach().clone()
            dist.all_reduce(grad)
            grads[name] = grad / world()
    return grads


def _inputs_case(keep: bool, sync: str) -> None:
    engine, ref = make_engine(ds_config())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9)
    head = [p for n, p in engine.module.named_parameters() if n in HEAD]
    for step in range(STEPS):
        ids = tokens(step)
        _, second = losses(ref(ids).logits, 2)
        second.backward()
        expected = _averaged(ref)
        for name, param in ref.named_parameters():
            param.grad = expected[name]
        ref_opt.step()
        ref_opt.zero_grad()
        with no_reshard_between_backwards(engine, keep_unsharded=keep, sync_grads=sync) as b:
            first, second = losses(engine(ids).logits, 2)
            with pytest.raises(RetainError, match="inputs="):
                first.backward(retain_graph=True, inputs=head)
            assert b.backward_passes == 0, b.backward_passes
            second.backward()
        assert_close(full_grads(engine), expected, f"step {step}: grads")
        engine.step()
        ref_params = {n: p.detach() for n, p in ref.named_parameters()}
        assert_close(full_params(engine), ref_params, f"step {step}: params")


for _keep, _sync in itertools.product((True, False), ("every", "last")):
    registry.add(
        f"inputs_refused_keep{int(_keep)}_{_sync}",
        lambda k=_keep, s=_sync: _inputs_case(k, s),
    )


@registry.case()
def autograd_grad_on_params_refused() -> None:
    engine, ref = make_engine(ds_config())
    ids = tokens(0)
    with no_reshard_between_backwards(engine) as b:
        first, second = losses(engine(ids).logits, 2)
        with pytest.raises(RetainError, match="torch.autograd.grad"):
            torch.autograd.grad(first, list(engine.module.parameters()), retain_graph=True)
        assert b.backward_passes == 0
        second.backward()
    _, ref_second = losses(ref(ids).logits, 2)
    ref_second.backward()
    assert_close(full_grads(engine), _averaged(ref), "grads after the refused pass")
