"""Fairness over a sliding window, for the gauges (``Scheduler.window``).

The scheduler keeps, per tenant queue, the cost it served (``TenantQueue.served``: the
cost charged at dispatch plus what is charged back as output streams, undecayed), when
the queue last turned from empty to queued (``busy_since``) and when it last emptied
(``idle_since``): an addition per dispatch, a store per change between empty and not.
At the first dispatch of each whole second it records every tenant's ``served``
(``ServiceLog``), which is then the service at that second's start exactly, since
nothing was dispatched between it and that dispatch. The scrape computes the rest.

The window is the last ``WINDOW_S`` whole seconds: from ``floor(now) - WINDOW_S`` to
``floor(now)`` (at 25.3 s: [15 s, 25 s]); the current, partial second is left out, so
a figure moves once a second and a service just dispatched shows within a second.
A tenant is backlogged through the window when it had queued work at every moment of
it: it last turned queued at or before the start, and it has queued work still or
last emptied at or after the end (only the latest of each is kept: a tenant that
emptied after the end and queued again before the scrape is left out of that scrape).
Output charged back counts in the second of the scheduler's latest dispatch before it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

WINDOW_S = 10
"""The window's length in whole seconds (the gauges' HELP says so)."""


class ServiceLog:
    """Every tenant's cumulative service at the start of the recent seconds that had a
    dispatch: at most ``WINDOW_S + 1`` records, one taken per second at most."""

    __slots__ = ("_records",)

    def __init__(self) -> None:
        self._records: deque[tuple[float, dict[str, float]]] = deque()

    def record(self, second: float, served: dict[str, float]) -> None:
        """``served`` is every tenant's service at ``second`` (a whole second, later than
        any recorded before); records no window can start at any more are dropped."""
        records = self._records
        records.append((second, served))
        while records[0][0] < second - WINDOW_S:
            records.popleft()

    def at(self, second: float, now: Mapping[str, float]) -> Mapping[str, float]:
        """Every tenant's service at ``second`` (a whole second, at most ``now``'s):
        the first record at or after it (nothing was dispatched between the two), else
        the service now (``now``: nothing dispatched since)."""
        for when, served in self._records:
            if when >= second:
                return served
        return now


@dataclass(frozen=True, slots=True)
class WindowFairness:
    """What one endpoint served over the window ``[start, end]`` (``WINDOW_S`` s).

    ``served``: tenant -> cost served in the window (tenants served anything only).
    ``backlogged``: tier -> tenant -> normalised service (cost served / weight) of the
    tenants of that tier backlogged through the window (tiers with any only)."""

    start: float
    end: float
    served: dict[str, float]
    backlogged: dict[str, dict[str, float]]

    def goodput(self) -> dict[str, float]:
        """Tenant -> cost units served per second over the window."""
        return {tenant: cost / WINDOW_S for tenant, cost in self.served.items()}


def window_end(now: float) -> float:
    """The window's end at ``now``: the latest whole second."""
    return float(math.floor(now))


def service_gap(normalised: Iterable[float]) -> float:
    """The largest difference between two of ``normalised`` (max - min)."""
    values = list(normalised)
    return max(values) - min(values)


def jain_index(normalised: Iterable[float]) -> float:
    """Jain's fairness index, (sum x) ** 2 / (n * sum x ** 2); 1.0 when every x is 0
    (equal, if empty, shares)."""
    values = list(normalised)
    squares = sum(x * x for x in values)
    if squares == 0:
        return 1.0
    return sum(values) ** 2 / (len(values) * squares)
