"""The report's ``ddp`` backend: ``DistributedDataParallel`` in place of a sharded model.

Nothing is sharded: every rank holds the whole model and its gradients, and DDP
all-reduces the gradients bucket by bucket. Its rows count all-reduces, one per
bucket per reduction (``buckets``), and each mode's step is checked to leave the
same gradients on every rank (``check_replicas``): plain DDP's ``naive`` row fails
that check, since DDP reduces only the first backward over a forward.
"""

from __future__ import annotations

from typing import Any

# Relative difference of the ranks' gradient fingerprints above which they disagree:
# an all-reduce leaves every rank the same bytes, a pass reduced by none differs by
# the whole of its gradient.
REPLICA_TOLERANCE = 1e-6
DEFAULT_BUCKET_CAP_MB = 25  # DDP's


def ddp_setup(bucket_cap_mb: float | None = None) -> dict[str, Any]:
    """The options the report wraps DDP with (DDP's defaults, ``bucket_cap_mb`` aside),
    as ``report.json`` records them (``config["ddp"]``). Without find_unused_parameters
    the block launches one all-reduce per bucket per reduction (with it, one used-map
    all-reduce more)."""
    return {"bucket_cap_mb": DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb,
            "find_unused_parameters": False, "gradient_as_bucket_view": False,
            "static_graph": False}


def wrap(model, device, bucket_cap_mb: float | None = None):
    """``model`` under DDP with ``ddp_setup(bucket_cap_mb)``."""
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [device] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, **ddp_setup(bucket_cap_mb))


def buckets(ddp) -> int:
    """DDP's gradient buckets now. DDP starts with one bucket (without
    ``find_unused_parameters``) and rebuilds them by ``bucket_cap_mb`` in the forward
    after its first synced backward, so count after a step."""
    # The reducer's buckets (private, torch 2.x); its logging data keeps the first layout.
    # It allocates a zero copy of the grads: after a step, when they are freed.
    return len(ddp.reducer._get_zeros_like_grad_buckets())


class ReplicasDisagree(RuntimeError):
    """After a step's backward passes, the ranks hold different gradients."""


class ReplicaCheck:
    """The optimizer of one step that first compares every rank's gradients: a
    fingerprint per parameter (its sum and its sum of squares, float64), all-gathered.
    The step then runs as usual; ``ReplicasDisagree`` after it if they differ."""

    def __init__(self, optimizer, ddp) -> None:
        self.optimizer, self.ddp = optimizer, ddp

    def step(self) -> None:
        import torch
        import torch.distributed as dist

        params = list(self.ddp.parameters())
        device = params[0].device
        zero = torch.zeros((), dtype=torch.float64, device=device)
        mine = torch.stack([
            torch.stack((g.double().sum(), g.double().square().sum())) if g is not None
            else torch.stack((zero, zero))
            for g in (p.grad for p in params)
        ])
        group = self.ddp.process_group
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, mine, group=group)
        scale = torch.stack(every).abs().amax(dim=0).clamp_min(torch.finfo(torch.float64).tiny)
        worst = torch.stack([(other - mine).abs() / scale for other in every]).amax(dim=0)
        self.optimizer.step()
        differ = int((worst.amax(dim=1) > REPLICA_TOLERANCE).sum())
        if differ:
            raise ReplicasDisagree(
                f"the ranks' gradients disagree after the step: {differ} of {len(params)} "
                f"parameters differ (largest relative difference {float(worst.max()):.2g}); "
                "part of the gradient was never all-reduced")

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def state(self) -> dict[Any, Any]:
        return self.optimizer.state
