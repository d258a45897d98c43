"""What a measurement wraps around parts of a training step: memory, collectives, time."""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any


class StepHooks:
    """The points of a step a measurement can hook (the defaults do nothing).

    ``segment()`` encloses each forward with the backward passes over it;
    ``mark(name)`` stamps the time at a point of the step.
    """

    def segment(self):
        return contextlib.nullcontext()

    def mark(self, name: str) -> None:
        pass


NO_HOOKS = StepHooks()


class TrackerHooks(StepHooks):
    """Lets torch's memory trackers see a second forward of the root within one step."""

    def __init__(self, tracker) -> None:
        self.tracker = tracker

    @contextlib.contextmanager
    def segment(self) -> Iterator[None]:
        self.tracker.reset_mod_stats()
        yield


# The all-gathers of a step after its first backward: for the library's modes, the
# re-gathers of the later passes; for ``two_forward``, its second forward and backward.
LATER = "later"


class CountHooks(StepHooks):
    """Counts collectives per forward (a segment each: ``two_forward``'s two apart),
    and passes the step's phases to ``timeline`` (a ``PrefetchTimeline``) if given.
    All-gathers after the first backward count apart (``LATER``), by process group size."""

    def __init__(self, timeline: Any = None, *, modules: bool = True) -> None:
        self.parts: list[Any] = []
        self.timeline = timeline
        self.modules = modules  # count_collectives(modules=...)
        self._part = ""
        self._counts: Any = None  # the CollectiveCounts of the open segment

    def mark(self, name: str) -> None:
        if self.timeline is not None:
            self.timeline.mark(name)
        if name == "backward1_end":
            self._part = LATER
            if self._counts is not None:
                self._counts.mark(LATER)

    @contextlib.contextmanager
    def segment(self) -> Iterator[None]:
        from .._measure import count_collectives

        with count_collectives(modules=self.modules) as counts:
            self._counts = counts
            counts.mark(self._part)
            try:
                yield
            finally:
                self._counts = None
        self.parts.append(counts)

    def group_bytes(self, part: str = LATER) -> dict[int, int]:
        """All-gather bytes per rank of ``part`` of the step, by process group size."""
        total: Counter = Counter()
        for counts in self.parts:
            total.update(counts.groups("all_gather", part, nbytes=True))
        return dict(sorted(((n, b) for n, b in total.items() if n is not None), reverse=True))

    def totals(self) -> dict[str, int]:
        total: Counter = Counter()
        for part in self.parts:
            total.update({k: v for k, v in part.as_dict().items()})
            total.update({f"{k}_bytes": v for k, v in part.bytes_dict().items()})
        return dict(total)


class TrackerCountHooks(CountHooks):
    """Both ``TrackerHooks`` and ``CountHooks`` in one step (``--simulate-world-size``
    counts in the step it measures memory in: a step costs seconds there)."""

    def __init__(self, tracker) -> None:
        super().__init__(modules=False)  # nothing that changes the peak
        self.tracker_hooks = TrackerHooks(tracker)

    @contextlib.contextmanager
    def segment(self) -> Iterator[None]:
        with self.tracker_hooks.segment(), super().segment():
            yield


class TimeHooks(StepHooks):
    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync = sync
        self.stamps: dict[str, float] = {}

    def mark(self, name: str) -> None:
        self.sync()
        self.stamps[name] = time.perf_counter()
