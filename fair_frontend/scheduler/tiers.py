"""Selector 1: which SLA tier sends next (strict order, with an optional guard)."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeVar

from fair_frontend.scheduler.types import Load

S = TypeVar("S")


class Tier(Load):
    """One tier on one endpoint: its queued load, active weight and fairness state."""

    __slots__ = ("active_weight", "busy_tenants", "fair_state", "index", "name")

    def __init__(self, name: str, index: int, fair_state: Any) -> None:
        super().__init__()
        self.name = name
        self.index = index  # 0 = highest
        self.active_weight = 0.0  # sum of weights of its tenants with queued work
        self.busy_tenants = 0  # its tenants with queued work (fair mode)
        self.fair_state = fair_state  # the FairnessPolicy's state for this tier


class TierSelector(Protocol[S]):
    """Which tier goes next?

    ``choose`` gets the tiers highest first and returns one with queued work, or None if
    none has any. It must return a tier with work whenever one exists (the scheduler is
    work-conserving) and must not change ``state``: the scheduler may choose, then leave
    the request for the next batch. ``record`` reports each dispatched request's rows.
    """

    def new_state(self) -> S: ...

    def choose(self, state: S, tiers: Sequence[Tier]) -> Tier | None: ...

    def record(self, state: S, tier: Tier, rows: int) -> None: ...


class StrictTierOrder:
    """The highest tier with queued work: a lower tier waits while any higher one has work.

    Under sustained overload of a higher tier, lower tiers starve; that is the contract
    of strict SLA tiers (paid before trial). ``GuardedTierOrder`` relaxes it.
    """

    __slots__ = ()

    def new_state(self) -> None:
        return None

    def choose(self, state: None, tiers: Sequence[Tier]) -> Tier | None:
        for tier in tiers:
            if tier.requests:
                return tier
        return None

    def record(self, state: None, tier: Tier, rows: int) -> None:
        return None


class ShareWindow:
    """Rows dispatched per tier over the last ``size`` rows (about: whole requests)."""

    __slots__ = ("recent", "rows", "size", "total")

    def __init__(self, tiers: int, size: int) -> None:
        self.size = size
        self.recent: deque[tuple[int, int]] = deque()  # (tier index, rows), oldest first
        self.rows = [0] * tiers
        self.total = 0


class GuardedTierOrder:
    """Strict order, except that a tier below its minimum share of recent rows goes first.

    ``min_share[i]`` is tier i's minimum fraction of the rows dispatched over the recent
    window. A tier with work whose share is below its minimum is chosen before every other
    tier (the highest such tier if several are); otherwise the order is strict.

    Trade-off: the guaranteed share is taken from the tiers above, so under overload a
    paid tier's throughput drops by up to the sum of the shares below it and its queueing
    latency rises accordingly. When a guarded tier has no work, nothing is reserved for it
    (the guard is work-conserving); it only decides between tiers that all have work. An
    empty window (at start) counts as no tier being below its share.
    """

    __slots__ = ("min_share", "window_rows")

    def __init__(
        self, tiers: Sequence[str], min_share: Mapping[str, float], window_rows: int
    ) -> None:
        unknown = set(min_share) - set(tiers)
        if unknown:
            raise ValueError(f"min_share names unknown tiers: {sorted(unknown)}")
        if window_rows < 1:
            raise ValueError(f"window_rows must be >= 1, not {window_rows}")
        self.min_share = tuple(float(min_share.get(t, 0.0)) for t in tiers)
        self.window_rows = window_rows

    def new_state(self) -> ShareWindow:
        return ShareWindow(len(self.min_share), self.window_rows)

    def choose(self, state: ShareWindow, tiers: Sequence[Tier]) -> Tier | None:
        first = None
        total = state.total
        for tier in tiers:
            if not tier.requests:
                continue
            share = self.min_share[tier.index]
            if share and state.rows[tier.index] < share * total:
                return tier
            if first is None:
                first = tier
        return first

    def record(self, state: ShareWindow, tier: Tier, rows: int) -> None:
        state.recent.append((tier.index, rows))
        state.rows[tier.index] += rows
        state.total += rows
        # Keep the newest rows that fit in the window (at least the newest request).
        while state.total - state.recent[0][1] >= state.size:
            index, old = state.recent.popleft()
            state.rows[index] -= old
            state.total -= old
