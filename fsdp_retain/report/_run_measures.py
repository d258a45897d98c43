"""What one step of a mode measures besides its time: its collectives and its memory.

``StepMeasures`` is ``BackendRun``'s half for these (``_runner.py`` builds the model and
runs the phases; this module holds one counted or memory-tracked step and what it keeps
in the mode's results).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

from ._config import ReportConfig
from ._hooks import CountHooks, TrackerCountHooks, TrackerHooks
from ._memory import make_tracker
from ._model import decoder_layers, fsdp_units
from ._modes import Mode
from ._prefetch import PrefetchTimeline
from ._step import train_step


def short_error() -> str:
    exc = sys.exc_info()[1]
    text = f"{type(exc).__name__}: {exc}".strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    return first[:500]


class StepMeasures:
    """One counted or memory-tracked step of a mode, on ``BackendRun``'s model."""

    cfg: ReportConfig
    backend: str
    device: Any
    model: Any
    optimizer: Any
    batch: Any
    meta: dict[str, Any]
    results: dict[str, dict[str, Any]]

    # BackendRun's
    @property
    def unsharded(self) -> int:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def agree(self, error: str | None) -> str | None:
        raise NotImplementedError

    def log(self, message: str) -> None:
        raise NotImplementedError

    def build(self) -> None:
        raise NotImplementedError

    def count(self, mode: Mode) -> None:
        # Which backward all-gathers were prefetched (FSDP on real ranks only).
        timeline = (
            PrefetchTimeline(self.model, decoder_layers(self.model))
            if self.backend in ("fsdp1", "fsdp2") and self.cfg.simulate_world_size is None
            else None
        )
        hooks = CountHooks(timeline)
        with timeline.recording() if timeline is not None else contextlib.nullcontext():
            train_step(self.model, self.optimizer, self.batch, mode, hooks, self.unsharded)
        if self.backend == "ddp":  # rebuilt by bucket_cap_mb after DDP's first synced step
            self.meta["fsdp_units"] = fsdp_units(self.model, self.backend)
        self.keep_counts(mode, hooks)
        if timeline is not None:
            self.results[mode.label]["prefetch"] = timeline.counts()

    def keep_counts(self, mode: Mode, hooks: CountHooks) -> None:
        result = self.results[mode.label]
        result["counts"] = hooks.totals()
        result["all_gather_group_bytes"] = hooks.group_bytes("")
        result["later_all_gather_group_bytes"] = hooks.group_bytes()

    def memory(self, mode: Mode, *, count: bool = False) -> None:
        """The peak of one step; ``count``: also its collectives (on CPU, in the same step)."""
        import torch

        result = self.results[mode.label]
        if self.device.type == "cuda":
            self.sync()
            torch.cuda.reset_peak_memory_stats(self.device)
            train_step(self.model, self.optimizer, self.batch, mode, unsharded_bytes=self.unsharded)
            self.sync()
            result["peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
            result["memory_source"] = "torch.cuda.max_memory_allocated"
        if self.device.type != "cuda":
            self.tracked_step(mode, count=count)
            return
        # On GPU the peak above stands even if torch's tracker fails on this version.
        error = None
        try:
            self.tracked_step(mode)
        except Exception:  # noqa: BLE001
            error = short_error()
        error = self.agree(error)
        if error is not None:
            result["breakdown_error"] = error
            self.log(f"{mode.label}: no breakdown: {error}")
            self.build()

    def tracked_step(self, mode: Mode, *, count: bool = False) -> None:
        result = self.results[mode.label]
        tracker = make_tracker(self.model, self.optimizer, self.batch, self.backend)
        hooks = TrackerCountHooks(tracker) if count else TrackerHooks(tracker)
        with tracker:
            train_step(self.model, self.optimizer, self.batch, mode, hooks, self.unsharded)
        if isinstance(hooks, TrackerCountHooks):
            self.keep_counts(mode, hooks)
        peak, breakdown, detail = tracker.peak_breakdown(self.device.type)
        result["tracker"] = tracker.torch_tool
        result["tracker_peak_bytes"] = peak
        result["breakdown"] = breakdown
        result["breakdown_detail"] = detail
        if self.device.type != "cuda":
            result["peak_bytes"] = peak
            result["memory_source"] = result["tracker"]
