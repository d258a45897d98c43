"""Counting collectives with torch's ``CommDebugMode`` (used by tests and the report)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Iterator

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
    _mode: object = dataclasses.field(default=None, repr=False)
    _excluded: Counter = dataclasses.field(default_factory=Counter, repr=False)

    def as_dict(self) -> dict[str, int]:
        return {
            "all_gather": self.all_gather,
            "reduce_scatter": self.reduce_scatter,
            "all_reduce": self.all_reduce,
        }

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """Collectives issued in this nested block are not counted."""
        before = Counter(self._mode.get_comm_counts())
        try:
            yield
        finally:
            self._excluded.update(Counter(self._mode.get_comm_counts()) - before)


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveCounts]:
    """Counts all-gathers, reduce-scatters and all-reduces issued in the block.

    Uses ``torch.distributed.tensor.debug.CommDebugMode``, which sees both the
    c10d ops FSDP1/FSDP2 call and functional collectives. The counts are filled
    in when the block exits.

    Example::

        with count_collectives() as counts:
            loss = model(x).sum()
            loss.backward()
        print(counts.all_gather, counts.reduce_scatter)
    """
    from torch.distributed.tensor.debug import CommDebugMode

    mode = CommDebugMode()
    counts = CollectiveCounts(_mode=mode)
    with mode:
        yield counts
    totals = Counter(mode.get_comm_counts()) - counts._excluded
    for op, n in totals.items():
        name = str(op).split(".")[-1].lower()
        counts.by_op[name] = counts.by_op.get(name, 0) + n
        for kind, needles in _KINDS.items():
            if any(needle in name for needle in needles):
                setattr(counts, kind, getattr(counts, kind) + n)
                break
