"""``backward(inputs=...)`` on real stacks (part of ``tests/api/cases_api.py``): HF Qwen2
with peft LoRA, FSDP1 (FULL_SHARD, original parameters) and FSDP2.

- **The adapters of the last layer only, then everything**: the RL step's log-prob
  loss with ``inputs=`` the ``lora_B`` weights of decoder layer 2, then the weighted
  loss over all adapters; no checkpointing and HF non-reentrant checkpointing, every
  option. After pass 1 the named gradients equal the reference's and every other
  adapter's ``.grad`` is ``None``; the adapters match over 3 SGD-momentum steps.
- **HF reentrant checkpointing**: torch refuses ``inputs=`` there only midway
  through the pass, after the gradients of the layers above were written; the block
  refuses it before anything runs (``ValueError`` naming ``use_reentrant=False``),
  and the step goes on right.
"""

from __future__ import annotations

import copy
import functools
import itertools

import pytest
import torch
from torch.distributed.fsdp._common_utils import clean_tensor_name

from fsdp_retain import no_reshard_between_backwards
from tests.support import fsdp1_utils as f1
from tests.support import fsdp2_utils as f2
from tests.support.harness import Registry
from tests.support.parity import averaged_grads, sgd
from tests.support.real_stacks_hf import (
    OPTIONS,
    assert_close_dicts_tol,
    logp_loss,
    lora_qwen2,
    token_logp,
    tokens,
    weighted_loss,
    wrap_fsdp1,
    wrap_fsdp2_peft,
)

registry = Registry()
STEPS = 3


def _named(model) -> list[torch.Tensor]:
    return [p for n, p in model.named_parameters() if _is_named(clean_tensor_name(n))]


def _is_named(name: str) -> bool:
    return "layers.2." in name and "lora_B" in name


def _wrap(backend: str):
    if backend == "fsdp2":
        return wrap_fsdp2_peft, f2.ADAPTER
    return functools.partial(wrap_fsdp1, strategy=f1.FULL, uop=True), f1.ADAPTER


def _lora_inputs(backend: str, ckpt: str, keep: bool, sync: str) -> None:
    model = lora_qwen2(ckpt)
    ref = copy.deepcopy(model)
    wrap, adapter = _wrap(backend)
    model = wrap(model)
    opt, ref_opt = sgd(model), sgd(ref)
    head = _named(model)
    assert len(head) == 2, [clean_tensor_name(n) for n, _ in model.named_parameters()]
    trainable = {clean_tensor_name(n) for n, p in model.named_parameters() if p.requires_grad}
    for step in range(STEPS):
        ids = tokens(step)
        logp = token_logp(ref, ids)
        logp_loss(logp).backward(retain_graph=True, inputs=_named(ref))
        ref_first = averaged_grads(ref)
        weighted_loss(logp).backward()
        ref_grads = averaged_grads(ref)
        for name, param in ref.named_parameters():
            param.grad = ref_grads.get(name)
        ref_opt.step()
        ref_opt.zero_grad()

        with no_reshard_between_backwards(model, keep_unsharded=keep, sync_grads=sync) as b:
            logp = token_logp(model, ids)
            logp_loss(logp).backward(retain_graph=True, inputs=head)
            assert b.backward_passes == 1
            if sync == "every":
                got = {n: g for n, g in adapter.full_grads(model).items() if _is_named(n)}
                assert_close_dicts_tol(got, ref_first, f"step {step}: after pass 1")
                stray = [
                    clean_tensor_name(n)
                    for n, p in model.named_parameters()
                    if clean_tensor_name(n) in trainable
                    and not _is_named(clean_tensor_name(n))
                    and p.grad is not None
                ]
                assert not stray, f"step {step}: pass 1 wrote .grad of {stray}"
            weighted_loss(logp).backward()
        opt.step()
        opt.zero_grad()
        ref_params = {n: p.detach() for n, p in ref.named_parameters()}
        assert_close_dicts_tol(adapter.full_params(model), ref_params, f"step {step}: params")


for _backend, _ckpt, (_keep, _sync) in itertools.product(
    ("fsdp1_full_orig", "fsdp2"), ("none", "nonreentrant"), OPTIONS
):
    registry.add(
        f"hf_lora_inputs_{_backend}_{_ckpt}_{'keep' if _keep else 'regather'}_{_sync}",
        functools.partial(_lora_inputs, _backend, _ckpt, _keep, _sync),
    )


def _reentrant_refused(backend: str) -> None:
    model = lora_qwen2("reentrant")
    ref = copy.deepcopy(model)
    wrap, adapter = _wrap(backend)
    model = wrap(model)
    ids = tokens(0)
    with no_reshard_between_backwards(model) as b:
        logp = token_logp(model, ids)
        with pytest.raises(ValueError, match="use_reentrant"):
            logp_loss(logp).backward(retain_graph=True, inputs=_named(model))
        assert b.backward_passes == 0
        assert all(p.grad is None for p in model.parameters()), "a gradient was written"
        weighted_loss(logp).backward()
    weighted_loss(token_logp(ref, ids)).backward()
    grads = adapter.full_grads(model)
    expected = averaged_grads(ref)
    grads = {n: g for n, g in grads.items() if n in expected}
    assert_close_dicts_tol(grads, expected, "grads after the refused pass")


registry.add("hf_lora_inputs_reentrant_refused_fsdp1", functools.partial(_reentrant_refused, "fsdp1"))
registry.add("hf_lora_inputs_reentrant_refused_fsdp2", functools.partial(_reentrant_refused, "fsdp2"))
