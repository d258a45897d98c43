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


class CountHooks(StepHooks):
    """Counts collectives per forward (``CommDebugMode`` cannot see two forwards at once),
    and passes the step's phases to ``timeline`` (a ``PrefetchTimeline``) if given."""

    def __init__(self, timeline: Any = None) -> None:
        self.parts: list[Any] = []
        self.timeline = timeline

    def mark(self, name: str) -> None:
        if self.timeline is not None:
            self.timeline.mark(name)

    @contextlib.contextmanager
    def segment(self) -> Iterator[None]:
        from .._measure import count_collectives

        with count_collectives() as counts:
            yield
        self.parts.append(counts)

    def totals(self) -> dict[str, int]:
        total: Counter = Counter()
        for part in self.parts:
            total.update({k: v for k, v in part.as_dict().items()})
            total.update({f"{k}_bytes": v for k, v in part.bytes_dict().items()})
        return dict(total)


class TimeHooks(StepHooks):
    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync = sync
        self.stamps: dict[str, float] = {}

    def mark(self, name: str) -> None:
        self.sync()
        self.stamps[name] = time.perf_counter()
