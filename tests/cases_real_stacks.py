"""Configurations from real training stacks (CPU, gloo): each case names its stack.

Run inside ranks by ``tests/test_real_stacks.py``. Grow this module: every
configuration users run that the rest of the suite did not cover gets a case
here, with the stack in its name and docstring.

- **HF reentrant gradient checkpointing** (``Qwen2ForCausalLM`` with
  ``gradient_checkpointing_enable({"use_reentrant": True})`` and
  ``enable_input_require_grads()``, as RL and fine-tuning stacks ran it for
  years), and non-reentrant for comparison: FSDP1 FULL_SHARD and
  SHARD_GRAD_OP (world size 2) and HYBRID_SHARD (world size 4), both
  ``use_orig_params``, one unit per ``Qwen2DecoderLayer`` plus the root; FSDP2
  the same way. The RL step: ``-logp.mean()`` backward, ``p.grad = None``,
  then a position-weighted log-prob loss; or pass 1 as a probe pass, whose
  activation hooks must see the reference's gradients. Every option, also
  ``keep_unsharded`` as a byte budget (half the model: the root and the last
  layer kept, two layers re-gathered per pass).
- **torch.utils.checkpoint(..., use_reentrant=True)** inside each unit and
  around each FSDP1 unit.
- **A forward before the block** (``out = model(x)`` above the ``with``):
  FSDP1 refuses the pass before any gradient moves and stays usable; FSDP2
  is right.
- **The FSDP1 guards** (see ``[Note: what the FSDP1 guards check]``): a unit
  whose reduction hook is gone raises instead of leaving an unreduced
  gradient.

Parity is against an unsharded reference (deep copy before wrapping, the
same checkpointing, gradients averaged over ranks) over 3 SGD-momentum steps.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.utils.checkpoint import checkpoint
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

from fsdp_retain import no_reshard_between_backwards
from tests import fsdp1_utils as f1
from tests import fsdp2_utils as f2
from tests.harness import Registry
from tests.parity import (
    Block,
    Scenario,
    assert_close_dicts,
    averaged_grads,
    batch,
    block_options,
    make_net,
    reference_copy,
    run_parity,
    sgd,
    world,
)

registry = Registry()
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
        logp_loss(logp).backward(retain_graph=True)
        ref_first = ref_hooks.take()
        ref.zero_grad(set_to_none=True)
        weighted_loss(logp).backward()
        ref_hooks.take()
        ref_grads = averaged_grads(ref)
        for name, param in ref.named_parameters():
            param.grad = ref_grads.get(name)
        ref_opt.step()
        ref_opt.zero_grad()

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
            assert len(block._kept) == 2, f"kept {len(block._kept)} units, not 2"
        where = f"step {step}"
        assert sorted(first) == sorted(ref_first) == [0, 1, 2], (sorted(first), sorted(ref_first))
        for index in ref_first:
            torch.testing.assert_close(
                torch.stack(first[index]).sum(0), torch.stack(ref_first[index]).sum(0), **TOL,
                msg=lambda m, i=index: f"{where}: pass-1 activation grad of layer {i}: {m}",
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
    assert set(actual) == set(expected), f"{what}: names differ: {set(actual) ^ set(expected)}"
    for name in expected:
        torch.testing.assert_close(
            actual[name], expected[name], **TOL, msg=lambda m, n=name: f"{what}: {n}: {m}"
        )


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
    """Reentrant: every FSDP1 strategy and use_orig_params, FSDP2, every option (probe
    passes refuse reentrant checkpoints, see below). Non-reentrant: the same with
    probe passes."""
    fsdp1 = [(f1.FULL, (2,)), (f1.GRAD_OP, (2,)), (f1.HYBRID, (4,))]
    for ckpt, probe in (("reentrant", False), ("nonreentrant", True)):
        for (strategy, sizes), uop, (keep, sync) in itertools.product(
            fsdp1, (True, False), OPTIONS
        ):
            _add_hf_case(ckpt, "fsdp1", strategy, uop, keep, sync, probe, sizes)
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


def lora_qwen2(ckpt: str) -> nn.Module:
    """peft ``get_peft_model`` on the tiny Qwen2 (q_proj and v_proj adapters): the
    base and the embedding are frozen, so decoder layer 0's input needs no gradient."""
    from peft import LoraConfig, get_peft_model

    model = tiny_qwen2(ckpt)
    torch.manual_seed(7)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(model, config)
    for module in model.modules():
        if hasattr(module, "lora_B"):
            for linear in module.lora_B.values():
                nn.init.normal_(linear.weight, std=0.02)  # peft starts B at zero
    model.train()
    return model


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
            hf_rl_parity, _wrap_fsdp2_peft, f2.ADAPTER, ckpt, keep, sync, True, lora_qwen2
        )
        registry.add(f"peft_lora_qwen2_fsdp2_{tag}_probe", fn)


def _wrap_fsdp2_peft(model: nn.Module) -> nn.Module:
    mesh = init_device_mesh("cpu", (world(),))
    for module in model.modules():
        if isinstance(module, Qwen2DecoderLayer):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


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


# --- torch.utils.checkpoint(use_reentrant=True) around and inside units -------


class Reentrant(nn.Module):
    """``checkpoint(module, x, use_reentrant=True)``: around an FSDP1 unit when
    ``module`` is one."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.module, x, use_reentrant=True)


class ReentrantBlock(Block):
    """A ``Block`` whose body is reentrant-checkpointed inside the unit."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(super().forward, x, use_reentrant=True)


def _checkpointed(where: str, backend: str, strategy, uop: bool):
    model = make_net()
    if where == "inside":
        for block in model.blocks:
            block.__class__ = ReentrantBlock
    ref = reference_copy(model)
    if where == "around":
        for i, block in enumerate(ref.blocks):
            ref.blocks[i] = Reentrant(block)
    if backend == "fsdp2":
        mesh = init_device_mesh("cpu", (world(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped, adapter = model, f2.ADAPTER
    else:
        policy = ModuleWrapPolicy({ReentrantBlock if where == "inside" else Block})
        wrapped = FSDP(
            model, auto_wrap_policy=policy, sharding_strategy=strategy,
            use_orig_params=uop, device_id=torch.device("cpu"),
        )
        adapter = f1.ADAPTER
    if where == "around":
        for i, block in enumerate(wrapped.blocks):
            wrapped.blocks[i] = Reentrant(block)
    return wrapped, ref, adapter


def _torch_reentrant_case(
    where, backend, strategy, uop, keep, sync, passes, zero_between, backwards=None
):
    model, ref, adapter = _checkpointed(where, backend, strategy, uop)
    scenario = Scenario(
        passes=passes,
        zero_between=zero_between,
        steps=STEPS,
        options=block_options(keep, sync, backwards),
        check_between=sync == "every",
    )
    run_parity(model, ref, scenario, adapter)


def _add_torch_reentrant_cases() -> None:
    fsdp1 = [(f1.FULL, uop) for uop in (True, False)] + [
        (f1.GRAD_OP, True), (f1.NO_SHARD, True), (f1.NO_SHARD, False)
    ]
    for where in ("inside", "around"):
        for (strategy, uop), (keep, sync) in itertools.product(fsdp1, OPTIONS):
            for passes, zero_between in ((2, False), (3, True)):
                name = (
                    f"torch_reentrant_{where}_fsdp1_{f1.STRATEGY_NAMES[strategy]}_"
                    f"{'orig' if uop else 'flat'}_{_opt_tag(keep, sync)}_p{passes}"
                    f"{'_zero' if zero_between else ''}"
                )
                fn = functools.partial(
                    _torch_reentrant_case, where, "fsdp1", strategy, uop, keep, sync,
                    passes, zero_between,
                )
                registry.add(name, fn)
        # backwards=N: the last pass reduces what it accumulates into, the rest is
        # reduced at exit; reentrant units accumulate only inside the recompute.
        for uop, keep in itertools.product((True, False), (True, False)):
            name = (
                f"torch_reentrant_{where}_fsdp1_full_{'orig' if uop else 'flat'}_"
                f"{_opt_tag(keep, 'last')}_backwards3"
            )
            fn = functools.partial(
                _torch_reentrant_case, where, "fsdp1", f1.FULL, uop, keep, "last", 3, True, 3
            )
            registry.add(name, fn)
        if where == "around":
            continue  # fully_shard's hooks are module hooks: no "around" for FSDP2
        for keep, sync in OPTIONS:
            name = f"torch_reentrant_{where}_fsdp2_{_opt_tag(keep, sync)}"
            fn = functools.partial(
                _torch_reentrant_case, where, "fsdp2", None, False, keep, sync, 2, False
            )
            registry.add(name, fn)


_add_torch_reentrant_cases()


# --- A forward before the block -----------------------------------------------


def _forward_before_fsdp1(strategy, uop: bool, keep: bool, sync: str) -> None:
    """``out = model(x)`` above the ``with``: the first pass raises a RuntimeError that
    names the block and the fix before any gradient is written; the next plain steps
    and block steps match the reference."""
    model = make_net()
    ref = reference_copy(model)
    model = f1.wrap(model, strategy, use_orig_params=uop)
    run_parity(model, ref, Scenario(passes=1, steps=1, use_block=False), f1.ADAPTER)
    grads_before = f1.full_grads(model)
    out = model(batch(5))
    with pytest.raises(RuntimeError) as caught:
        with no_reshard_between_backwards(model, keep_unsharded=keep, sync_grads=sync):
            out.sum().backward(retain_graph=True)
            out.pow(2).sum().backward()
    text = str(caught.value)
    assert text.startswith("no_reshard_between_backwards:"), text
    assert "forward ran before the block" in text and "Run the forward inside" in text, text
    assert_close_dicts(f1.full_grads(model), grads_before, "grads after the refused pass")
    model.zero_grad()
    ref.zero_grad()
    run_parity(model, ref, Scenario(passes=1, steps=2, use_block=False), f1.ADAPTER)
    run_parity(
        model, ref,
        Scenario(passes=2, steps=1, options=block_options(keep, sync), check_between=False),
        f1.ADAPTER,
    )


def _add_forward_before_cases() -> None:
    for strategy, uop in itertools.product((f1.FULL, f1.GRAD_OP, f1.NO_SHARD), (True, False)):
        for keep, sync in OPTIONS if strategy == f1.FULL else OPTIONS[:1]:
            name = (
                f"forward_before_block_fsdp1_{f1.STRATEGY_NAMES[strategy]}_"
                f"{'orig' if uop else 'flat'}_{_opt_tag(keep, sync)}"
            )
            registry.add(name, functools.partial(_forward_before_fsdp1, strategy, uop, keep, sync))


_add_forward_before_cases()


@registry.case()
def forward_before_block_fsdp1_without_block_wrong() -> None:
    """Without the library the same layout crashes or gives wrong gradients on FSDP1
    (so the refusal is needed)."""
    model = make_net()
    ref = reference_copy(model)
    model = f1.wrap(model, f1.FULL, use_orig_params=True)
    x = batch(0)
    out = model(x)
    try:
        out.sum().backward(retain_graph=True)
        out.pow(2).sum().backward()
    except RuntimeError:
        return
    ref_out = ref(x)
    ref_out.sum().backward(retain_graph=True)
    ref_out.pow(2).sum().backward()
    expected = averaged_grads(ref)
    got = f1.full_grads(model)
    assert any(
        got.get(n) is None or not torch.allclose(got[n], expected[n], atol=1e-4)
        for n in expected
    ), "plain FSDP1 got the right gradients: the refusal would not be needed"


@registry.case()
def forward_before_block_fsdp2_parity() -> None:
    """FSDP2: a forward above the ``with`` then two passes inside match the reference
    over 3 steps, every option."""
    for keep, sync in OPTIONS:
        model = make_net()
        ref = reference_copy(model)
        model = f2.wrap(model)
        opt, ref_opt = sgd(model), sgd(ref)
        for step in range(STEPS):
            x = batch(step)
            ref_out = ref(x)
            ref_out.mean().backward(retain_graph=True)
            ref_out.pow(2).mean().backward()
            ref_grads = averaged_grads(ref)
            for name, param in ref.named_parameters():
                param.grad = ref_grads[name]
            ref_opt.step()
            ref_opt.zero_grad()
            out = model(x)
            with no_reshard_between_backwards(model, keep_unsharded=keep, sync_grads=sync):
                out.mean().backward(retain_graph=True)
                out.pow(2).mean().backward()
            assert_close_dicts(f2.full_grads(model), ref_grads, f"{keep}/{sync} step {step}")
            opt.step()
            opt.zero_grad()


# --- The FSDP1 guards ----------------------------------------------------------


class LossNet(nn.Module):
    """Returns a scalar loss from inside the root: backward starts at the root's
    output, where FSDP1's root pre-backward hook queues its final callback first."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).pow(2).mean()


def _drop_reduction_hook(model: nn.Module) -> None:
    """What a missed post-backward hook looks like: FSDP1 keeps the hook state,
    but the hook on the first block's AccumulateGrad node is gone."""
    unit = next(m for m in FSDP.fsdp_modules(model) if isinstance(m._fsdp_wrapped_module, Block))
    unit._handle.flat_param._post_backward_hook_state[-1].remove()


def _guard_case(strategy, root_output: bool, sync: str) -> None:
    """A unit that accumulates a gradient without FSDP1's reduction hook raises a
    RuntimeError naming the block, instead of leaving a wrong gradient."""
    torch.manual_seed(0)
    net = LossNet() if root_output else make_net()
    model = FSDP(
        net, auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=strategy,
        device_id=torch.device("cpu"),
    )
    x = batch(0)
    with pytest.raises(RuntimeError) as caught:
        with no_reshard_between_backwards(model, sync_grads=sync):
            out = model(x)
            loss = out if root_output else out.pow(2).mean()
            _drop_reduction_hook(model)
            loss.backward()
    text = str(caught.value)
    assert text.startswith("no_reshard_between_backwards:"), text
    assert "blocks.0" in text, text
    if root_output and sync == "every":
        assert "unsharded .grad" in text, text
    else:
        assert "without running FSDP1's post-backward hook" in text, text
    model.zero_grad()
    loss = model(x)
    (loss if root_output else loss.pow(2).mean()).backward()  # usable again


def _add_guard_cases() -> None:
    for strategy, root_output, sync in itertools.product(
        (f1.FULL, f1.NO_SHARD), (False, True), ("every", "last")
    ):
        if strategy == f1.NO_SHARD and root_output and sync == "every":
            continue  # reduced and unreduced look alike; see the guards' note
        name = (
            f"guard_missed_reduction_fsdp1_{f1.STRATEGY_NAMES[strategy]}_"
            f"{'root_output' if root_output else 'loss_outside'}_{sync}"
        )
        registry.add(name, functools.partial(_guard_case, strategy, root_output, sync))


_add_guard_cases()


# --- Hooks for one pass (bergson-style collectors) -----------------------------


def _one_pass_hooks(backend: str) -> None:
    """A collector's full backward hooks on every Linear (as bergson registers them)
    see ``block.pass_index`` and ``block.probing``: a probe pass then two normal
    passes read (1, True), (2, False), (3, False), and a hook that acts only while
    probing collects exactly the probe pass's gradients."""
    model = make_net()
    ref = reference_copy(model)
    model = f2.wrap(model) if backend == "fsdp2" else f1.wrap(model, use_orig_params=True)
    seen: list[tuple[int, bool]] = []
    collected: dict[str, torch.Tensor] = {}
    block_box: list = []

    def collector(name, module, grad_input, grad_output):
        block = block_box[0]
        seen.append((block.pass_index, block.probing))
        if block.probing:  # the one-pass pattern
            assert name not in collected, f"{name} collected twice"
            collected[name] = grad_output[0].detach().clone()

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and "blocks" in name:
            module.register_full_backward_hook(functools.partial(collector, name))
    x = batch(0)
    with no_reshard_between_backwards(model) as block:
        block_box.append(block)
        assert block.pass_index == 0 and not block.probing
        out = model(x)
        block.backward(out.pow(2).mean(), param_grads=False, retain_graph=True)
        assert block.pass_index == 1
        out.mean().backward(retain_graph=True)
        out.pow(2).mean().backward()
    assert sorted(set(seen)) == [(1, True), (2, False), (3, False)], sorted(set(seen))
    assert len(collected) == 6, sorted(collected)
    ref_grads: dict[str, torch.Tensor] = {}
    for name, module in ref.named_modules():
        if isinstance(module, nn.Linear) and "blocks" in name:
            module.register_full_backward_hook(
                lambda m, gi, go, name=name: ref_grads.update({name: go[0].detach().clone()})
            )
    ref(x).pow(2).mean().backward()
    for name, grad in collected.items():
        clean = name.replace("_fsdp_wrapped_module.", "")
        torch.testing.assert_close(grad, ref_grads[clean], **TOL)


for _backend in ("fsdp1", "fsdp2"):
    registry.add(f"one_pass_hooks_{_backend}", functools.partial(_one_pass_hooks, _backend))
