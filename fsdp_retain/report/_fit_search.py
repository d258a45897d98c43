"""``fit``: which ``keep_unsharded`` budgets to simulate, and the largest whose peak fits.

A budget keeps units in the library's order (``keep_order`` in ``_policy.py``), so the
budget ``S_j``, the bytes of the first ``j`` units in that order, keeps exactly those
``j``: ``S_0`` is ``keep_unsharded=False``, ``S_n`` is ``True``. The search takes the
peaks of ``False`` and ``True``, simulated apart, then simulates ``S_j`` near its guess
until it has a ``j`` that fits next to a ``j + 1`` that does not; between ``S_j`` and
``S_(j+1)`` a budget may also keep a later, smaller unit, which a bisection on the budget
settles. It assumes a budget that keeps more never peaks lower. The guess: the peak of
the largest fitting ``j`` plus the bytes added, which is exact while the step's peak
falls where every kept unit is held (Llama-3-70B on 64 ranks, ``docs/report/fit``).
Nothing here runs torch: a probe is a budget to simulate, its peak comes back through
``record``.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection

from .._policy import keep_order
from ._fit import kept_units_of
from ._modes import BACKWARDS

class BudgetSearch:
    """The largest ``keep_unsharded`` budget whose peak is within ``gpu_memory``.

    ``units``: unsharded parameter bytes per unit, as ``_fit.unit_bytes`` gives them.

    Example::

        search = BudgetSearch(units, gpu_memory=80 * 2**30)
        search.record(0, peak_of_false)
        search.record(search.total, peak_of_true)
        while (budget := search.next_probe(running=())) is not None:
            search.record(budget, simulate(budget))
        budget = search.answer()  # None: not even keep_unsharded=False fits
    """

    def __init__(self, units: list[int], gpu_memory: int, slope: float = 1.0) -> None:
        self.units = list(units)
        self.gpu_memory = gpu_memory
        # Peak bytes per byte kept, until two budgets below True tell: 1, or 1 - 1/N where
        # a unit not kept is held at 1/N between passes (reshard_to=N).
        self.slope = slope
        ordered = keep_order([(i, n, i > 0) for i, n in enumerate(self.units)], BACKWARDS)
        self._sums = list(itertools.accumulate((n for _, n, _ in ordered), initial=0))
        self._peaks: dict[frozenset[int], int] = {}

    @property
    def total(self) -> int:
        """The bytes of every unit: the budget of ``keep_unsharded=True``."""
        return self._sums[-1]

    def kept(self, budget: int) -> frozenset[int]:
        """The units (indices into ``units``) the library keeps with ``budget``."""
        return frozenset(kept_units_of(self.units, budget))

    def record(self, budget: int, peak: int) -> None:
        self._peaks[self.kept(budget)] = peak

    def peak(self, budget: int) -> int | None:
        """The simulated peak of ``budget``'s units, if simulated."""
        return self._peaks.get(self.kept(budget))

    def fits(self, budget: int) -> bool | None:
        peak = self.peak(budget)
        return None if peak is None else peak <= self.gpu_memory

    def next_probe(self, running: Collection[int] = ()) -> int | None:
        """A budget to simulate now; ``None`` when there is nothing to simulate until
        a running one (``running``: budgets) or ``False`` is recorded, or when the
        search is done (once ``True`` is recorded too)."""
        busy = {self.kept(b) for b in running}
        bounds = self._bounds()
        if bounds is None:
            return None
        lo, hi = bounds
        if hi - lo > 1:
            # A guess that fits and the one above it that does not, if the guess is right;
            # a guess of none: the next one, which then does not fit.
            guess = self._guess(lo, hi)
            for j in (guess, guess + 1) if guess > lo else (lo + 1,):
                budget = self._sums[j] if j < hi else None
                if budget is not None and self.kept(budget) not in busy:
                    return budget  # unknown: every j between lo and hi is
            return None
        if self.fits(self.total) is None:
            return None
        budget = self._bisect(lo, hi)
        if budget is None or self.kept(budget) in busy:
            return None
        return budget

    def done(self) -> bool:
        bounds = self._bounds()
        if bounds is None:
            return self.fits(0) is False
        lo, hi = bounds
        settled = self.fits(self.total) is not None
        return settled and hi - lo <= 1 and self._bisect(lo, hi) is None

    def answer(self) -> int | None:
        """The largest budget that fits, as the bytes of the units it keeps (the
        smallest budget that keeps them); ``None`` when not even ``0`` (``False``) fits."""
        assert self.done(), "answer() before the search is done"
        bounds = self._bounds()
        if bounds is None:
            return None
        lo, hi = bounds
        if lo == len(self.units):
            return self.total
        budget = self._bisect(lo, hi, settled=True)
        assert budget is not None
        return sum(self.units[i] for i in self.kept(budget))

    def _bounds(self) -> tuple[int, int] | None:
        """``(lo, hi)``: ``S_lo`` fits, ``S_hi`` does not (``hi = n + 1`` when all fit;
        ``n`` while ``True`` is not recorded); ``None`` until ``False`` is recorded, or
        when it does not fit."""
        n = len(self.units)
        if self.fits(0) is not True:
            return None
        known = [(j, self.fits(self._sums[j])) for j in range(n + 1)]
        last = n + 1 if known[n][1] else n
        hi = min([j for j, fit in known if fit is False], default=last)
        lo = max(j for j, fit in known if fit and j < hi)
        return lo, hi

    def _guess(self, lo: int, hi: int) -> int:
        """The largest ``j`` in ``(lo, hi)`` that fits if the peak grows from ``S_lo``'s
        linearly in the bytes kept: as between ``S_lo`` and ``S_hi`` once a budget below
        ``True`` does not fit, else as from ``False`` to ``S_lo``, else by the bytes kept;
        ``lo`` if none."""
        low = self.peak(self._sums[lo])
        high = self.peak(self._sums[hi]) if hi < len(self.units) else None
        assert low is not None
        slope = self.slope
        if high is not None:
            slope = (high - low) / (self._sums[hi] - self._sums[lo])
        elif lo > 0:
            slope = (low - self._peaks[self.kept(0)]) / self._sums[lo]
        fitting = [j for j in range(lo + 1, hi)
                   if low + slope * (self._sums[j] - self._sums[lo]) <= self.gpu_memory]
        return max(fitting, default=lo)

    def _bisect(self, lo: int, hi: int, *, settled: bool = False) -> int | None:
        """Between ``S_lo`` (fits) and ``S_hi`` (does not): the first budget whose units
        are not simulated yet, or (``settled``) the largest budget that fits."""
        if hi > len(self.units):
            return self.total if settled else None
        low, high = self._sums[lo], self._sums[hi]
        while high - low > 1:
            mid = (low + high) // 2
            fit = self.fits(mid)
            if fit is None:
                return None if settled else mid
            low, high = (mid, high) if fit else (low, mid)
        return low if settled else None
