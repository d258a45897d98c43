"""Counting collectives with torch's ``CommDebugMode`` (used by tests and the report)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Iterator
from typing import Any

_KINDS = {
    "all_gather": ("allgather", "all_gather"),
    "reduce_scatter": ("reduce_scatter",),
    "all_reduce": ("allreduce", "all_reduce"),
}


@dataclasses.dataclass
class CollectiveCounts:
    """Collectives issued inside ``count_collectives()``, by kind."""

    all_gather: int = 0
    reduce_scatter: int = 0
    all_reduce: int = 0
    by_op: dict[str, int] = dataclasses.field(default_factory=dict)
    # Bytes of the unsharded side of each collective (the all-gather output,
    # the reduce-scatter input, the all-reduced tensor), as seen by one rank.
    all_gather_bytes: int = 0
    reduce_scatter_bytes: int = 0
    all_reduce_bytes: int = 0
    # All-gather bytes (as above) by part of the block (``start_part``; "" before the
    # first) and the size of the process group that issued them:
    # {part: {ranks: bytes}}.
    all_gather_group_bytes: dict[str, dict[int, int]] = dataclasses.field(
        default_factory=dict)
    _mode: Any = dataclasses.field(default=None, repr=False)
    _excluded: Counter = dataclasses.field(default_factory=Counter, repr=False)
    _excluded_bytes: Counter = dataclasses.field(default_factory=Counter, repr=False)
    _excluded_groups: Counter = dataclasses.field(default_factory=Counter, repr=False)

    def as_dict(self) -> dict[str, int]:
        return {
            "all_gather": self.all_gather,
            "reduce_scatter": self.reduce_scatter,
            "all_reduce": self.all_reduce,
        }

    def bytes_dict(self) -> dict[str, int]:
        return {
            "all_gather": self.all_gather_bytes,
            "reduce_scatter": self.reduce_scatter_bytes,
            "all_reduce": self.all_reduce_bytes,
        }

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """Collectives issued in this nested block are not counted."""
        before = Counter(self._mode.get_comm_counts())
        before_bytes = Counter(self._mode.comm_bytes)
        before_groups = Counter(self._mode.group_bytes)
        try:
            yield
        finally:
            self._excluded.update(Counter(self._mode.get_comm_counts()) - before)
            self._excluded_bytes.update(Counter(self._mode.comm_bytes) - before_bytes)
            self._excluded_groups.update(Counter(self._mode.group_bytes) - before_groups)

    def start_part(self, name: str) -> None:
        """All-gathers issued from here on count under ``name`` in
        ``all_gather_group_bytes`` (e.g. the passes after the first backward)."""
        self._mode.part = name


def _tensor_bytes(value) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _unsharded_bytes(args, kwargs, out) -> int:
    """The largest tensor (or tensor list) among a collective's arguments and result."""
    values = list(args) + list((kwargs or {}).values()) + [out]
    return max((_tensor_bytes(v) for v in values), default=0)


def _group_size(args, kwargs) -> int | None:
    """The size of the process group among a c10d op's arguments (``None``: none found,
    e.g. a functional collective, which names its group by a string)."""
    import torch.distributed as dist

    for value in list(args) + list((kwargs or {}).values()):
        if isinstance(value, dist.ProcessGroup):
            return value.size()
        if type(value).__name__ == "ScriptObject":  # how c10d ops receive their group
            try:
                return dist.ProcessGroup.unbox(value).size()
            except RuntimeError:  # another script object (a ReduceOp)
                continue
    return None


def _comm_mode_class():
    from torch.distributed.tensor.debug import CommDebugMode

    class _ByteCountingCommMode(CommDebugMode):
        """``CommDebugMode`` that also adds up the bytes of each collective it counts."""

        def __init__(self) -> None:
            super().__init__()
            self.comm_bytes: Counter = Counter()
            self.group_bytes: Counter = Counter()  # (part, op, group size) -> bytes
            self.part = ""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before = dict(self.comm_counts)
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if out is not NotImplemented:
                for op, n in self.comm_counts.items():
                    if n != before.get(op, 0):
                        size = _unsharded_bytes(args, kwargs, out)
                        self.comm_bytes[op] += size
                        self.group_bytes[self.part, op, _group_size(args, kwargs)] += size
            return out

        def __enter__(self):
            self.comm_bytes.clear()
            self.group_bytes.clear()
            return super().__enter__()

    return _ByteCountingCommMode


def _tally_mode_class():
    from torch.utils._python_dispatch import TorchDispatchMode

    class _CollectiveTally(TorchDispatchMode):
        """The collectives alone, as ``_ByteCountingCommMode`` counts them, without
        ``CommDebugMode``'s module tracking: see ``count_collectives(modules=False)``."""

        def __init__(self) -> None:
            super().__init__()
            self.comm_counts: Counter = Counter()
            self.comm_bytes: Counter = Counter()
            self.group_bytes: Counter = Counter()  # (part, op, group size) -> bytes
            self.part = ""

        def get_comm_counts(self) -> Counter:
            return self.comm_counts

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(getattr(t, "__name__", "") == "DTensor" for t in types):
                return NotImplemented  # let DTensor desugar into collectives first
            out = func(*args, **(kwargs or {}))
            if getattr(func, "namespace", None) in ("c10d", "_c10d_functional"):
                op = func._overloadpacket
                if _kind(str(op).split(".")[-1].lower()) is not None:
                    size = _unsharded_bytes(args, kwargs, out)
                    self.comm_counts[op] += 1
                    self.comm_bytes[op] += size
                    self.group_bytes[self.part, op, _group_size(args, kwargs)] += size
            return out

    return _CollectiveTally


@contextlib.contextmanager
def count_collectives(*, modules: bool = True) -> Iterator[CollectiveCounts]:
    """Counts all-gathers, reduce-scatters and all-reduces issued in the block.

    Uses ``torch.distributed.tensor.debug.CommDebugMode``, which sees both the
    c10d ops FSDP1/FSDP2 call and functional collectives. The counts (and the
    ``*_bytes`` fields) are filled in when the block exits.

    ``CommDebugMode`` (torch 2.13) fails on a second forward of the same
    modules inside one block: count each forward and its backward passes in
    their own block and add the results up.

    Example::

        with count_collectives() as counts:
            loss = model(x).sum()
            loss.backward()
        print(counts.all_gather, counts.reduce_scatter)

    ``modules=False`` counts the same collectives (c10d and functional ones) with a plain
    dispatch mode instead: ``CommDebugMode``'s module tracking keeps one activation alive
    longer (one hidden state more at the peak of Llama-3-70B's shape at 4096 tokens under
    ``--simulate-world-size``), which a memory measurement in the same step must not see.
    """
    mode = _comm_mode_class()() if modules else _tally_mode_class()()
    counts = CollectiveCounts(_mode=mode)
    with mode:
        yield counts
    totals = Counter(mode.get_comm_counts()) - counts._excluded
    total_bytes = Counter(mode.comm_bytes) - counts._excluded_bytes
    for (part, op, ranks), n in (Counter(mode.group_bytes) - counts._excluded_groups).items():
        if ranks is not None and _kind(str(op).split(".")[-1].lower()) == "all_gather":
            parts = counts.all_gather_group_bytes.setdefault(part, {})
            parts[ranks] = parts.get(ranks, 0) + n
    for op, n in totals.items():
        name = str(op).split(".")[-1].lower()
        counts.by_op[name] = counts.by_op.get(name, 0) + n
        kind = _kind(name)
        if kind is not None:
            setattr(counts, kind, getattr(counts, kind) + n)
            bytes_field = f"{kind}_bytes"
            setattr(counts, bytes_field, getattr(counts, bytes_field) + total_bytes[op])


def _kind(name: str) -> str | None:
    return next((kind for kind, needles in _KINDS.items()
                 if any(needle in name for needle in needles)), None)
