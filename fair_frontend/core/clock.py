"""The one clock of the asyncio layer: what time is it, and run this at that time.

The scheduler core takes ``now`` as an argument; the asyncio layer around it (dispatch,
outage probing) reads time and sets timers only through a ``Clock``, so that it too runs
on a fake clock in unit tests. Times are ``time.monotonic()`` seconds: CLOCK_MONOTONIC,
shared by every process of a host, so a shell's arrival time and the core's deadlines
are on one scale.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from typing import Protocol


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    """What time is it (monotonic seconds), and call this back at a given time?"""

    def now(self) -> float: ...

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer: ...


class LoopClock:
    """``time.monotonic()`` and the running event loop's timers."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop or asyncio.get_running_loop()

    def now(self) -> float:
        return time.monotonic()

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        # The loop's own clock may differ in origin and resolution (uvloop: ms): a delay.
        return self.loop.call_later(max(0.0, when - time.monotonic()), callback)


class _FakeTimer:
    __slots__ = ("cancelled",)

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    """A clock that moves only when told to (``advance``), for unit tests."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._timers: list[tuple[float, int, _FakeTimer, Callable[[], None]]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self._now

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        timer = _FakeTimer()
        heapq.heappush(self._timers, (when, next(self._seq), timer, callback))
        return timer

    def advance(self, seconds: float) -> None:
        """Move time forward, running every timer due on the way, in time order (each at
        its own time)."""
        until = self._now + seconds
        while self._timers and self._timers[0][0] <= until:
            when, _, timer, callback = heapq.heappop(self._timers)
            if timer.cancelled:
                continue
            self._now = max(self._now, when)
            callback()
        self._now = until

    @property
    def next_timer(self) -> float | None:
        """When the earliest live timer is due (None: none)."""
        for when, _, timer, _ in sorted(self._timers):
            if not timer.cancelled:
                return when
        return None
