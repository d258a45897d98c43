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
    # (phase, kind, ranks) -> collectives, and their bytes as above: ``phase`` the label
    # ``mark`` set last (None before any), ``kind`` as the fields above (or the op name),
    # ``ranks`` the size of the collective's process group (None where the op names
    # none: a functional collective names its group by a string).
    by_group: Counter = dataclasses.field(default_factory=Counter)
    by_group_bytes: Counter = dataclasses.field(default_factory=Counter)
    _mode: Any = dataclasses.field(default=None, repr=False)
    _excluded: Counter = dataclasses.field(default_factory=Counter, repr=False)
    _excluded_bytes: Counter = dataclasses.field(default_factory=Counter, repr=False)

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

    def mark(self, phase: str | None) -> None:
        """Counts the collectives from now on under ``phase`` in ``by_group``."""
        self._mode.phase = phase

    def groups(self, kind: str, phase: Any = ..., *, nbytes: bool = False) -> Counter:
        """``kind`` collectives (their bytes with ``nbytes``) by the size of their
        process group, in ``phase`` (every phase when not given)."""
        out: Counter = Counter()
        for (p, k, ranks), n in (self.by_group_bytes if nbytes else self.by_group).items():
            if k == kind and n and (phase is ... or p == phase):
                out[ranks] += n
        return out

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """Collectives issued in this nested block are not counted."""
        mode = self._mode
        before = Counter(mode.get_comm_counts())
        before_bytes = Counter(mode.comm_bytes)
        paused, mode.paused = mode.paused, True
        try:
            yield
        finally:
            mode.paused = paused
            self._excluded.update(Counter(mode.get_comm_counts()) - before)
            self._excluded_bytes.update(Counter(mode.comm_bytes) - before_bytes)


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


def _kind(op_name: str) -> str | None:
    return next((kind for kind, needles in _KINDS.items()
                 if any(needle in op_name for needle in needles)), None)


def _op_name(op) -> str:
    return str(op).split(".")[-1].lower()


def _group_ranks(args, kwargs) -> int | None:
    """The size of the process group a collective runs on: c10d ops take the group
    (a ``ScriptObject``), functional collectives its name."""
    import torch
    import torch.distributed as dist

    c10d: Any = dist.distributed_c10d
    for value in list(args) + list((kwargs or {}).values()):
        try:
            if isinstance(value, dist.ProcessGroup):
                return value.size()
            if isinstance(value, torch.ScriptObject):
                if value._type().qualified_name().endswith("c10d.ProcessGroup"):
                    return dist.ProcessGroup.unbox(value).size()
            elif isinstance(value, str):  # a group name, or a reduce op ("sum")
                return c10d._resolve_process_group(value).size()
        except (RuntimeError, ValueError, KeyError, AttributeError):
            continue
    return None


class _Groups:
    """What both counting modes add to their counts: the bytes of each collective, and
    each by phase and process-group size (``CollectiveCounts.by_group``)."""

    def _init_groups(self) -> None:
        self.comm_bytes: Counter = Counter()
        self.groups: Counter = Counter()
        self.group_bytes: Counter = Counter()
        self.phase: str | None = None
        self.paused = False  # inside CollectiveCounts.excluded()

    def _record(self, op, args, kwargs, out) -> None:
        size = _unsharded_bytes(args, kwargs, out)
        self.comm_bytes[op] += size
        if not self.paused:
            name = _op_name(op)
            key = self.phase, _kind(name) or name, _group_ranks(args, kwargs)
            self.groups[key] += 1
            self.group_bytes[key] += size


# [Note: counting collectives without inspecting every op]
# CommDebugMode sees every op under it, and for each builds a record for its per-module
# tables and looks for a fake mode among the arguments: a step of a small model runs
# about 3x slower under it. What it counts are ops of the c10d namespaces (its
# ``comm_registry`` and the c10d ops), and it returns DTensor ops unhandled so that
# DTensor desugars them into collectives it then sees. Any other op on non-DTensor
# arguments it runs as is: so does ``_ByteCountingCommMode``, without the records. The
# counts are the same; its per-module operation tables (not read here) lose those ops.


# [Note: a module that runs its forward more than once under CommDebugMode]
# CommDebugMode's module tracker (torch 2.9-2.15: ``_CommModeModuleTracker``) registers a
# forward hook on a module each time its forward starts and never removes it until the
# mode exits; the hook pops the module off the tracker's parent list. A module whose
# forward runs k times inside one mode pops k times at its k-th end, until the list runs
# empty: ``IndexError: list index out of range``. Such modules are ordinary:
# an lm_head applied per chunk, a second forward of the model in one block, and since
# transformers 5.25 every HF model whose decoder layers share the one ``apply_rotary_pos_emb``
# module (a module-level ``nn.Module``, run once per layer). ``_repeat_safe_tracker``
# removes a module's earlier hook before its forward starts again: one hook, one pop, per
# call. The tracker's records (per-module tables, not read here) are otherwise torch's.
# Where the tracker lacks that shape (another torch), it is left as torch made it:
# tests/api/test_count_collectives.py shows whether that one survives the repeats.


def _repeat_safe_tracker(tracker_class: Any) -> Any:
    """``tracker_class`` (torch's ``_CommModeModuleTracker``) with one forward hook per
    module at a time: see [Note: a module that runs its forward more than once under
    CommDebugMode]."""

    class _RepeatSafeTracker(tracker_class):
        def __init__(self) -> None:
            super().__init__()
            self._hook_of: dict[int, Any] = {}  # id(module) -> its forward hook's handle

        def _fw_pre_hook(self, mod, input):
            stale = self._hook_of.pop(id(mod), None)
            if stale is not None:
                stale.remove()
            # torch keeps the handles by module name; the name's entry changes when its
            # pre-hook registers one (not in a checkpoint's recomputation).
            name = self._get_mod_name(mod)
            before = self.register_forward_hook_handles.get(name)
            super()._fw_pre_hook(mod, input)
            after = self.register_forward_hook_handles.get(name)
            if after is not None and after is not before:
                self._hook_of[id(mod)] = after

        def __exit__(self, *args):
            # torch's removes the last handle of each name; two modules of one name (two
            # module-level modules of one class) leave it one it no longer lists.
            for handle in self._hook_of.values():
                handle.remove()
            self._hook_of.clear()
            return super().__exit__(*args)

    return _RepeatSafeTracker


def _comm_mode_class():
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    try:
        from torch.distributed.tensor.debug._comm_mode import _CommModeModuleTracker
    except ImportError:  # another torch: its tracker as it is (the Note above)
        _CommModeModuleTracker = None
    tracker_class = (None if _CommModeModuleTracker is None
                     else _repeat_safe_tracker(_CommModeModuleTracker))

    class _ByteCountingCommMode(_Groups, CommDebugMode):
        """``CommDebugMode`` that also adds up the bytes of each collective it counts, its
        module tracker mended for modules that run more than once (the Note above)."""

        def __init__(self) -> None:
            super().__init__()
            # Mended where torch's own tracker is the one the Note describes.
            tracker = getattr(self, "advanced_module_tracker", None)
            if type(tracker) is _CommModeModuleTracker and hasattr(
                tracker, "register_forward_hook_handles"
            ):
                self.advanced_module_tracker = tracker_class()
            self._init_groups()
            self.comm_namespaces = {"c10d"} | {
                packet._qualified_op_name.split("::")[0] for packet in self.comm_registry
            }

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # See [Note: counting collectives without inspecting every op].
            if getattr(func, "namespace", None) not in self.comm_namespaces and not any(
                issubclass(t, DTensor) for t in types
            ):
                return func(*args, **(kwargs or {}))
            before = dict(self.comm_counts)
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if out is not NotImplemented:
                for op, n in self.comm_counts.items():
                    if n != before.get(op, 0):
                        self._record(op, args, kwargs, out)
            return out

        def __enter__(self):
            self._init_groups()
            return super().__enter__()

    return _ByteCountingCommMode


def _tally_mode_class():
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class _CollectiveTally(_Groups, TorchDispatchMode):
        """The collectives alone, as ``_ByteCountingCommMode`` counts them, without
        ``CommDebugMode``'s module tracking: see ``count_collectives(modules=False)``."""

        def __init__(self) -> None:
            super().__init__()
            self._init_groups()
            self.comm_counts: Counter = Counter()

        def get_comm_counts(self) -> Counter:
            return self.comm_counts

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented  # let DTensor desugar into collectives first
            out = func(*args, **(kwargs or {}))
            if getattr(func, "namespace", None) in ("c10d", "_c10d_functional"):
                op = func._overloadpacket
                if _kind(_op_name(op)) is not None:
                    self.comm_counts[op] += 1
                    self._record(op, args, kwargs, out)
            return out

    return _CollectiveTally


@contextlib.contextmanager
def count_collectives(*, modules: bool = True) -> Iterator[CollectiveCounts]:
    """Counts all-gathers, reduce-scatters and all-reduces issued in the block.

    Uses ``torch.distributed.tensor.debug.CommDebugMode``, which sees both the
    c10d ops FSDP1/FSDP2 call and functional collectives. The counts (and the
    ``*_bytes`` fields) are filled in when the block exits.

    A module whose forward runs more than once in the block (a second forward,
    an lm_head per chunk, transformers' shared rotary module) is counted as any
    other: torch's ``CommDebugMode`` alone raises ``IndexError`` there (see
    [Note: a module that runs its forward more than once under CommDebugMode]).

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
    counts.by_group.update(mode.groups)
    counts.by_group_bytes.update(mode.group_bytes)
    totals = Counter(mode.get_comm_counts()) - counts._excluded
    total_bytes = Counter(mode.comm_bytes) - counts._excluded_bytes
    for op, n in totals.items():
        name = _op_name(op)
        counts.by_op[name] = counts.by_op.get(name, 0) + n
        kind = _kind(name)
        if kind is not None:
            setattr(counts, kind, getattr(counts, kind) + n)
            bytes_field = f"{kind}_bytes"
            setattr(counts, bytes_field, getattr(counts, bytes_field) + total_bytes[op])
