"""Selector 3: the order of one tenant's requests."""

from __future__ import annotations

import math
from typing import Any, Protocol

from fair_frontend.scheduler.types import QueuedRequest


class OrderingPolicy(Protocol):
    """Which of this tenant's requests goes first?

    ``key(req)``: the smaller key goes first. Keys must be unique per request (end with
    ``req.seq``), so that a queue never compares two requests themselves, and must not
    change while the request is queued. Stateless.
    """

    def key(self, req: QueuedRequest) -> tuple[Any, ...]: ...


class PriorityDeadlineArrival:
    """Explicit priority (1 first), then earliest deadline (none last), then arrival.

    A deadline only orders requests of equal priority: an urgent deadline never overtakes
    a higher priority level, so priority stays the tenant's explicit, predictable choice.
    """

    __slots__ = ()

    def key(self, req: QueuedRequest) -> tuple[int, float, int]:
        deadline = req.deadline
        return (req.priority, math.inf if deadline is None else deadline, req.seq)
