"""The block under per-block ``torch.compile(fullgraph=True)`` (CPU, gloo, world size 2).

Run inside ranks by ``tests/real_stacks/test_compile.py``. Three stacks, each named in its
case: FSDP1 with blocks compiled then wrapped (``use_orig_params=True``,
``ModuleWrapPolicy({OptimizedModule})``); FSDP2 with ``fully_shard(block)`` then
``block.compile(fullgraph=True)`` in place (the block's hooks run inside the
compiled region); FSDP2 the torchtitan way (compile, then ``fully_shard`` the
wrapper). Every option, with and without a probe pass. Each case asserts:

- parity with an unsharded eager reference over 3 SGD-momentum steps;
- dynamo's unique graph count equals the count of the same run without the block
  (one graph for the three identical blocks): the block adds no graph break or
  recompilation;
- the collectives per step equal those of the same configuration run eagerly with
  the block (counted by wrapping ``torch.distributed``'s collectives: FSDP's hooks
  run outside the compiled graphs, and CommDebugMode's module hooks would stop
  dynamo).

Two passes over one compiled forward need ``torch._functorch.config.donated_buffer
= False`` (torch's own rule for ``retain_graph=True`` over a compiled backward; torch
raises naming it otherwise); every case sets it.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections import Counter

import torch
import torch._dynamo
import torch._functorch.config as functorch_config
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from fsdp_retain import no_reshard_between_backwards
from tests.support import fsdp1_utils as f1
from tests.support import fsdp2_utils as f2
from tests.support.harness import Registry
from tests.support.parity import (
    LOSSES,
    assert_close_dicts,
    averaged_grads,
    batch,
    make_net,
    reference_copy,
    sgd,
    world,
)

registry = Registry()
OPTIONS = [(True, "every"), (True, "last"), (False, "every"), (False, "last")]
STACKS = ("fsdp1_compiled_then_wrapped", "fsdp2_inplace", "fsdp2_torchtitan")
_KINDS = {
    "all_gather": ("all_gather", "all_gather_into_tensor", "all_gather_single", "_all_gather_base"),
    "reduce_scatter": ("reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base"),
    "all_reduce": ("all_reduce",),
}


@contextlib.contextmanager
def count_dist_collectives():
    """Counts outermost calls of ``torch.distributed``'s collectives, by kind."""
    counts: Counter = Counter()
    depth = [0]
    originals = {}

    def wrap(kind, fn):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            if depth[0] == 0:
                counts[kind] += 1
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        return counted

    for kind, names in _KINDS.items():
        for name in names:
            fn = getattr(dist, name, None)
            if fn is not None:
                originals[name] = fn
                setattr(dist, name, wrap(kind, fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def build(stack: str, compile_blocks: bool):
    model = make_net()
    ref = reference_copy(model)
    mesh = init_device_mesh("cpu", (world(),))
    if stack == "fsdp1_compiled_then_wrapped":
        wrap_cls = type(model.blocks[0])
        if compile_blocks:
            for i, block in enumerate(model.blocks):
                model.blocks[i] = torch.compile(block, fullgraph=True)
            wrap_cls = torch._dynamo.eval_frame.OptimizedModule
        wrapped = FSDP(
            model, auto_wrap_policy=ModuleWrapPolicy({wrap_cls}), use_orig_params=True,
            device_id=torch.device("cpu"),
        )
        return wrapped, ref, f1.ADAPTER
    for i, block in enumerate(model.blocks):
        if stack == "fsdp2_inplace":
            fully_shard(block, mesh=mesh)
            if compile_blocks:
                block.compile(fullgraph=True)
        else:
            if compile_blocks:
                model.blocks[i] = block = torch.compile(block, fullgraph=True)
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, ref, f2.ADAPTER


def _clean(named: dict) -> dict:
    return {k.replace("_orig_mod.", ""): v for k, v in named.items()}


def train(stack, compile_blocks, keep, sync, probe, use_block=True, steps=3):
    """Trains against the reference; returns (collectives per step, unique graphs)."""
    torch._dynamo.reset()
    counters.clear()
    model, ref, adapter = build(stack, compile_blocks)
    opt, ref_opt = sgd(model), sgd(ref)
    per_step = []
    for step in range(steps):
        x = batch(step)
        ref_out = ref(x)
        LOSSES[0](ref_out).backward(retain_graph=True)
        LOSSES[1](ref_out).backward()
        ref_grads = averaged_grads(ref)
        for name, param in ref.named_parameters():
            param.grad = ref_grads[name]
        ref_opt.step()
        ref_opt.zero_grad()
        with count_dist_collectives() as counts:
            if use_block:
                with no_reshard_between_backwards(
                    model, keep_unsharded=keep, sync_grads=sync
                ) as block:
                    out = model(x)
                    if probe:
                        block.backward(LOSSES[2](out), param_grads=False, retain_graph=True)
                    LOSSES[0](out).backward(retain_graph=True)
                    LOSSES[1](out).backward()
            else:
                LOSSES[0](model(x)).backward()
                LOSSES[1](model(x)).backward()
        per_step.append(dict(counts))
        where = f"{stack} compiled={compile_blocks} step {step}"
        assert_close_dicts(_clean(adapter.full_grads(model)), ref_grads, f"{where}: grads")
        opt.step()
        opt.zero_grad()
        params = {n: p.detach() for n, p in ref.named_parameters()}
        assert_close_dicts(_clean(adapter.full_params(model)), params, f"{where}: params")
    return per_step, counters["stats"]["unique_graphs"]


def compile_case(stack: str, keep: bool, sync: str, probe: bool) -> None:
    saved = functorch_config.donated_buffer
    functorch_config.donated_buffer = False
    try:
        _, plain_graphs = train(stack, True, keep, sync, probe, use_block=False, steps=1)
        counts, graphs = train(stack, True, keep, sync, probe)
        eager_counts, _ = train(stack, False, keep, sync, probe)
    finally:
        functorch_config.donated_buffer = saved
    assert plain_graphs >= 1, "nothing was compiled"
    assert graphs == plain_graphs, f"graphs: {graphs} with the block, {plain_graphs} without"
    assert counts == eager_counts, f"collectives compiled {counts} vs eager {eager_counts}"


for _stack, (_keep, _sync), _probe in itertools.product(STACKS, OPTIONS, (False, True)):
    _name = (
        f"compile_fullgraph_{_stack}_{'keep' if _keep else 'regather'}_{_sync}"
        f"{'_probe' if _probe else ''}"
    )
    registry.add(_name, functools.partial(compile_case, _stack, _keep, _sync, _probe))


@registry.case()
def compiled_autograd_refused() -> None:
    """A backward under compiled autograd inside the block raises a RuntimeError naming
    the fix before the pass starts (FSDP2 without the block gives wrong gradients
    there, FSDP1 crashes); the next eager step in a block matches the reference."""
    from torch._dynamo import compiled_autograd

    for stack in ("fsdp1_compiled_then_wrapped", "fsdp2_inplace"):
        model, ref, adapter = build(stack, compile_blocks=False)
        x = batch(0)
        try:
            with compiled_autograd._enable(torch.compile(backend="eager")):
                with no_reshard_between_backwards(model):
                    LOSSES[0](model(x)).backward()
        except RuntimeError as exc:
            assert "does not support compiled autograd" in str(exc), exc
        else:
            raise AssertionError(f"{stack}: compiled autograd was not refused")
        model.zero_grad()
        with no_reshard_between_backwards(model):
            out = model(x)
            LOSSES[0](out).backward(retain_graph=True)
            LOSSES[1](out).backward()
        ref_out = ref(x)
        LOSSES[0](ref_out).backward(retain_graph=True)
        LOSSES[1](ref_out).backward()
        assert_close_dicts(_clean(adapter.full_grads(model)), averaged_grads(ref), stack)
