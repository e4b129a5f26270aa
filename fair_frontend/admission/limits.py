"""A rate limit as the admission package reads it: its units, its windows, one limit.

``RateLimitItem`` is what both ``ratelimit`` (the limiter) and ``storage`` (where it is
counted) take; ``items_from_limits`` turns a tenant's limits, any object that lists them
as ``(unit, window, amount)`` (the config's ``Limits`` does), into items.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, Protocol

WINDOWS_S: dict[str, float] = {
    "second": 1.0,
    "minute": 60.0,
    "hour": 3600.0,
    "day": 86400.0,
    "month": 30 * 86400.0,  # a sliding 30-day window, not the calendar month
}
LIMIT_UNITS = ("requests", "tokens")

Unit = Literal["requests", "tokens"]


@dataclass(frozen=True, slots=True)
class RateLimitItem:
    """One limit: ``amount`` ``unit`` in any window of ``seconds`` (named ``window``)."""

    unit: Unit
    window: str
    amount: int
    seconds: float

    def __str__(self) -> str:
        noun = self.unit[:-1] if self.amount == 1 else self.unit
        span = " (30 days)" if self.window == "month" else ""
        return f"{self.amount} {noun} per {self.window}{span}"


class LimitTerms(Protocol):
    """A tenant's limits on an endpoint, as ``(unit, window, amount)`` in a fixed order."""

    def items(self) -> Iterable[tuple[str, str, int]]: ...


def items_from_limits(limits: LimitTerms) -> list[RateLimitItem]:
    """The set limits as items, in the order ``limits`` lists them (the config's ``Limits``:
    its declaration order). Compute once per (tenant, endpoint) when the config loads, not
    per request."""
    items = []
    for unit, window, amount in limits.items():
        if unit not in LIMIT_UNITS:
            raise ValueError(f"unknown limit unit {unit!r}")
        items.append(RateLimitItem(unit, window, amount, WINDOWS_S[window]))  # type: ignore[arg-type]
    return items
