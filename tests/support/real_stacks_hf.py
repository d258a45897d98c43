"""The HF Qwen2 stack that the real-stacks cases share (``tests/real_stacks/cases_real_stacks*.py``).

The tiny ``Qwen2ForCausalLM`` (three decoder layers; HF reentrant, non-reentrant
or no gradient checkpointing; peft LoRA on top), wrapped one unit per decoder layer
plus the root for FSDP1 and FSDP2; the RL step (``-logp.mean()`` backward, grads set
to None, a position-weighted log-prob loss) and ``hf_rl_parity``, which checks it
against an unsharded reference (deep copy before wrapping, gradients averaged over
ranks) over 3 SGD-momentum steps, with the activation gradients pass 1 shows.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

from fsdp_retain import no_reshard_between_backwards
from tests.support import fsdp1_utils as f1
from tests.support.parity import assert_close_dicts, sgd, step_averaged, world

OPTIONS = [(True, "every"), (True, "last"), (False, "every"), (False, "last")]
VOCAB, SEQ, BATCH = 64, 8, 2
STEPS = 3
TOL = dict(rtol=1e-4, atol=1e-5)
# keep_unsharded as a byte budget of half the model's unsharded parameter bytes: the
# root and the last decoder layer are kept, the other two layers re-gathered per pass.
HALF = "half"


def _opt_tag(keep, sync: str) -> str:
    if keep == HALF:
        return f"budget_half_{sync}"
    return f"{'keep' if keep else 'regather'}_{sync}"


# --- HF Qwen2 with gradient checkpointing ------------------------------------


def tiny_qwen2(ckpt: str) -> Qwen2ForCausalLM:
    """The issue's model; ``ckpt`` is ``"reentrant"``, ``"nonreentrant"`` or ``"none"``."""
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    torch.manual_seed(42)
    model = Qwen2ForCausalLM(config)
    model.train()
    if ckpt != "none":
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": ckpt == "reentrant"}
        )
        model.enable_input_require_grads()
    return model


def tokens(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(42 + dist.get_rank() + 1 + 1000 * step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)


def token_logp(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1].float()
    return logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def logp_loss(logp: torch.Tensor) -> torch.Tensor:
    return -logp.mean()


def weighted_loss(logp: torch.Tensor) -> torch.Tensor:
    weight = torch.linspace(0.5, 1.5, logp.shape[-1])
    return -(logp * weight).mean()


def wrap_fsdp1(model: nn.Module, strategy, uop: bool) -> nn.Module:
    kwargs = {}
    if strategy == f1.HYBRID:
        kwargs["device_mesh"] = init_device_mesh(
            "cpu", (world() // 2, 2), mesh_dim_names=("replicate", "shard")
        )
    return FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy({Qwen2DecoderLayer}),
        sharding_strategy=strategy,
        use_orig_params=uop,
        device_id=torch.device("cpu"),
        **kwargs,
    )


def wrap_fsdp2(model: Qwen2ForCausalLM) -> nn.Module:
    mesh = init_device_mesh("cpu", (world(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class ActivationGrads:
    """Gradients reaching each decoder layer's MLP output, as hooks see them."""

    def __init__(self, model: nn.Module) -> None:
        self.seen: dict[int, list[torch.Tensor]] = {}
        self.active = True
        mlps = [m for n, m in model.named_modules() if n.endswith("mlp")]
        assert len(mlps) == 3, [n for n, _ in model.named_modules()]
        for i, mlp in enumerate(mlps):
            mlp.register_forward_hook(functools.partial(self._forward, i))

    def _forward(self, index: int, module, args, out) -> None:
        # Reentrant checkpointing: no graph in the first forward, one in each recompute.
        if out.requires_grad:
            out.register_hook(functools.partial(self._grad, index))

    def _grad(self, index: int, grad: torch.Tensor) -> None:
        if self.active:
            self.seen.setdefault(index, []).append(grad.detach().clone())

    def take(self) -> dict[int, list[torch.Tensor]]:
        seen, self.seen = self.seen, {}
        return seen


def hf_rl_parity(
    wrap, adapter, ckpt: str, keep, sync: str, probe: bool, make=None,
    forward_ctx=contextlib.nullcontext, **block_kwargs,
) -> None:
    """Three RL steps (log-prob loss, grads set to None, weighted loss) match the reference.

    ``forward_ctx`` wraps both forwards (e.g. activation offload); ``block_kwargs``
    go to the block next to ``keep_unsharded`` and ``sync_grads``."""
    model = tiny_qwen2(ckpt) if make is None else make(ckpt)
    ref = copy.deepcopy(model)
    budget = keep == HALF
    if budget:
        keep = sum(p.numel() * p.element_size() for p in ref.parameters()) // 2
    model = wrap(model)
    opt, ref_opt = sgd(model), sgd(ref)
    hooks, ref_hooks = ActivationGrads(model), ActivationGrads(ref)
    for step in range(STEPS):
        ids = tokens(step)
        with forward_ctx():
            logp = token_logp(ref, ids)
        ref_first, ref_grads = reference_rl_step(ref, ref_opt, ref_hooks, logp)

        with no_reshard_between_backwards(
            model, keep_unsharded=keep, sync_grads=sync, **block_kwargs
        ) as block:
            with forward_ctx():
                logp = token_logp(model, ids)
            block.backward(logp_loss(logp), param_grads=not probe, retain_graph=True)
            first = hooks.take()
            for param in model.parameters():
                param.grad = None
            weighted_loss(logp).backward()
            hooks.take()
        if budget:  # the root and the last layer of four units
            assert block._kept_count() == 2, f"kept {block._kept_count()} units, not 2"
        check_rl_step(f"step {step}", model, ref, adapter, opt, (first, ref_first), ref_grads)


def reference_rl_step(ref: nn.Module, opt, hooks: ActivationGrads, logp: torch.Tensor,
                      keep_logp_grads: bool = False) -> tuple[dict, dict]:
    """The reference's RL step over ``logp`` (its forward's): the log-prob loss, its
    gradients dropped unless ``keep_logp_grads``, the weighted loss, the gradients averaged
    over ranks, an optimizer step. Returns the log-prob pass's activation gradients and the
    averaged gradients."""
    logp_loss(logp).backward(retain_graph=True)
    first = hooks.take()
    if not keep_logp_grads:
        ref.zero_grad(set_to_none=True)
    weighted_loss(logp).backward()
    hooks.take()
    return first, step_averaged(ref, opt)


def check_rl_step(where: str, model: nn.Module, ref: nn.Module, adapter, opt,
                  activations: tuple[dict, dict], ref_grads: dict) -> None:
    """After the model's step in the block: the activation gradients of its log-prob pass
    (``activations``: the model's, the reference's), its gradients, then its parameters
    after an optimizer step, against the reference's (stepped by ``reference_rl_step``)."""
    first, ref_first = activations
    assert sorted(first) == sorted(ref_first) == [0, 1, 2], (sorted(first), sorted(ref_first))
    for index in ref_first:
        torch.testing.assert_close(
            torch.stack(first[index]).sum(0), torch.stack(ref_first[index]).sum(0), **TOL,
            msg=lambda m, i=index: f"{where}: log-prob pass activation grad of layer {i}: {m}",
        )
    grads = adapter.full_grads(model)
    for name in set(grads) - set(ref_grads):
        # FSDP1 computes the whole flat gradient, frozen parameters' slices too
        # (plain FSDP1 alike); the optimizer never sees them, params are compared.
        del grads[name]
    assert_close_dicts_tol(grads, ref_grads, f"{where}: grads")
    opt.step()
    opt.zero_grad()
    ref_params = {n: p.detach() for n, p in ref.named_parameters()}
    assert_close_dicts_tol(adapter.full_params(model), ref_params, f"{where}: params")


def assert_close_dicts_tol(actual, expected, what: str) -> None:
    assert_close_dicts(actual, expected, what, TOL)


def lora_qwen2(ckpt: str, targets: tuple[str, ...] = ("q_proj", "v_proj")) -> nn.Module:
    """peft ``get_peft_model`` on the tiny Qwen2 (adapters on ``targets``): the base
    and the embedding are frozen, so decoder layer 0's input needs no gradient."""
    from peft import LoraConfig, get_peft_model

    model = tiny_qwen2(ckpt)
    torch.manual_seed(7)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(targets))
    model = get_peft_model(model, config)
    for module in model.modules():
        if hasattr(module, "lora_B"):
            for linear in module.lora_B.values():
                nn.init.normal_(linear.weight, std=0.02)  # peft starts B at zero
    model.train()
    return model


def wrap_fsdp2_peft(model: nn.Module) -> nn.Module:
    mesh = init_device_mesh("cpu", (world(),))
    for module in model.modules():
        if isinstance(module, Qwen2DecoderLayer):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
