"""HF Qwen2 with a tiled MLP (part of ``tests/real_stacks/cases_real_stacks.py``): the patch axolotl
and Liger-Kernel apply to a decoder's MLP (DeepSpeed's ``TiledMLP``): the MLP's forward
runs over sequence tiles under ``no_grad``, its backward recomputes each tile and calls
``torch.autograd.backward`` per tile, a backward inside the backward
(``tests/support/nested_models.py``'s ``TiledMLP``, 4 tiles). Here the patch replaces each
``Qwen2MLP`` instance's forward, not the class's, so no other case sees it.

- ``hf_qwen2_tiled_*``: the RL step users run, over 3 SGD-momentum steps against the
  unsharded untiled reference (same seed, gradients averaged over ranks, parameters
  compared after each step, ``tests/support/real_stacks_hf.py``'s float32 tolerance): a probe
  pass (``block.backward(-logp.mean(), param_grads=False, retain_graph=True)``, as an
  influence collector runs it) whose activation hooks at each MLP's output see the
  reference's gradients and which leaves every ``.grad`` as it found it, then the
  log-prob loss and the position-weighted loss as real passes (``probe_2real``), the
  weighted loss alone (``probe_1real``), or the probe between the two real passes
  (``real_probe_real``: the probe's tiles meet a ``.grad`` the step must keep). A
  covering array (strength 3) over FSDP2 (``fully_shard`` per decoder layer and the
  root), FSDP1 FULL_SHARD with ``use_orig_params`` True and False (one unit per decoder
  layer), DDP; HF non-reentrant gradient checkpointing or none; ``sync_grads``;
  ``keep_unsharded``; the pass pattern. Each step counts the tiles recomputed, one
  nested backward pass each (4 per MLP per pass): the patch is never bypassed.
- ``hf_qwen2_tiled_reentrant_*``: HF reentrant checkpointing over the tiled MLP (each
  layer's recomputation a backward pass, the tiles' passes inside it), the two real passes
  (a probe pass refuses reentrant checkpoints), on each backend.
- ``peft_lora_qwen2_tiled_*``: peft LoRA (frozen base, adapters on attention and on the
  MLP's ``gate_proj`` and ``down_proj``, so the tiles write adapter gradients) on FSDP2
  and DDP, a probe pass first.
- ``hf_qwen2_tiled_ddp_without_block_fails``: the same loop on plain DDP raises in the
  first backward (each tile's gradient marks a parameter ready once more); with
  ``static_graph=True`` (the workaround DDP's error suggests) the RL step runs and is
  wrong: its second pass is never all-reduced.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

from fsdp_retain import no_reshard_between_backwards
from tests.support import fsdp1_utils as f1
from tests.support import fsdp2_utils as f2
from tests.support.case_parts import covering
from tests.real_stacks.cases_real_stacks_ddp import ADAPTER as DDP_ADAPTER
from tests.support.harness import Registry
from tests.support.nested_models import TiledMLP
from tests.support.parity import averaged_grads, sgd
from tests.support.real_stacks_hf import (
    STEPS,
    ActivationGrads,
    assert_close_dicts_tol,
    check_rl_step,
    logp_loss,
    lora_qwen2,
    reference_rl_step,
    tiny_qwen2,
    token_logp,
    tokens,
    weighted_loss,
    wrap_fsdp1,
    wrap_fsdp2,
    wrap_fsdp2_peft,
)

registry = Registry()

TILES = 4  # of the 8 positions: 2 each
# The passes of one step: "probe" a probe pass of the log-prob loss; "logp" and
# "weighted" real passes of the log-prob and the position-weighted loss.
PASSES = {
    "probe_2real": ("probe", "logp", "weighted"),
    "probe_1real": ("probe", "weighted"),
    "real_probe_real": ("logp", "probe", "weighted"),
    "2real": ("logp", "weighted"),  # no probe pass: reentrant checkpointing refuses one
}
PROBE_PATTERNS = ("probe_2real", "probe_1real", "real_probe_real")
LOSSES = {"logp": logp_loss, "weighted": weighted_loss}


def tile_mlps(model: nn.Module, tiles: int = TILES) -> nn.Module:
    """What axolotl's and Liger's patches do to a decoder's MLP, on each ``Qwen2MLP``
    instance of ``model`` (the class is left alone): its forward runs tiled."""
    mlps = [m for m in model.modules() if isinstance(m, Qwen2MLP)]
    assert len(mlps) == 3, mlps
    for mlp in mlps:
        def forward(self: Qwen2MLP, x: torch.Tensor) -> torch.Tensor:
            return TiledMLP.apply(_mlp_tile, self, x, tiles, "backward")

        mlp.forward = forward.__get__(mlp)  # type: ignore[method-assign]
    return model


_TILE_PASSES = [0]  # tiles recomputed with grad: one nested backward pass each


def _mlp_tile(mlp: Qwen2MLP, x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled():  # TiledMLP.backward's recompute, not its no_grad forward
        _TILE_PASSES[0] += 1
    return Qwen2MLP.forward(mlp, x)


def _local_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Each parameter's ``.grad`` as this rank holds it (a DTensor's local shard)."""
    out: dict[str, torch.Tensor | None] = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is not None and hasattr(grad, "to_local"):
            grad = grad.to_local()
        out[name] = None if grad is None else grad.detach().clone()
    return out


def _assert_same_grads(after: dict, before: dict, what: str) -> None:
    for name, grad in before.items():
        if grad is None:
            assert after[name] is None, f"{what}: {name} gained a .grad"
        else:
            assert after[name] is not None, f"{what}: {name} lost its .grad"
            assert torch.equal(after[name], grad), f"{what}: {name}'s .grad changed"


def tiled_rl_parity(wrap, adapter, ckpt: str, keep: bool, sync: str, passes: str,
                    make=tiny_qwen2) -> None:
    """Three RL steps with a probe pass through the tiled MLPs match the untiled
    reference: activation gradients of the probe, gradients, parameters."""
    model = make(ckpt)
    ref = copy.deepcopy(model)  # untiled
    model = wrap(tile_mlps(model))
    opt, ref_opt = sgd(model), sgd(ref)
    hooks, ref_hooks = ActivationGrads(model), ActivationGrads(ref)
    order = PASSES[passes]
    real = [p for p in order if p != "probe"]
    for step in range(STEPS):
        ids = tokens(step)
        ref_probe, ref_grads = reference_rl_step(ref, ref_opt, ref_hooks, token_logp(ref, ids),
                                                 keep_logp_grads="logp" in real)
        where = f"step {step}"
        with no_reshard_between_backwards(model, keep_unsharded=keep, sync_grads=sync) as block:
            logp = token_logp(model, ids)
            _TILE_PASSES[0] = 0
            taken: dict[str, dict] = {}
            for index, kind in enumerate(order):
                last = index == len(order) - 1
                if kind == "probe":
                    before = _local_grads(model)
                    block.backward(logp_loss(logp), param_grads=False, retain_graph=True)
                    _assert_same_grads(_local_grads(model), before, f"{where}: probe pass")
                    taken["probe"] = hooks.take()
                else:
                    LOSSES[kind](logp).backward(retain_graph=not last)
                    taken[kind] = hooks.take()
        # Every pass ran the tiles of each of the 3 MLPs, each its own backward pass.
        assert _TILE_PASSES[0] == len(order) * 3 * TILES, (_TILE_PASSES, order)
        # The log-prob loss's activation gradients: of the probe pass, else of its real pass.
        first = taken.get("probe", taken.get("logp"))
        check_rl_step(where, model, ref, adapter, opt, (first, ref_probe), ref_grads)


BACKENDS: dict[str, tuple[Any, Any]] = {
    "fsdp2": (wrap_fsdp2, f2.ADAPTER),
    "fsdp1_full_orig": (functools.partial(wrap_fsdp1, strategy=f1.FULL, uop=True), f1.ADAPTER),
    "fsdp1_full_flat": (functools.partial(wrap_fsdp1, strategy=f1.FULL, uop=False), f1.ADAPTER),
    "ddp": (DDP, DDP_ADAPTER),
}


def _add_cases() -> None:
    # Every 3 factors meet in each combination of their values: 27 rows of the 96. DDP
    # shards nothing (keep_unsharded has no effect): a DDP row that repeats another once
    # keep is dropped would be skipped (none does).
    grid = covering(dict(backend=tuple(BACKENDS), ckpt=("none", "nonreentrant"),
                         sync=("every", "last"), keep=(True, False), passes=PROBE_PATTERNS),
                    strength=3)
    for row in grid:
        backend, keep = row["backend"], row["keep"]
        if backend == "ddp":
            keep = True
        tag = "" if backend == "ddp" else f"_{'keep' if keep else 'regather'}"
        name = f"hf_qwen2_tiled_{row['ckpt']}_{backend}{tag}_{row['sync']}_{row['passes']}"
        if name in registry.cases:
            continue
        wrap, adapter = BACKENDS[backend]
        registry.add(name, functools.partial(tiled_rl_parity, wrap, adapter, row["ckpt"],
                                             keep, row["sync"], row["passes"]))


_add_cases()

# HF reentrant checkpointing: each decoder layer's recomputation is a backward pass of
# its own, inside which the tiles run theirs (nested passes two deep). No probe pass: it
# refuses reentrant checkpoints (tests/real_stacks/cases_real_stacks_hf.py).
for _backend, _sync in (("fsdp2", "every"), ("fsdp1_full_orig", "last"),
                        ("fsdp1_full_flat", "every"), ("ddp", "last")):
    _wrap, _adapter = BACKENDS[_backend]
    registry.add(f"hf_qwen2_tiled_reentrant_{_backend}_{_sync}_2real",
                 functools.partial(tiled_rl_parity, _wrap, _adapter, "reentrant", False,
                                   _sync, "2real"))


# --- peft LoRA: adapters inside the tiled MLP -------------------------------------

LORA_TARGETS = ("q_proj", "v_proj", "gate_proj", "down_proj")

for _backend, _wrap, _adapter, _ckpt, _sync in (
        ("fsdp2", wrap_fsdp2_peft, f2.ADAPTER, "nonreentrant", "every"),
        ("fsdp2", wrap_fsdp2_peft, f2.ADAPTER, "none", "last"),
        ("ddp", DDP, DDP_ADAPTER, "nonreentrant", "last")):
    registry.add(
        f"peft_lora_qwen2_tiled_{_ckpt}_{_backend}_{_sync}_probe_2real",
        functools.partial(tiled_rl_parity, _wrap, _adapter, _ckpt, True, _sync,
                          "probe_2real", functools.partial(lora_qwen2, targets=LORA_TARGETS)),
    )


@registry.case()
def hf_qwen2_tiled_ddp_without_block_fails() -> None:
    """The RL step on plain DDP with the tiled MLP, with non-reentrant checkpointing or
    without: the first backward raises (each tile's gradient marks the MLP's parameters
    ready once more). With ``static_graph=True``, the workaround DDP's error names, the
    step runs and is silently wrong: the second pass (the weighted loss, after ``.grad``
    set to None) is never all-reduced, each rank keeps its own gradient."""
    for ckpt in ("none", "nonreentrant"):
        base = tiny_qwen2(ckpt)
        ref = copy.deepcopy(base)
        model = DDP(tile_mlps(base))
        logp = token_logp(model, tokens(0))
        with pytest.raises(RuntimeError, match="marked as ready twice"):
            logp_loss(logp).backward(retain_graph=True)
        model = DDP(tile_mlps(copy.deepcopy(ref)), static_graph=True)
        logp = token_logp(model, tokens(0))
        logp_loss(logp).backward(retain_graph=True)
        for param in model.parameters():
            param.grad = None
        weighted_loss(logp).backward()
        weighted_loss(token_logp(ref, tokens(0))).backward()
        local = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
        want = averaged_grads(ref)
        got = DDP_ADAPTER.full_grads(model)
        assert_close_dicts_tol(got, local, f"plain DDP static_graph, {ckpt}: unreduced")
        error = max(((got[n] - want[n]).norm() / want[n].norm()).item() for n in want)
        assert error > 0.5, f"plain DDP static_graph: relative error only {error:.2e}"
