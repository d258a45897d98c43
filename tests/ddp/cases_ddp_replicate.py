"""The composable ``replicate`` (DDP's reducer behind torchtitan's ``apply_ddp`` and
OLMo-core's ``Transformer.apply_ddp``): several backward passes over one forward, CPU/gloo,
world size 2. A part of the DDP launch (``tests/ddp/test_ddp.py``).

As in tests/ddp/cases_ddp.py (whose helpers these reuse): the model ``replicate`` returns
trains beside an unwrapped copy for 3 SGD steps (momentum 0.9), float64, gradients and
parameters compared after every step against one backward of the summed losses averaged
over ranks; the same passes without the block are wrong or raise; all-reduces are counted
per step against a formula (one per DDP bucket per reduction, plus the used-map where DDP
tracks unused parameters). The block installs at the first forward inside it, after
replicate's lazy init: every case's first step is replicate's first forward.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._dynamo
import torch._functorch.config as functorch_config
import torch.distributed as dist
import torch.nn as nn
from torch._dynamo.utils import counters
from torch.distributed._composable.replicate import replicate
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh

import fsdp_retain
from fsdp_retain import no_reshard_between_backwards
from fsdp_retain._measure import count_collectives
from tests.support.case_parts import covering
from tests.ddp.cases_ddp import (
    DIM,
    TOL,
    Setting,
    TwoHeads,
    assert_plain_wrong,
    batch,
    check_frozen_after_wrapping,
    check_buckets_rebuilt,
    check_storage_swapped,
    loss1,
    loss2,
    parity,
    reducer_owner,
    reductions,
    rel_error,
    train,
    two_losses,
    two_microbatch_losses,
)
from tests.support.harness import Registry
from tests.support.parity import LOSSES, Net

registry = Registry()


def replicate_on_mesh(module: nn.Module, **kwargs: Any) -> nn.Module:
    """``replicate(module, device_mesh=<1-D mesh of every rank>)``, as torchtitan calls it."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return replicate(module, device_mesh=mesh, **kwargs)


SETTINGS = {
    "default": Setting(wrapper=replicate),
    "mesh": Setting(wrapper=replicate_on_mesh),
    "static": Setting(ddp=dict(static_graph=True), wrapper=replicate),
    "unused": Setting(ddp=dict(find_unused_parameters=True), wrapper=replicate),
    # register_comm_hook on the model: replicate installs it at its lazy init.
    "fp16": Setting(hook=default_hooks.fp16_compress_hook, dtype=torch.float32, tol=5e-3,
                    wrapper=replicate),
}


# Parity across the options and replicate's settings (cases_ddp.parity: the block right,
# its all-reduces counted; the same passes without it wrong or raising) #
for _row in covering({"setting": tuple(SETTINGS), "sync": ("every", "last"),
                      "backwards": (False, True), "probe": (False, True)}, 2):
    registry.add(
        "replicate_parity_" + _row["setting"] + f"_{_row['sync']}"
        + ("_n" if _row["backwards"] else "") + ("_probe" if _row["probe"] else ""),
        parity(_row["setting"], _row["sync"], _row["backwards"], _row["probe"], SETTINGS),
    )


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, 2 * DIM + 1), nn.Tanh(), nn.Linear(2 * DIM + 1, 3))


def mlp_losses(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return out.pow(2).mean(), out.tanh().mean()


@registry.case()
def replicate_plain_is_wrong() -> None:
    """Plain ``replicate`` on a toy MLP, two passes over one forward (the first reduced,
    the second left local, no error): silently wrong, above 1e-2; in the block below
    1e-10."""
    def step(use_block: bool) -> Callable[[nn.Module, torch.Tensor], None]:
        def run(model: nn.Module, x: torch.Tensor) -> None:
            with (no_reshard_between_backwards(model) if use_block else contextlib.nullcontext()):
                first, second = mlp_losses(model(x))
                first.backward(retain_graph=True)
                second.backward()
        return run

    def summed(out: torch.Tensor) -> torch.Tensor:
        return sum(mlp_losses(out))

    plain = max(train(SETTINGS["default"], step(False), summed, make=mlp))
    block = max(train(SETTINGS["default"], step(True), summed, make=mlp))
    assert plain > 1e-2 and block < TOL, (plain, block)


# Gradient accumulation: replicate's no_sync() is set_requires_gradient_sync(False) #
@registry.case()
def replicate_accumulation() -> None:
    """Micro-batch 1 after ``set_requires_gradient_sync(False)`` (the block reduces
    nothing, and leaves replicate's sync off as the user set it), micro-batch 2 after
    ``set_requires_gradient_sync(True)``: the block reduces both once (``"last"``);
    plain replicate reduces only the first pass of micro-batch 2, or raises."""
    setting = SETTINGS["default"]

    def micro(model: nn.Module, x: torch.Tensor, use_block: bool, counts: dict) -> None:
        def block(m: nn.Module) -> Any:
            return (no_reshard_between_backwards(m, sync_grads="last") if use_block
                    else contextlib.nullcontext())

        model.set_requires_gradient_sync(False)
        with count_collectives(modules=False) as c:
            with block(model):
                out = model(x[:3])
                loss1(out).backward(retain_graph=True)
                loss2(out).backward()
        counts["off"], counts["no_sync"] = c.all_reduce, replicate.state(model)._no_sync
        model.set_requires_gradient_sync(True)
        with count_collectives(modules=False) as c:
            with block(model):
                out = model(x[3:])
                loss1(out).backward(retain_graph=True)
                loss2(out).backward()
        counts["on"] = c.all_reduce

    counts: dict = {}

    def check(model: nn.Module, result: Any, step: int) -> None:
        assert counts["off"] == 0 and counts["no_sync"] is True, counts
        assert counts["on"] == reductions(model, 1), counts

    errors = train(setting, lambda m, x: micro(m, x, True, counts), two_microbatch_losses,
                   check=check)
    assert max(errors) < TOL, errors
    assert_plain_wrong(setting, lambda m, x: micro(m, x, False, {}), two_microbatch_losses)


@registry.case()
def replicate_per_loss_grads() -> None:
    """``block.grads`` per loss on a replicate model: averaged over ranks (the same on
    every rank); ``apply_grads`` of their sum trains as one backward of the sum."""
    def step(model: nn.Module, x: torch.Tensor) -> None:
        with no_reshard_between_backwards(model) as block:
            out = model(x)
            grads = [block.grads(loss1(out), retain_graph=True), block.grads(loss2(out))]
            fsdp_retain.apply_grads(fsdp_retain.combine(grads, torch.ones(2, dtype=torch.float64)))
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        others = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(others, flat)
        assert all(torch.equal(o, flat) for o in others)

    errors = train(SETTINGS["default"], step, two_losses)
    assert max(errors) < TOL, errors


# Refusals and exits #
@registry.case()
def replicate_refusals_and_abort() -> None:
    """``reshard_to`` is refused naming the fix; an exception before the first forward
    leaves replicate uninitialised (the next block initialises it); an exception after a
    pass communicates nothing, drops the accumulated gradients and leaves replicate's
    ``_no_sync``, its DDP's ``require_backward_grad_sync`` and static_graph's delayed
    all-reduce flag as they were; replicate over a ``fully_shard`` submodule is refused
    naming the fix."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(42)
    model = replicate(TwoHeads().double(), static_graph=True)
    with pytest.raises(ValueError, match="Drop reshard_to"):
        with no_reshard_between_backwards(model, keep_unsharded=False, reshard_to=2):
            pass
    state = replicate.state(model)
    with pytest.raises(KeyError):
        with no_reshard_between_backwards(model):
            raise KeyError("before the first forward")
    assert state._init_args and not hasattr(state, "_ddp"), "initialised without a forward"
    with no_reshard_between_backwards(model):
        out = model(batch(0))
        loss1(out).backward(retain_graph=True)
        loss2(out).backward()
    ddp = reducer_owner(model)
    before = (state._no_sync, ddp.require_backward_grad_sync,
              ddp._static_graph_delay_allreduce_enqueued)
    model.zero_grad(set_to_none=True)
    with count_collectives(modules=False) as counts:
        with pytest.raises(KeyError):
            with no_reshard_between_backwards(model, sync_grads="last"):
                out = model(batch(1))
                loss1(out).backward(retain_graph=True)
                raise KeyError("boom")
    assert counts.all_reduce == 0, counts
    assert all(p.grad is None for p in model.parameters())
    assert (state._no_sync, ddp.require_backward_grad_sync,
            ddp._static_graph_delay_allreduce_enqueued) == before

    net = Net()
    fully_shard(net.blocks[0])
    replicate(net)
    with pytest.raises(ValueError, match=r"fully_shard manages \(blocks\.0 in the DDPNet\)"):
        with no_reshard_between_backwards(net):
            pass
    assert all(p.grad is None for p in net.parameters())


@registry.case()
def unrecognised_wrapper_names_what_it_found() -> None:
    """A module the block does not take is refused before anything runs, naming its
    class, the composable state attached to it and what the block supports."""
    from torch.distributed._composable import checkpoint

    net = checkpoint(Net())
    with pytest.raises(ValueError) as info:
        with no_reshard_between_backwards(net):
            pass
    message = str(info.value)
    assert message.startswith(
        "no_reshard_between_backwards got a Net that is not wrapped by DDP or FSDP "
        "(composable APIs on it: checkpoint (_CheckpointState); the block takes replicate "
        "and fully_shard, also replicate_with_fsdp's replicate)."), message
    assert "Wrap it with DistributedDataParallel(...), replicate(...), fully_shard(...)" in message
    with pytest.raises(ValueError) as info:
        with no_reshard_between_backwards(Net()):
            pass
    plain = str(info.value)
    assert "composable" not in plain and "replicate(...)" in plain, plain


# Under torch.compile, as torchtitan and OLMo-core set it up #
def counting_hook(counts: Counter) -> Callable:
    """DDP's default all-reduce as a comm hook that counts its calls: one per bucket per
    reduction, whoever runs it (DDP's reducer or the block); it runs outside the compiled
    graphs, where a dispatch-mode counter would stop dynamo."""
    def hook(group, bucket):  # unannotated: DDP checks a hook's annotations
        counts["all_reduce"] += 1
        return default_hooks.allreduce_hook(group, bucket)
    return hook


def compiled_run(style: str, use_block: bool, steps: int) -> tuple[float, list[int], int]:
    """Per-block ``torch.compile`` (``aot_eager``, ``fullgraph=True``) then ``replicate``:
    ``"torchtitan"`` puts ``torch.compile(block)`` back in place of each block,
    ``"olmo_core"`` compiles each block in place (``block.compile()``). Returns the
    largest error, the all-reduces per step and dynamo's unique graphs."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(42)
    net = Net().double()
    ref = copy.deepcopy(net)
    for i, block in enumerate(net.blocks):
        if style == "torchtitan":
            net.blocks[i] = torch.compile(block, backend="aot_eager", fullgraph=True)
        else:
            block.compile(backend="aot_eager", fullgraph=True)
    model = replicate(net, bucket_cap_mb=100)  # torchtitan's apply_ddp
    counts: Counter = Counter()
    model.register_comm_hook(dist.group.WORLD, counting_hook(counts))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    error, per_step = 0.0, []
    for step in range(steps):
        gen = torch.Generator().manual_seed(42 + dist.get_rank() + 1 + 1000 * step)
        x = torch.randn(6, 12, generator=gen, dtype=torch.float64)
        counts.clear()
        with (no_reshard_between_backwards(model) if use_block else contextlib.nullcontext()):
            out = model(x)
            LOSSES[0](out).backward(retain_graph=True)
            LOSSES[1](out).backward()
        per_step.append(counts["all_reduce"])
        ref_out = ref(x)
        (LOSSES[0](ref_out) + LOSSES[1](ref_out)).backward()
        want = [p.grad for p in ref.parameters()]
        for g in want:
            dist.all_reduce(g)
            g /= dist.get_world_size()
        got = [p.grad for p in model.parameters()]
        error = max(error, rel_error(got, want))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    return error, per_step, counters["stats"]["unique_graphs"]


def compiled_case(style: str) -> None:
    saved = (torch._dynamo.config.optimize_ddp, functorch_config.donated_buffer)
    torch._dynamo.config.optimize_ddp = "ddp_optimizer"  # torchtitan's apply_ddp
    # Two passes over a compiled backward (torch's rule for retain_graph=True).
    functorch_config.donated_buffer = False
    try:
        plain, plain_counts, plain_graphs = compiled_run(style, False, steps=1)
        error, per_step, graphs = compiled_run(style, True, steps=3)
    finally:
        torch._dynamo.config.optimize_ddp, functorch_config.donated_buffer = saved
    assert plain_graphs >= 1, "nothing was compiled"
    assert graphs == plain_graphs, f"graphs: {graphs} with the block, {plain_graphs} without"
    assert error < 1e-10, error
    assert plain > 1e-2, plain
    # One bucket (100 MB): plain replicate reduces pass 1 only, the block each pass.
    assert plain_counts == [1] and per_step == [2] * 3, (plain_counts, per_step)


for _style in ("torchtitan", "olmo_core"):
    registry.add(f"replicate_compiled_blocks_{_style}", functools.partial(compiled_case, _style))


def replicate_built(module: nn.Module) -> nn.Module:
    """``replicate(module)`` with its DDP built, by a ``no_grad`` first forward."""
    model = replicate(module)
    with torch.no_grad():
        model(batch(99))
    return model


@registry.case()
def replicate_frozen_after_wrapping_gets_no_grad() -> None:
    """``check_frozen_after_wrapping`` under replicate, whose DDP is built at the first
    forward (here a ``no_grad`` one, before the freeze): the same buckets, the same fix."""
    check_frozen_after_wrapping(replicate_built)


@registry.case()
def replicate_storage_swapped_between_blocks() -> None:
    """``check_storage_swapped`` under replicate (the same ``ParamNodes``, held on its DDP)."""
    check_storage_swapped(replicate_built)


@registry.case()
def replicate_buckets_rebuilt_between_blocks() -> None:
    """``check_buckets_rebuilt`` under replicate (DDP's reducer rebuilds there too)."""
    check_buckets_rebuilt(replicate)
