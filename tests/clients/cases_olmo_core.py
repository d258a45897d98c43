"""OLMo-core (ai2-olmo-core 3.0) as a real client, CPU/gloo, world size 2.

OLMo-core's own model (``TransformerConfig.olmo2_1M`` with 2 blocks, float32) wrapped by
its own ``Transformer.apply_fsdp`` (FSDP2: a unit per block, the embeddings, not gathered
in backward, the LM head, kept gathered after forward, and the root, which holds no
parameter) or ``Transformer.apply_ddp`` (torch's composable ``replicate()``, DDP inside,
``bucket_cap_mb=100``: one bucket here). A step is one forward and two backward passes,
the two terms of OLMo-core's own ``cross_entropy_loss``: the cross-entropy, then the
z-loss (``Transformer.forward(labels=...)`` returns both detached, summed into one loss).

Each case trains 3 SGD steps (momentum 0.9) and compares the losses, the gradients and
the parameters after every step with one process on the union batch (the model deep-copied
before wrapping, one backward of CE + z-loss, gradients averaged over ranks), and counts
every collective of each step against the formulas below. Without the block apply_fsdp
agrees too but gathers again in each backward; apply_ddp all-reduces the first pass only,
so each rank keeps its own z-loss gradients: silently wrong.

Needs ai2-olmo-core (``scripts/venv_ci.sh olmo``); tests/clients/test_olmo_core.py skips without it.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import torch
import torch.distributed as dist
from olmo_core.nn.functional import cross_entropy_loss
from olmo_core.nn.transformer import Transformer, TransformerConfig
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import init_device_mesh

from fsdp_retain import no_reshard_between_backwards
from fsdp_retain._measure import CollectiveCounts, count_collectives
from tests.support.fsdp2_utils import full_grads, full_params
from tests.support.harness import Registry
from tests.support.parity import sgd, step_averaged

registry = Registry()
VOCAB, SEQ, BATCH = 64, 16, 4
LAYERS = 2
STEPS = 3
# The z-loss weight: 100 times cross_entropy_loss's default (1e-4), so that z-loss
# gradients lost (plain apply_ddp) stand out from float32 rounding by orders of magnitude.
Z_LOSS = 1e-2
TOL = 1e-5  # float32; OLMo-core's loss runs in float32 whatever the model's dtype
# apply_fsdp's FSDP units with parameters: the embeddings, each block, the LM head.
UNITS = LAYERS + 2


def tiny_olmo() -> Transformer:
    config = TransformerConfig.olmo2_1M(vocab_size=VOCAB, n_layers=LAYERS, init_seed=42)
    model = config.build(init_device="cpu")
    model.init_weights(max_seq_len=SEQ, device=torch.device("cpu"))
    return model


def tokens(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(42 + dist.get_rank() + 1 + 1000 * step)
    ids = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


def losses(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ce, z = cross_entropy_loss(logits.reshape(-1, VOCAB), labels.reshape(-1),
                               compute_z_loss=True, z_loss_multiplier=Z_LOSS)
    assert z is not None
    return ce, z


def wrap(model: Transformer, how: str) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if how == "fsdp":
        model.apply_fsdp(dp_mesh=mesh)
    else:
        model.apply_ddp(dp_mesh=mesh)


def ddp_buckets(model: Transformer) -> int:
    """The buckets of the DDP that apply_ddp's replicate() built at the first forward."""
    ddp = replicate.state(model)._ddp
    return len(ddp._get_ddp_logging_data()["bucket_sizes"].split(", "))


def rel_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())
    num = sum(float((got[n] - want[n]).double().pow(2).sum()) for n in want)
    den = sum(float(want[n].double().pow(2).sum()) for n in want)
    return (num / den) ** 0.5


def step_counts(counts: CollectiveCounts) -> dict[str, int]:
    out = {**counts.as_dict(), "broadcast": counts.by_op.get("broadcast_", 0)}
    out["backward_all_gather"] = sum(n for (phase, kind, _), n in counts.by_group.items()
                                     if kind == "all_gather" and phase != "forward")
    return out


def train(how: str, sync: str | None) -> tuple[Transformer, list[dict[str, int]], list[float]]:
    """3 steps of apply_``how``'s model, in the block (``sync_grads=sync``) or plain
    (``sync=None``), beside the one-process reference. Returns the model, each step's
    collectives and the largest relative error of the losses, the gradients (averaged
    over ranks: what a rank holds is its contribution to that average) and the parameters
    after the step, per step."""
    model = tiny_olmo()
    ref = copy.deepcopy(model)  # before wrapping: replicate() refuses deepcopy after
    wrap(model, how)
    opt, ref_opt = sgd(model), sgd(ref)
    all_counts, errors = [], []
    for step in range(STEPS):
        ids, labels = tokens(step)
        ref_ce, ref_z = losses(ref(ids), labels)
        (ref_ce + ref_z).backward()
        ref_grads = step_averaged(ref, ref_opt)
        block = (contextlib.nullcontext() if sync is None
                 else no_reshard_between_backwards(model, sync_grads=sync))
        with count_collectives() as counts:
            with block as retain:
                counts.mark("forward")
                ce, z = losses(model(ids), labels)
                counts.mark("pass1")
                ce.backward(retain_graph=True)
                counts.mark("pass2")
                z.backward()
        assert sync is None or retain.backward_passes == 2, retain.backward_passes
        all_counts.append(step_counts(counts))
        loss_error = max(float(abs(a - b) / abs(b)) for a, b in ((ce, ref_ce), (z, ref_z)))
        grad_error = rel_error(full_grads(model), ref_grads)
        opt.step()
        opt.zero_grad()
        ref_params = {n: p.detach() for n, p in ref.named_parameters()}
        errors.append(max(loss_error, grad_error, rel_error(full_params(model), ref_params)))
    return model, all_counts, errors


def ddp_broadcasts(sync: str | None, step: int) -> int:
    """replicate() builds its DDP at the first forward: it checks the parameters' shapes
    across ranks (an all-gather, counted in ``expected``, and a broadcast) and broadcasts
    the parameters from rank 0. Plain DDP rebuilds its buckets before the second forward, in
    the order the first backward made gradients ready, and broadcasts rank 0's layout (the
    bucket indices, then their sizes); in the block DDP's reducer records no order (its
    forwards run without gradient sync), so it keeps its first layout."""
    return 2 * (step == 0) + 2 * (sync is None and step == 1)


def expected(how: str, sync: str | None, buckets: int, step: int) -> dict[str, int]:
    if how == "fsdp":
        if sync is None:
            # Forward: each unit. Pass 1: each block again (resharded after forward);
            # not the LM head (kept) nor the embeddings (no unshard in backward).
            # Pass 2: each block and the LM head (resharded by pass 1's backward).
            backward = LAYERS + (LAYERS + 1)
            reduces = 2 * UNITS
        else:  # the block: nothing gathered again; a reduce-scatter per unit and reduction
            backward = 0
            reduces = UNITS * (2 if sync == "every" else 1)
        return {"all_gather": UNITS + backward, "reduce_scatter": reduces, "all_reduce": 0,
                "broadcast": 0, "backward_all_gather": backward}
    # DDP: one all-reduce per bucket per reduction: plain DDP reduces the first pass only.
    reductions = 1 if sync in (None, "last") else 2
    # The all-gather of the first forward: DDP's check of the parameters' shapes.
    return {"all_gather": int(step == 0), "reduce_scatter": 0, "all_reduce": buckets * reductions,
            "broadcast": ddp_broadcasts(sync, step), "backward_all_gather": 0}


def check(how: str, sync: str | None) -> None:
    model, counts, errors = train(how, sync)
    buckets = ddp_buckets(model) if how == "ddp" else 0
    print(f"[rank {dist.get_rank()}] {how} {sync}: errors {errors}, counts {counts}")
    assert counts == [expected(how, sync, buckets, step) for step in range(STEPS)], counts
    if how == "ddp":
        assert buckets == 1, buckets  # bucket_cap_mb=100 (DDP's first bucket: 1 MiB)
    if how == "ddp" and sync is None:
        # The z-loss's gradients are never all-reduced: each rank steps on its own, and
        # the replicas drift apart.
        assert min(errors) > 1e-3, errors
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        ranks = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(ranks, flat)
        assert not torch.equal(ranks[0], ranks[1]), "plain apply_ddp reduced the z-loss"
    else:
        assert max(errors) < TOL, errors


for _how in ("fsdp", "ddp"):
    for _sync in ("every", "last"):
        registry.add(f"olmo_{_how}_block_{_sync}", functools.partial(check, _how, _sync))
registry.add("olmo_fsdp_plain_agrees_regathering", functools.partial(check, "fsdp", None))
registry.add("olmo_ddp_plain_is_wrong", functools.partial(check, "ddp", None))
