"""Real stacks that compose the block with other machinery (CPU, gloo).

Run inside ranks by ``tests/real_stacks/test_real_stacks.py``; the model, the RL step and
the parity check are ``tests/real_stacks/cases_real_stacks.py``'s (HF ``Qwen2ForCausalLM``,
one unit per decoder layer plus the root, 3 SGD-momentum steps against an
unsharded reference).

- **FSDP2 HSDP** (``fully_shard`` on a 2 x 2 ``("replicate", "shard")`` mesh,
  as torchtitan runs it; world size 4): HF reentrant checkpointing, and
  non-reentrant with a probe pass; the options and a byte budget. With
  ``keep_unsharded=True`` the step all-gathers only in forward.
- **Activation offload** (verl's ``enable_activation_offload``, torch's
  ``save_on_cpu`` on GPU): ``saved_tensors_hooks`` that copy every saved tensor
  at forward and hand the copy back in backward, around the forward inside the
  block; FSDP1 FULL_SHARD (both ``use_orig_params``) and FSDP2, every option
  with a probe pass first, and ``check_saved_tensors=True`` (its own hooks
  nest inside the offload's).
- **Two models in two blocks** (an actor and a critic, PPO-style), nested
  ``with`` blocks over FSDP2 + FSDP1 (every option), FSDP1 + FSDP1 and FSDP2 +
  FSDP2: a pass
  that reaches only the actor, one that reaches only the critic, and one that
  reaches both; the actor's first pass a probe pass or not. Each model matches
  its own reference.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fsdp_retain import no_reshard_between_backwards
from fsdp_retain._measure import count_collectives
from tests.support import fsdp1_utils as f1
from tests.support import fsdp2_utils as f2
from tests.support.real_stacks_hf import (
    HALF,
    OPTIONS,
    STEPS,
    _opt_tag,
    assert_close_dicts_tol,
    hf_rl_parity,
    logp_loss,
    tiny_qwen2,
    token_logp,
    tokens,
    weighted_loss,
    wrap_fsdp1,
    wrap_fsdp2,
)
from tests.support.harness import Registry
from tests.support.parity import averaged_grads, sgd

registry = Registry()


# --- FSDP2 HSDP -----------------------------------------------------------------


def wrap_fsdp2_hsdp(model: nn.Module) -> nn.Module:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


_HSDP_OPTIONS = {
    # Reentrant checkpointing: the two extremes and a budget; non-reentrant: every option.
    ("reentrant", False): [(True, "every"), (False, "last"), (HALF, "last")],
    ("nonreentrant", True): [*OPTIONS, (HALF, "every"), (HALF, "last")],
}
for (_ckpt, _probe), _options in _HSDP_OPTIONS.items():
    for _keep, _sync in _options:
        registry.add(
            f"hsdp_fsdp2_qwen2_{_ckpt}_{_opt_tag(_keep, _sync)}{'_probe' if _probe else ''}",
            functools.partial(
                hf_rl_parity, wrap_fsdp2_hsdp, f2.ADAPTER, _ckpt, _keep, _sync, _probe
            ),
            world_sizes=(4,),
        )


@registry.case(world_sizes=(4,))
def hsdp_fsdp2_keep_gathers_in_forward_only() -> None:
    """HSDP with ``keep_unsharded=True``: one all-gather per unit, in forward; plain
    FSDP2 re-gathers the layers in both passes."""
    units = 4  # three decoder layers and the root
    for use_block in (True, False):
        model = wrap_fsdp2_hsdp(tiny_qwen2("none"))
        block = no_reshard_between_backwards(model) if use_block else contextlib.nullcontext()
        with count_collectives() as counts, block:
            logp = token_logp(model, tokens(0))
            logp_loss(logp).backward(retain_graph=True)
            weighted_loss(logp).backward()
        expected = units if use_block else units + 2 * (units - 1) + 1
        assert counts.all_gather == expected, (use_block, counts.all_gather, expected)


# --- Activation offload -----------------------------------------------------------


@contextlib.contextmanager
def copy_offload():
    """Every saved tensor copied at forward, the copy handed back in backward (what
    offloading to host memory does, on a CPU run)."""

    def pack(tensor: torch.Tensor):
        return tensor.device, tensor.detach().clone()

    def unpack(packed) -> torch.Tensor:
        device, tensor = packed
        return tensor.to(device)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


_BACKENDS = {
    "fsdp1_full_orig": (functools.partial(wrap_fsdp1, strategy=f1.FULL, uop=True), f1.ADAPTER),
    "fsdp1_full_flat": (functools.partial(wrap_fsdp1, strategy=f1.FULL, uop=False), f1.ADAPTER),
    "fsdp2": (wrap_fsdp2, f2.ADAPTER),
}

for _backend, (_keep, _sync) in itertools.product(_BACKENDS, OPTIONS):
    _wrap, _adapter = _BACKENDS[_backend]
    registry.add(
        f"offload_qwen2_{_backend}_{_opt_tag(_keep, _sync)}_probe",
        functools.partial(
            hf_rl_parity, _wrap, _adapter, "none", _keep, _sync, True, forward_ctx=copy_offload
        ),
    )
for _backend in _BACKENDS:
    _wrap, _adapter = _BACKENDS[_backend]
    registry.add(
        f"offload_qwen2_{_backend}_keep_every_check_saved_tensors",
        functools.partial(
            hf_rl_parity, _wrap, _adapter, "none", True, "every", False,
            forward_ctx=copy_offload, check_saved_tensors=True,
        ),
    )


# --- Two models in two blocks -----------------------------------------------------


def values(critic: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """A value per token from the critic's logits (a stand-in for a value head)."""
    return critic(input_ids=ids).logits.float().mean(-1)


def value_loss(v: torch.Tensor) -> torch.Tensor:
    returns = torch.linspace(-1.0, 1.0, v.shape[-1])
    return (v - returns).pow(2).mean()


def _rl_passes(actor_out, critic_out, actor_block=None, probe: bool = False, actor=None) -> None:
    """Pass 1 reaches the actor only, pass 2 the critic only, pass 3 both. A probe pass
    1: through ``actor_block``, or on the reference a plain pass whose gradients
    ``actor``'s are then cleared of."""
    if probe and actor_block is not None:
        actor_block.backward(logp_loss(actor_out), param_grads=False, retain_graph=True)
    else:
        logp_loss(actor_out).backward(retain_graph=True)
        if probe:
            actor.zero_grad(set_to_none=True)
    value_loss(critic_out).backward(retain_graph=True)
    (weighted_loss(actor_out) + 0.1 * critic_out.mean()).backward()


def two_models(actor_backend: str, critic_backend: str, keep, sync: str, probe: bool) -> None:
    """An actor and a critic, each in its own nested block: each matches its reference."""
    wraps = {"fsdp1": _BACKENDS["fsdp1_full_orig"], "fsdp2": _BACKENDS["fsdp2"]}
    actor = tiny_qwen2("none")
    critic = tiny_qwen2("none")
    torch.manual_seed(3)
    for p in critic.parameters():  # a different model from the actor
        if p.dim() > 1:
            nn.init.normal_(p, std=0.05)
    refs = [copy.deepcopy(actor), copy.deepcopy(critic)]
    (wrap_a, adapter_a), (wrap_c, adapter_c) = wraps[actor_backend], wraps[critic_backend]
    models = [wrap_a(actor), wrap_c(critic)]
    adapters = [adapter_a, adapter_c]
    opts, ref_opts = [sgd(m) for m in models], [sgd(r) for r in refs]
    for step in range(STEPS):
        ids = tokens(step)
        _rl_passes(token_logp(refs[0], ids), values(refs[1], ids), probe=probe, actor=refs[0])
        ref_grads = [averaged_grads(r) for r in refs]
        for ref, grads, opt in zip(refs, ref_grads, ref_opts):
            for name, param in ref.named_parameters():
                param.grad = grads.get(name)
            opt.step()
            opt.zero_grad()

        options = dict(keep_unsharded=keep, sync_grads=sync)
        with no_reshard_between_backwards(models[0], **options) as actor_block:
            with no_reshard_between_backwards(models[1], **options) as critic_block:
                _rl_passes(
                    token_logp(models[0], ids), values(models[1], ids), actor_block, probe
                )
        assert actor_block.backward_passes == 2, actor_block.backward_passes
        assert critic_block.backward_passes == 2, critic_block.backward_passes
        for i, (model, adapter, opt, ref) in enumerate(zip(models, adapters, opts, refs)):
            where = f"step {step}, {'actor' if i == 0 else 'critic'}"
            grads = adapter.full_grads(model)
            for name in set(grads) - set(ref_grads[i]):
                del grads[name]  # FSDP1's flat gradient covers unused slices too
            assert_close_dicts_tol(grads, ref_grads[i], f"{where}: grads")
            opt.step()
            opt.zero_grad()
            ref_params = {n: p.detach() for n, p in ref.named_parameters()}
            assert_close_dicts_tol(adapter.full_params(model), ref_params, f"{where}: params")


# FSDP2 actor and FSDP1 critic: every option, probe or not; same-flavour pairs: two.
_PAIRS = [
    (("fsdp2", "fsdp1"), OPTIONS, (False, True)),
    (("fsdp1", "fsdp1"), [(True, "every"), (False, "last")], (True,)),
    (("fsdp2", "fsdp2"), [(True, "last"), (False, "every")], (True,)),
]
for (_a, _c), _options, _probes in _PAIRS:
    for (_keep, _sync), _probe in itertools.product(_options, _probes):
        registry.add(
            f"two_models_{_a}_actor_{_c}_critic_{_opt_tag(_keep, _sync)}"
            f"{'_probe' if _probe else ''}",
            functools.partial(two_models, _a, _c, _keep, _sync, _probe),
        )
