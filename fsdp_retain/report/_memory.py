"""Peak memory of one step and its breakdown at the peak, from torch's memory trackers.

FSDP2: ``FSDPMemTracker``; FSDP1 (and FSDP2 where that is missing): ``MemTracker``
with all-gather outputs labelled as unsharded parameters and reduced tensors as
gradients.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

from ._rows import BREAKDOWN_KEYS

_BUCKETS = {
    "Sharded Param": "sharded_params",
    "Parameter": "sharded_params",
    "Unsharded Param": "unsharded_params",
    "All Gather": "unsharded_params",
    "Sharded Grad": "grads",
    "Unsharded Grad": "grads",
    "Reduce Scatter": "grads",
    "Gradient": "grads",
    "Activation": "activations",
}


@functools.lru_cache(maxsize=None)  # called for every op of a tracked step
def _collective_kind(func) -> str | None:
    from .._measure import _KINDS

    packet = getattr(func, "_overloadpacket", None)
    if packet is None:
        return None
    name = str(packet).split(".")[-1].lower()
    for kind, needles in _KINDS.items():
        if any(needle in name for needle in needles):
            return kind
    return None


def _tensors(value) -> list:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _tracker_classes():
    """``(FSDP2 tracker class or None, generic tracker class)``, built on torch's trackers.

    Both remember which storages were alive at the peak, so a label given
    later (an unsharded gradient is only recognised when it is reduced)
    still counts for the peak.
    """
    import torch

    device_op = torch.ops.prim.device.default
    try:
        from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
    except ImportError as exc:
        raise RuntimeError(
            "memory report: torch.distributed._tools.mem_tracker.MemTracker is missing "
            f"in torch {torch.__version__}"
        ) from exc

    class PeakLive:
        """Keeps a log of each storage's size and replays it to the peak at the end.

        Replaces torch's ``_update_peak_stats``, which after every op walks every
        module seen so far (minutes per step for a 7B model) to keep per-module
        peaks the report does not read.
        """

        def __init__(self, *args, **kwargs) -> None:
            # Before torch's __init__, which may already register storages.
            self._now: dict[Any, int] = {}  # winfo -> bytes
            self._totals: Counter = Counter()  # device -> bytes
            self._log: list[tuple[Any, int]] = []  # (winfo, bytes) after each change
            self._peaks: dict[Any, tuple[int, int]] = {}  # device -> (bytes, len(_log))
            super().__init__(*args, **kwargs)

        def _update_snap(self, u_type, winfo, *args, **kwargs) -> None:
            super()._update_snap(u_type, winfo, *args, **kwargs)  # type: ignore[misc]
            now = 0 if u_type.name == "DEL" else winfo.mem_consumed
            before = self._now.get(winfo, 0)
            if now != before:
                self._now[winfo] = now
                self._totals[winfo.device] += now - before
                self._log.append((winfo, now))

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # Fake tensors answer ``.device`` through dispatch: most ops of a
            # simulated step. It allocates nothing, so torch's bookkeeping is skipped.
            if func is device_op:
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _update_peak_stats(self, peak_state) -> None:
            for dev, total in self._totals.items():
                if total > self._peaks.get(dev, (0, 0))[0]:
                    self._peaks[dev] = (total, len(self._log))

        def _live_at_peak(self, device_type: str) -> list[tuple[Any, int]]:
            live = []
            for dev, (_, length) in self._peaks.items():
                if dev.type != device_type:
                    continue
                sizes: dict[Any, int] = {}
                for winfo, size in self._log[:length]:
                    if winfo.device == dev:
                        sizes[winfo] = size
                live += [(winfo, size) for winfo, size in sizes.items() if size > 0]
            return live

        def peak_breakdown(self, device_type: str) -> tuple[int, dict, dict]:
            """``(peak bytes, breakdown by BREAKDOWN_KEYS, by tracker category)``."""
            live = self._live_at_peak(device_type)
            buckets: Counter = Counter(dict.fromkeys(BREAKDOWN_KEYS, 0))
            detail: Counter = Counter()
            for winfo, mem in live:
                label = getattr(winfo, "report_label", None) or str(winfo.reftype.value)
                bucket = getattr(winfo, "report_bucket", None) or _BUCKETS.get(label, "other")
                buckets[bucket] += mem
                detail[label] += mem
            return sum(buckets.values()), dict(buckets), dict(detail)

    class GenericTracker(PeakLive, MemTracker):
        """``MemTracker`` for any FSDP: parameters registered up front as sharded;
        all-gather outputs count as unsharded parameters, reduced tensors as grads."""

        def __init__(self, model, optimizer, inputs) -> None:
            super().__init__()
            for param in model.parameters():
                self._update_and_maybe_create_winfos(param, _MemRefType.PARAM)
            for buffer in model.buffers():
                self._update_and_maybe_create_winfos(buffer, _MemRefType.BUFFER)
            for state in optimizer.state.values():
                for value in _tensors(list(state.values())):
                    self._update_and_maybe_create_winfos(value, _MemRefType.OPT)
            for tensor in _tensors(list(inputs)):
                self._update_and_maybe_create_winfos(tensor, _MemRefType.OTH)

        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            # Registered in __init__; FSDP points parameters at unsharded
            # storage during forward, which must not be relabelled.
            return 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if out is NotImplemented or func is device_op:
                return out
            kind = _collective_kind(func)
            if kind == "all_gather":
                sides = [_tensors(a) for a in (*args, out)]
                largest = max(sides, key=lambda ts: sum(t.numel() * t.element_size() for t in ts))
                self._label(largest, _MemRefType.PARAM, "unsharded_params", "All-gathered Param")
            elif kind is not None:
                self._label(_tensors(list(args)), _MemRefType.GRAD, "grads", "Reduced Grad")
            return out

        def _label(self, tensors, reftype, bucket: str, label: str) -> None:
            for tensor in tensors:
                for winfo in self._update_and_maybe_create_winfos(tensor, reftype):
                    winfo.report_bucket = bucket  # type: ignore[attr-defined]
                    winfo.report_label = label  # type: ignore[attr-defined]

    GenericTracker.torch_tool = "MemTracker"
    fsdp2_tracker = None
    try:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        class FSDP2Tracker(PeakLive, FSDPMemTracker):
            def __init__(self, model, optimizer, inputs) -> None:
                super().__init__(model, optimizer)
                self.track_inputs(tuple(inputs))

        FSDP2Tracker.torch_tool = "FSDPMemTracker"
        fsdp2_tracker = FSDP2Tracker
    except ImportError:
        pass
    return fsdp2_tracker, GenericTracker


def make_tracker(model, optimizer, batch, backend: str):
    fsdp2_tracker, generic = _tracker_classes()
    cls = fsdp2_tracker if backend == "fsdp2" and fsdp2_tracker is not None else generic
    return cls(model, optimizer, batch)

