"""HF Qwen2 under FSDP1 and FSDP2, peft LoRA, a frozen embedding (part of
``tests/real_stacks/cases_real_stacks.py``).

- HF reentrant gradient checkpointing (every FSDP1 strategy, both use_orig_params,
  HYBRID_SHARD at world size 4; FSDP2), every option and a byte budget; non-reentrant
  the same with a probe pass first. A probe pass over reentrant checkpoints is
  refused; plain FSDP1 fails on the second backward.
- peft LoRA (frozen base and embedding) on FSDP1 and FSDP2: a probe pass reaches
  decoder layer 0 with the reference's gradients, then the policy loss.
- A frozen embedding below residual blocks: a probe pass fires the first block's hook.
"""

from __future__ import annotations

import copy
import functools
import itertools

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from fsdp_retain import no_reshard_between_backwards
from tests.support import fsdp1_utils as f1
from tests.support import fsdp2_utils as f2
from tests.support.case_parts import covering
from tests.support.harness import Registry
from tests.support.parity import Block, averaged_grads, reference_copy
from tests.support.real_stacks_hf import (
    HALF,
    OPTIONS,
    TOL,
    VOCAB,
    _opt_tag,
    assert_close_dicts_tol,
    hf_rl_parity,
    logp_loss,
    lora_qwen2,
    tiny_qwen2,
    token_logp,
    tokens,
    weighted_loss,
    wrap_fsdp1,
    wrap_fsdp2,
    wrap_fsdp2_peft,
)

registry = Registry()


def _add_hf_case(ckpt, backend, strategy, uop, keep, sync, probe, sizes=(2,)) -> None:
    if backend == "fsdp2":
        wrap, adapter, what = wrap_fsdp2, f2.ADAPTER, "fsdp2"
    else:
        wrap = functools.partial(wrap_fsdp1, strategy=strategy, uop=uop)
        adapter = f1.ADAPTER
        what = f"fsdp1_{f1.STRATEGY_NAMES[strategy]}_{'orig' if uop else 'flat'}"
    name = f"hf_qwen2_{ckpt}_{what}_{_opt_tag(keep, sync)}{'_probe' if probe else ''}"
    fn = functools.partial(hf_rl_parity, wrap, adapter, ckpt, keep, sync, probe)
    registry.add(name, fn, world_sizes=sizes)


def _add_hf_cases() -> None:
    """Reentrant: every FSDP1 strategy and use_orig_params, FSDP2, every option, every 3 of them together (probe
    passes refuse reentrant checkpoints, see below). Non-reentrant: the same with
    probe passes."""
    fsdp1 = [(f1.FULL, (2,)), (f1.GRAD_OP, (2,)), (f1.HYBRID, (4,))]
    # FSDP1: every 3 of (strategy, use_orig_params, keep, sync) meet in each combination
    # of their values (12 of the 24 per checkpointing kind).
    grid = covering(dict(strategy=fsdp1, uop=(True, False), keep=(True, False),
                         sync=("every", "last")), strength=3)
    for ckpt, probe in (("reentrant", False), ("nonreentrant", True)):
        for row in grid:
            (strategy, sizes), uop = row["strategy"], row["uop"]
            _add_hf_case(ckpt, "fsdp1", strategy, uop, row["keep"], row["sync"], probe, sizes)
        for keep, sync in OPTIONS:
            _add_hf_case(ckpt, "fsdp2", None, False, keep, sync, probe)
    for keep, sync in OPTIONS[:2]:  # non-reentrant without probe, for contrast
        _add_hf_case("nonreentrant", "fsdp1", f1.FULL, True, keep, sync, False)
    # keep_unsharded as a byte budget (some units kept, the others re-gathered).
    for (ckpt, probe), sync in itertools.product(
        (("reentrant", False), ("nonreentrant", True)), ("every", "last")
    ):
        for strategy, uop in ((f1.FULL, True), (f1.FULL, False), (f1.GRAD_OP, True)):
            _add_hf_case(ckpt, "fsdp1", strategy, uop, HALF, sync, probe)
        _add_hf_case(ckpt, "fsdp2", None, False, HALF, sync, probe)
        if ckpt == "reentrant":
            _add_hf_case(ckpt, "fsdp1", f1.HYBRID, True, HALF, sync, probe, (4,))


_add_hf_cases()


def _reentrant_probe_refused(backend: str) -> None:
    """A probe pass over HF reentrant checkpointing raises a ValueError naming
    use_reentrant=False before anything runs; the block then trains right."""
    model = tiny_qwen2("reentrant")
    ref = copy.deepcopy(model)
    model = wrap_fsdp2(model) if backend == "fsdp2" else wrap_fsdp1(model, f1.FULL, True)
    adapter = f2.ADAPTER if backend == "fsdp2" else f1.ADAPTER
    ids = tokens(0)
    with no_reshard_between_backwards(model) as block:
        logp = token_logp(model, ids)
        with pytest.raises(ValueError, match="use_reentrant"):
            block.backward(logp_loss(logp), param_grads=False, retain_graph=True)
        weighted_loss(logp).backward()
    weighted_loss(token_logp(ref, ids)).backward()
    assert_close_dicts_tol(adapter.full_grads(model), averaged_grads(ref), "grads")
    assert block.backward_passes == 1, block.backward_passes


registry.add("hf_qwen2_reentrant_fsdp1_probe_refused", functools.partial(_reentrant_probe_refused, "fsdp1"))
registry.add("hf_qwen2_reentrant_fsdp2_probe_refused", functools.partial(_reentrant_probe_refused, "fsdp2"))


@registry.case()
def hf_qwen2_reentrant_fsdp1_without_block_fails() -> None:
    """Without the library, FSDP1 with HF reentrant checkpointing crashes or is wrong
    on the second backward over one forward."""
    model = wrap_fsdp1(tiny_qwen2("reentrant"), f1.FULL, True)
    logp = token_logp(model, tokens(0))
    try:
        logp_loss(logp).backward(retain_graph=True)
        weighted_loss(logp).backward()
    except RuntimeError as exc:
        assert "storage" in str(exc) or "size" in str(exc), exc
        return
    raise AssertionError("plain FSDP1 ran two passes over a reentrant-checkpointed graph")


# --- LoRA (peft) and frozen lower layers: probe passes reach every layer -------


def _add_lora_cases() -> None:
    """peft LoRA on Qwen2, one unit per decoder layer: pass 1 a probe pass whose
    activation hooks fire in all three layers (layer 0 included) with the reference's
    gradients, then the policy loss; the adapters match the reference over 3 steps."""
    for (keep, sync), ckpt in itertools.product(OPTIONS, ("none", "nonreentrant")):
        tag = f"{_opt_tag(keep, sync)}{'_ckpt' if ckpt != 'none' else ''}"
        wrap = functools.partial(wrap_fsdp1, strategy=f1.FULL, uop=True)
        fn = functools.partial(
            hf_rl_parity, wrap, f1.ADAPTER, ckpt, keep, sync, True, lora_qwen2
        )
        registry.add(f"peft_lora_qwen2_fsdp1_full_orig_{tag}_probe", fn)
        fn = functools.partial(
            hf_rl_parity, wrap_fsdp2_peft, f2.ADAPTER, ckpt, keep, sync, True, lora_qwen2
        )
        registry.add(f"peft_lora_qwen2_fsdp2_{tag}_probe", fn)


_add_lora_cases()


class FrozenEmbeddingNet(nn.Module):
    """The issue's model: a frozen embedding, then residual blocks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(42)
        self.emb = nn.Embedding(VOCAB, 12)
        self.emb.weight.requires_grad_(False)
        self.blocks = nn.ModuleList(Block(12) for _ in range(3))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return h


def _frozen_embedding_probe(backend: str, keep: bool) -> None:
    """Frozen embedding (frozen lower layers): a hook in the first block fires in a
    probe pass, once, with the gradient a plain backward gives it."""
    model = FrozenEmbeddingNet()
    ref = reference_copy(model)
    if backend == "fsdp2":
        model = f2.wrap(model)
    else:
        model = FSDP(
            model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True,
            device_id=torch.device("cpu"),
        )
    hooks, ref_hooks = {}, {}

    def hook(seen, module, args, out):
        out.register_hook(lambda g: seen.setdefault("fc1", []).append(g.detach().clone()))

    inner = model.blocks[0] if backend == "fsdp2" else model.blocks[0].module
    inner.fc1.register_forward_hook(functools.partial(hook, hooks))
    ref.blocks[0].fc1.register_forward_hook(functools.partial(hook, ref_hooks))
    ids = tokens(0)
    ref_out = ref(ids)
    ref_out.pow(2).mean().backward()
    with no_reshard_between_backwards(model, keep_unsharded=keep) as block:
        out = model(ids)
        block.backward(out.pow(2).mean(), param_grads=False, retain_graph=True)
        assert len(hooks.get("fc1", [])) == 1, f"the probe pass fired fc1's hook {hooks}"
        out.pow(2).mean().backward()
    assert len(hooks["fc1"]) == 2, hooks
    for got in hooks["fc1"]:
        torch.testing.assert_close(got, ref_hooks["fc1"][0], **TOL)


for _backend, _keep in itertools.product(("fsdp1", "fsdp2"), (True, False)):
    registry.add(
        f"frozen_embedding_probe_reaches_first_block_{_backend}_{'keep' if _keep else 'regather'}",
        functools.partial(_frozen_embedding_probe, _backend, _keep),
    )
