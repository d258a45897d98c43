"""DDP's buckets, reduced by the block after a pass: DDP's layout, DDP's comm hook.

Part of the DDP backend with ``_block.py`` (private DDP access).

[Note: how the block reduces DDP gradients]
DDP's reducer all-reduces from autograd hooks it arms once per forward
(``prepare_for_backward``), so only the first backward over a forward is
reduced; later passes over a retained graph accumulate local gradients that no
rank ever averages (pytorch/pytorch#47260). Inside the block the forward arms
nothing (``require_backward_grad_sync`` off, as ``no_sync()`` does) and the
block reduces itself when the policy says a pass reduces: the reducer's own
buckets (``_get_zeros_like_grad_buckets``, in DDP's order and size) are filled
from ``.grad`` and handed to the reducer's comm hook (``_run_comm_hook``: the
one ``register_comm_hook`` installed, fp16/bf16 compression included, or a sum
all-reduce, after which the block divides by the world size as DDP does). One
collective per bucket per reduction; all of them are launched before the first
is waited on. The buckets' buffers live only during the reduction (one
gradient-size buffer, as DDP's own bucket buffers outside the block). The bucket
objects are fetched once and reused, until DDP rebuilds its buckets (after its first
synced iteration) or changes its process group: each fetch allocates and zeroes a
gradient-size buffer, which took as long as the all-reduce itself on a CPU run.

What is reduced is the accumulated ``.grad``, not only the pass's part: the part
reduced before is the same on every rank, so averaging it again leaves it as it
is (``mean(R + g_r) = R + mean(g_r)``), as DDP's own reduction after ``no_sync``
micro-batches does. A parameter with no gradient counts as zeros; where DDP
tracks unused parameters (``find_unused_parameters`` or ``static_graph``) one
all-reduce of a used-map first tells which ones no rank used, and those keep
``.grad`` as it was (``None``), as in DDP. A parameter frozen after DDP was built
(``requires_grad_(False)``) stays in DDP's buckets, so it is in the all-reduce, but
its ``.grad`` is never written: an optimizer would otherwise see a zero gradient and
step it (weight decay, momentum).
"""

from __future__ import annotations

import operator
import weakref
from typing import Any

import torch
import torch.distributed as dist

from .._common import RetainError, require_attr
from .._pass_start import ParamNodes, param_nodes

FLAVOUR = "DDP"
_CACHE_ATTR = "_fsdp_retain_buckets"
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


class Buckets:
    """The reduction of one DDP model's gradients, bucket by bucket. Built once per DDP
    and requires-grad set (``for_ddp``): a block reuses its parameters and their
    ``AccumulateGrad`` nodes."""

    def __init__(self, ddp: Any) -> None:
        self._reducer = require_attr(ddp, "reducer", FLAVOUR)
        for name in ("_get_zeros_like_grad_buckets", "_run_comm_hook"):
            require_attr(self._reducer, name, FLAVOUR)
        self._group = ddp.process_group
        self._ddp = weakref.ref(ddp)
        self._grad_buckets: list[tuple[Any, list[torch.Tensor], torch.dtype]] = []
        self._layout: Any = None  # what _grad_buckets were fetched under
        self._world = dist.get_world_size(self._group)
        self._divide = True
        self._track_unused = bool(ddp.find_unused_parameters or ddp.static_graph)
        # What DDP reduces: its parameters that require grad, less parameters_to_ignore.
        self._managed: list[torch.Tensor] = list(require_attr(ddp, "_module_parameters", FLAVOUR))
        self._requires = [p.requires_grad for p in self._managed]
        self.params: list[torch.Tensor] = [p for p in self._managed if p.requires_grad]
        self._trainable = {id(p) for p in self.params}
        self.nodes: ParamNodes = param_nodes(ddp, self.params)

    @classmethod
    def for_ddp(cls, ddp: Any) -> Buckets:
        """``ddp``'s buckets, built again when its parameters or their ``requires_grad``
        changed since the last block."""
        cached = ddp.__dict__.get(_CACHE_ATTR)
        managed = require_attr(ddp, "_module_parameters", FLAVOUR)
        if not (isinstance(cached, _Cached) and cached.buckets is not None
                and cached.buckets._matches(managed)):
            cached = _Cached(cls(ddp))
            ddp.__dict__[_CACHE_ATTR] = cached
        buckets = cached.buckets
        assert buckets is not None
        # Without a comm hook the reducer's hook sums; DDP divides before it.
        logging = require_attr(ddp, "_get_ddp_logging_data", FLAVOUR)()
        buckets._divide = not logging.get("comm_hook")
        return buckets

    def _matches(self, managed: list[torch.Tensor]) -> bool:
        return (len(managed) == len(self._managed)
                and all(map(operator.is_, managed, self._managed))
                and list(map(_REQUIRES_GRAD, managed)) == self._requires)

    def reduce(self) -> None:
        """All-reduces every bucket into ``.grad``."""
        with torch.no_grad():
            used = self._used_anywhere()
            launched = []
            grad_buckets = self._fetch()
            try:
                for bucket, params, dtype in grad_buckets:
                    flat = _flat_grads(params, dtype)
                    if self._divide:
                        flat.div_(self._world)
                    bucket.set_buffer(flat)
                    launched.append((params, self._reducer._run_comm_hook(bucket)))
                for params, future in launched:
                    result = future.wait()
                    self._write(params, result[0] if isinstance(result, list) else result, used)
            finally:
                for bucket, _, dtype in grad_buckets:
                    bucket.set_buffer(_empty(dtype))

    def _fetch(self) -> list[tuple[Any, list[torch.Tensor], torch.dtype]]:
        """The reducer's buckets, with their parameters and dtype: fetched again only
        when DDP rebuilt them or changed its process group since the last fetch (where
        this torch's DDP does not say, at every reduction)."""
        ddp = self._ddp()
        rebuilt = getattr(ddp, "_has_rebuilt_buckets", None)
        layout = None if ddp is None or rebuilt is None else (ddp.process_group, rebuilt)
        if layout is None or layout != self._layout or not self._grad_buckets:
            self._grad_buckets = [(b, b.parameters(), b.buffer().dtype)
                                  for b in self._reducer._get_zeros_like_grad_buckets()]
            self._layout = layout
        return self._grad_buckets

    def _used_anywhere(self) -> set[int]:
        """``id``s of the parameters the reduction writes: those that require grad (a
        bucket also holds any frozen since DDP was built) and, where DDP tracks unused
        parameters, that some rank has a gradient for."""
        if not self._track_unused:
            return self._trainable
        used = torch.tensor([p.grad is not None for p in self.params], dtype=torch.int32)
        dist.all_reduce(used, group=self._group)
        return {id(p) for p, n in zip(self.params, used.tolist()) if n}

    @staticmethod
    def _write(params: list[torch.Tensor], flat: torch.Tensor, written: set[int]) -> None:
        grads = [p.grad for p in params]
        if all(g is not None and g.dtype == flat.dtype for g in grads) \
                and all(id(p) in written for p in params):
            # Every parameter written, into a gradient of the bucket's dtype: one call.
            torch._foreach_copy_(grads, torch._utils._unflatten_dense_tensors(flat, grads))
            return
        values = flat.split([p.numel() for p in params])
        into, out = [], []
        for param, value in zip(params, values):
            if id(param) not in written:
                continue
            if param.grad is not None:
                into.append(param.grad)
                out.append(value.view_as(param))
            else:
                param.grad = value.view_as(param).to(param.dtype).clone()
        if into:
            torch._foreach_copy_(into, out)  # one call, not one copy_ per parameter


_EMPTY: dict[torch.dtype, torch.Tensor] = {}


def _empty(dtype: torch.dtype) -> torch.Tensor:
    """What a kept bucket holds between reductions: no memory."""
    return _EMPTY.setdefault(dtype, torch.empty(0, dtype=dtype))


class _Cached:
    """Holds a DDP's ``Buckets`` on it, so that they go with the model; a copy of the
    model builds its own."""

    __slots__ = ("buckets",)

    def __init__(self, buckets: Buckets | None = None) -> None:
        self.buckets = buckets

    def __deepcopy__(self, memo: dict) -> _Cached:
        return _Cached()

    def __reduce__(self) -> tuple:
        return (_Cached, ())


def _flat_grads(params: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The bucket's gradients in one flat tensor of its dtype (zeros for a missing one)."""
    grads = [p.grad for p in params]
    if all(g is not None and g.dtype == dtype and g.layout == torch.strided for g in grads):
        return torch._utils._flatten_dense_tensors(grads)  # one call, not one per gradient
    return torch.cat([_flat_grad(p, dtype) for p in params])


def _flat_grad(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    grad = param.grad
    if grad is None:
        return torch.zeros(param.numel(), dtype=dtype, device=param.device)
    if grad.is_sparse:
        raise RetainError(
            "no_reshard_between_backwards does not reduce sparse DDP gradients "
            "(an nn.Embedding(..., sparse=True)): use sparse=False inside the block."
        )
    flat = grad.reshape(-1)
    return flat if flat.dtype == dtype else flat.to(dtype)
