"""DeepSpeed's own tiled kernels on every backend (CPU, gloo, 2 ranks, fp32; launched by
``tests/deepspeed/test_deepspeed.py``, in the DeepSpeed venv).

DeepSpeed ships them in ``deepspeed.runtime.sequence_parallel.ulysses_sp`` (ALST, Arctic
Training): ``TiledMLP`` and ``sequence_tiled_compute`` (``SequenceTiledCompute``) run a
backward per shard inside the backward; ``TiledFusedLogitsLoss`` runs one per shard
inside the *forward* (the logits never exist whole) and hands the input's gradient to
the backward. Each marks its ``compute_params`` with ``ds_grad_is_ready = False`` for
every shard but the last, which tells ZeRO's hooks to hold the reduction until the last
shard ([Note: DeepSpeed's held gradients] in ``fsdp_retain/_deepspeed/_zero12_reduce.py``).

``KernelNet``: an input ``Linear``, two residual layers (a norm, then an MLP, tiled by
``TiledMLP`` or ``sequence_tiled_compute``), and a head ``Linear`` whose cross-entropy is
either plain or ``TiledFusedLogitsLoss``; the head is a unit of its own on FSDP. A step
is two passes over one forward: the cross-entropy, then an auxiliary loss on the hidden
states, optionally after a probe pass of the auxiliary loss. The classes are DeepSpeed's
own; the reference is the same model untiled, in one process on the union batch, over 3
SGD-momentum steps (parameters after each, 1e-5).

- ``ds_kernels_<kernel>_<backend>_...``: each kernel on FSDP1 (flat and original
  parameters), FSDP2, DDP and ZeRO-0/1/2/3 with ``sync_grads`` "every" and "last", a probe
  pass, and ``keep_unsharded=False`` (a covering array, plus the fused loss under "last"
  on ZeRO-1/2/3): right, and the collectives of a step with 4 shards are those of a step
  with 1 (the shards of a kernel add up to one pass), but for ``extra_collectives``. A
  pass inside the forward (the fused loss) is refused, before it writes a gradient, on
  FSDP1 and on ZeRO-3 with "every" (``refused``).
- ``ds_kernels_without_the_block``: the same code without the block fails (DDP, ZeRO-3,
  FSDP1's fused loss) or is silently wrong (ZeRO-1/2).
"""

from __future__ import annotations

import contextlib
import copy
import functools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.runtime.sequence_parallel.ulysses_sp import (
    TiledFusedLogitsLoss,
    TiledMLP,
    sequence_tiled_compute,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdp_retain import no_reshard_between_backwards
from fsdp_retain._common import RetainError
from fsdp_retain._measure import count_collectives
from tests.support.case_parts import covering
from tests.deepspeed.cases_deepspeed_common import full_params as ds_full_params
from tests.deepspeed.cases_deepspeed_common import initialize, setup
from tests.support.fsdp1_utils import full_params as fsdp1_full_params
from tests.support.fsdp2_utils import full_params as fsdp2_full_params
from tests.support.harness import Registry
from tests.support.parity import rank, step_averaged

registry = Registry()

DIM, VOCAB, BATCH, SEQ = 8, 11, 2, 8
SHARDS = 4
STEPS = 3
TOL = dict(rtol=1e-5, atol=1e-5)
KERNELS = ("tiled_mlp", "seq_tiled", "fused_loss")


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


def _mlp_shard(mlp: MLP, x: torch.Tensor) -> torch.Tensor:
    return mlp.plain(x)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.mlp = MLP()
        self.kernel = "none"
        self.shards = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        params = [p for p in self.mlp.parameters()]
        if self.kernel == "tiled_mlp":
            out = TiledMLP.apply(_mlp_shard, self.mlp, h, self.shards, params)
        elif self.kernel == "seq_tiled":
            out = sequence_tiled_compute(
                functools.partial(_mlp_shard, self.mlp), SEQ, self.shards,
                kwargs_to_shard={"x": h}, kwargs_to_pass={}, grad_requiring_tensor_key="x",
                compute_params=params, output_unshard_dimension=1, output_reduction=None)
        else:
            out = self.mlp.plain(h)
        return x + out


def _head_loss(head: nn.Linear, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(x).view(-1, VOCAB), y.reshape(-1))


class KernelNet(nn.Module):
    """``forward(x, y)`` returns the hidden states and the head's cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.fused = False
        self.shards = 1

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        if self.fused:
            ce = TiledFusedLogitsLoss.apply(_head_loss, self.head, h, y, None, self.shards,
                                            [self.head.weight], "mean")
        else:
            ce = _head_loss(self.head, h, y)
        return h, ce


def set_kernel(model: nn.Module, kernel: str, shards: int) -> None:
    for module in model.modules():
        if isinstance(module, Layer):
            module.kernel = kernel if kernel != "fused_loss" else "none"
            module.shards = shards
        if isinstance(module, KernelNet):
            module.fused = kernel == "fused_loss"
            module.shards = shards


def aux_loss(h: torch.Tensor) -> torch.Tensor:
    return 0.5 * (h * torch.linspace(-1.0, 1.0, DIM)).pow(2).mean()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(42 + rank() + 1 + 1000 * step)
    return (torch.randn(BATCH, SEQ, DIM, generator=gen),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen))


def make_net() -> KernelNet:
    torch.manual_seed(42)
    return KernelNet()


# The wrappers: (wrapped model, optimizer step, backward, full parameters by name) #
def _fsdp2(model: KernelNet):
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model.head)
    fully_shard(model)
    return model, fsdp2_full_params


def _fsdp1(model: KernelNet, uop: bool):
    wrap = functools.partial(FSDP, use_orig_params=uop, device_id=torch.device("cpu"))
    for i, layer in enumerate(model.layers):
        model.layers[i] = wrap(layer)
    model.head = wrap(model.head)
    return wrap(model), fsdp1_full_params


def _ddp(model: KernelNet):
    def params(ddp: DDP) -> dict:
        return {n: p.detach().clone() for n, p in ddp.module.named_parameters()}

    return DDP(model), params


WRAPPERS = {
    "fsdp2": _fsdp2,
    "fsdp1_orig": functools.partial(_fsdp1, uop=True),
    "fsdp1_flat": functools.partial(_fsdp1, uop=False),
    "ddp": _ddp,
}
BACKENDS = (*WRAPPERS, "zero0", "zero1", "zero2", "zero3")


class Trainer:
    """One backend's model and how to step it: ``forward``, ``backward``, ``step``."""

    def __init__(self, backend: str, model: KernelNet) -> None:
        self.backend = backend
        self.engine = None
        if backend.startswith("zero"):
            setup()
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            config = {
                "train_micro_batch_size_per_gpu": BATCH,
                "gradient_accumulation_steps": 1,
                "zero_optimization": {"stage": int(backend[-1]),
                                      "stage3_param_persistence_threshold": 0},
                "gradient_clipping": 0.0,
                "zero_allow_untested_optimizer": True,
                "zero_force_ds_cpu_optimizer": False,
                "steps_per_print": 10**9,
            }
            self.engine, *_ = initialize(model, opt, config)
            self.model = self.engine
            # ZeRO-0 keeps no fp32 partition: its module holds the parameters.
            self._params = ds_full_params if config["zero_optimization"]["stage"] else (
                lambda engine: {n: p.detach().clone() for n, p in engine.module.named_parameters()})
        else:
            self.model, self._params = WRAPPERS[backend](model)
            self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)

    def backward(self, loss: torch.Tensor, retain_graph: bool) -> None:
        if self.engine is not None:
            self.engine.backward(loss, retain_graph=retain_graph)
        else:
            loss.backward(retain_graph=retain_graph)

    def step(self) -> None:
        if self.engine is not None:
            self.engine.step()
        else:
            self.opt.step()
            self.opt.zero_grad()

    def params(self) -> dict[str, torch.Tensor]:
        return self._params(self.model)


def _close(actual: dict, expected: dict, what: str) -> float:
    worst = 0.0
    for name, want in expected.items():
        got = actual[name]
        worst = max(worst, ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item())
        if torch.allclose(got, want, **TOL):
            continue
        if what:
            raise AssertionError(f"{what}: {name} off by {(got - want).abs().max().item():.3g}")
    return worst


def train(backend: str, kernel: str, sync: str = "every", keep: bool = True,
          probe: bool = False, shards: int = SHARDS, use_block: bool = True,
          steps: int = STEPS, check: bool = True):
    """Trains ``steps`` steps beside the untiled reference; returns the collectives of
    each step (kind -> count) and the largest relative parameter error."""
    model = make_net()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    set_kernel(model, kernel, shards)
    trainer = Trainer(backend, model)
    counts, worst = [], 0.0
    for step in range(steps):
        x, y = batch(step)
        h_ref, ce_ref = ref(x, y)
        ce_ref.backward(retain_graph=True)
        aux_loss(h_ref).backward()
        step_averaged(ref, ref_opt)
        block = (no_reshard_between_backwards(trainer.model, sync_grads=sync, keep_unsharded=keep)
                 if use_block else contextlib.nullcontext())
        with count_collectives(modules=False) as seen:
            with block as b:
                h, ce = trainer.model(x, y)
                aux = aux_loss(h)
                if probe:
                    b.backward(aux, param_grads=False, retain_graph=True)
                trainer.backward(ce, retain_graph=True)
                trainer.backward(aux, retain_graph=False)
        counts.append(seen.as_dict())
        trainer.step()
        what = f"{backend} {kernel} step {step}" if check else ""
        worst = max(worst, _close(trainer.params(), dict(ref.named_parameters()), what))
    return counts, worst


def refused(backend: str, kernel: str, sync: str, keep: bool, probe: bool) -> bool:
    """FSDP1, and ZeRO-3 with "every", refuse a pass inside the forward (the fused loss)."""
    return kernel == "fused_loss" and backend.startswith("fsdp1")


def extra_collectives(backend: str, kernel: str, sync: str, keep: bool) -> dict[str, int]:
    """What a step with ``SHARDS`` shards communicates beyond one with 1 shard: on FSDP2
    with "every" each shard's pass of the fused loss reduce-scatters the head, its own
    unit (right, not held); ZeRO-3 with keep_unsharded=False gathers an MLP's two
    ``Linear`` modules again for each shard's recompute, in each of the 2 layers, and
    the fused loss's head for each shard."""
    if backend == "fsdp2" and kernel == "fused_loss" and sync == "every":
        return {"reduce_scatter": SHARDS - 1}
    if backend == "zero3" and kernel != "fused_loss" and not keep:
        return {"all_gather": (SHARDS - 1) * 2 * 2}
    if backend == "zero3" and kernel == "fused_loss" and not keep:
        return {"all_gather": (SHARDS - 1) * 2}  # the head, each shard's forward and backward
    return {}


def kernel_case(backend: str, kernel: str, sync: str, keep: bool, probe: bool) -> None:
    """Right with 4 shards, and the collectives of each step those with 1 shard (plus
    ``extra_collectives``); or refused before any gradient is written."""
    if refused(backend, kernel, sync, keep, probe):
        model = make_net()
        set_kernel(model, kernel, SHARDS)
        trainer = Trainer(backend, model)
        try:
            with no_reshard_between_backwards(trainer.model, sync_grads=sync,
                                              keep_unsharded=keep):
                trainer.model(*batch(0))
        except RetainError as exc:
            assert "TiledFusedLogitsLoss" in str(exc) and "Use " in str(exc), exc
        else:
            raise AssertionError(f"{backend} {kernel} {sync} was not refused")
        assert all(p.grad is None for p in model.parameters()), "a gradient was written"
        return
    tiled, _ = train(backend, kernel, sync, keep, probe)
    one, _ = train(backend, kernel, sync, keep, probe, shards=1, steps=1)
    want = dict(one[0])
    for kind, extra in extra_collectives(backend, kernel, sync, keep).items():
        want[kind] += extra
    assert tiled[0] == want, (tiled[0], one[0])
    if rank() == 0:
        print(f"{backend} {kernel} {sync} keep={keep} probe={probe}: collectives per step "
              f"{one[0]}", flush=True)


def _add_cases() -> None:
    rows = covering(dict(backend=BACKENDS, kernel=KERNELS, sync=("every", "last"),
                         keep=(True, False), probe=(False, True)), strength=2)
    # Every backend meets every kernel under "every" (the flush per pass is where a held
    # gradient was read): the rows the covering array misses are added.
    for backend in BACKENDS:
        for kernel in KERNELS:
            if not any(r["backend"] == backend and r["kernel"] == kernel for r in rows):
                rows.append(dict(backend=backend, kernel=kernel, sync="every", keep=True,
                                 probe=False))
    for backend in ("zero1", "zero2", "zero3"):  # the held flag under "last", a probe pass
        rows.append(dict(backend=backend, kernel="fused_loss", sync="last", keep=True,
                         probe=True))
    rows.append(dict(backend="zero3", kernel="fused_loss", sync="last", keep=False,
                     probe=False))
    for row in rows:
        keep = row["keep"] or not row["backend"].startswith(("fsdp", "zero3"))
        name = (f"ds_kernels_{row['kernel']}_{row['backend']}_{row['sync']}"
                f"{'' if keep else '_regather'}{'_probe' if row['probe'] else ''}")
        if name not in registry.cases:
            registry.add(name, functools.partial(kernel_case, row["backend"], row["kernel"],
                                                 row["sync"], keep, row["probe"]))


_add_cases()


@registry.case()
def ds_kernels_without_the_block() -> None:
    """The same two passes, 4 shards, without the block: DDP raises (a shard marks a
    parameter ready again), ZeRO-1 and ZeRO-2 are silently wrong (the second pass is never
    reduced: DeepSpeed's flag holds only within a pass), ZeRO-3 fails (the second pass
    over released parameters); FSDP1 fails on the fused loss. FSDP2 is right by itself."""
    fails = [("ddp", k) for k in KERNELS] + [("zero3", k) for k in KERNELS]
    fails.append(("fsdp1_orig", "fused_loss"))
    for backend, kernel in fails:
        try:
            train(backend, kernel, use_block=False, steps=1, check=False)
        except RuntimeError:
            pass
        else:
            raise AssertionError(f"plain {backend} {kernel} ran")
        dist.barrier()
    for backend in ("zero1", "zero2"):
        for kernel in KERNELS:
            _, worst = train(backend, kernel, use_block=False, steps=1, check=False)
            assert worst > 0.1, (backend, kernel, worst)
    _, worst = train("fsdp2", "fused_loss", use_block=False, steps=2)
