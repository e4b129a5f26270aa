"""Properties of the limiter on random traffic, on both storages (fewer examples on Redis).

Safety: in every window of length T, sliding (each one starting at an admission time,
closed at both ends), the admitted amount never exceeds N.
Liveness: every rejection is justified by admissions within the last T + T/K (capacity
comes back at most one bucket late), or by a cost above N.
Negative controls: a fixed-window counter must fail the safety check, a limiter that never
forgets must fail the liveness check; otherwise the checks could pass vacuously.
Batching: checks made concurrently (all those at one instant) share Redis round trips; they
must decide exactly what the same checks made one at a time decide (memory, in the same
order), and so keep both properties.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fair_frontend.admission import (
    MemoryStorage,
    RateLimiter,
    RateLimitItem,
    RedisStorage,
    Storage,
)
from fair_frontend.admission.limits import WINDOWS_S
from fair_frontend.admission.storage import DEFAULT_BUCKETS, Checked, Rejection

K = DEFAULT_BUCKETS
TIMEOUT_S = 5.0  # functional runs must never see a storage error
BASE_US = 1_700_000_000_000_000  # a realistic unix time, in µs


@dataclass(frozen=True)
class Event:
    dt_us: int  # since the previous event
    tokens: int


@dataclass(frozen=True)
class Outcome:
    t_us: int
    tokens: int
    allowed: bool
    retry_after: float | None
    violated: RateLimitItem | None


def cost(it: RateLimitItem, tokens: int) -> int:
    return 1 if it.unit == "requests" else tokens


async def run(
    storage: Storage, key: str, items: Sequence[RateLimitItem], events: Sequence[Event]
) -> list[Outcome]:
    limiter = RateLimiter(storage, on_storage_error="fail_closed")
    out = []
    t = 0
    try:
        for e in events:
            t += e.dt_us
            now = (BASE_US + t) / 1e6
            assert round(now * 1e6) == BASE_US + t  # the property is checked in exact µs
            d = await limiter.check(key, items, requests=1, tokens=e.tokens, now=now)
            out.append(Outcome(t, e.tokens, d.allowed, d.retry_after, d.violated))
    finally:
        await limiter.close()
    return out


async def run_concurrently(
    storage: Storage, key: str, items: Sequence[RateLimitItem], events: Sequence[Event]
) -> list[Outcome]:
    """As ``run``, but the checks at one instant (steps of 0) are made concurrently, in
    event order: on Redis they share pipelined round trips."""
    limiter = RateLimiter(storage, on_storage_error="fail_closed")
    groups: list[list[tuple[int, Event]]] = []
    t = 0
    for e in events:
        t += e.dt_us
        if e.dt_us == 0 and groups:
            groups[-1].append((t, e))
        else:
            groups.append([(t, e)])
    out = []
    try:
        for group in groups:
            decisions = await asyncio.gather(
                *(
                    limiter.check(key, items, requests=1, tokens=e.tokens, now=(BASE_US + t) / 1e6)
                    for t, e in group
                )
            )
            out += [
                Outcome(t, e.tokens, d.allowed, d.retry_after, d.violated)
                for (t, e), d in zip(group, decisions, strict=True)
            ]
    finally:
        await limiter.close()
    return out


def max_in_any_window(outcomes: Sequence[Outcome], it: RateLimitItem) -> int:
    """The most admitted in any closed window [a, a + T] starting at an admission time."""
    window_us = round(it.seconds * 1e6)
    admitted = [(o.t_us, cost(it, o.tokens)) for o in outcomes if o.allowed]
    return max(
        (sum(c for t, c in admitted if a <= t <= a + window_us) for a, _ in admitted), default=0
    )


def unjustified_rejections(
    outcomes: Sequence[Outcome], items: Sequence[RateLimitItem]
) -> list[Outcome]:
    """Rejections not explained by admissions within the last T + T/K, nor by cost > N."""
    bad = []
    for i, o in enumerate(outcomes):
        if o.allowed:
            continue
        it = o.violated
        assert it is not None and it in items
        need = cost(it, o.tokens)
        if o.retry_after is None:
            if need <= it.amount:
                bad.append(o)
            continue
        window_us = round(it.seconds * 1e6)
        lookback = window_us + -(-window_us // K)
        recent = sum(
            cost(it, p.tokens)
            for p in outcomes[:i]
            if p.allowed and o.t_us - lookback < p.t_us <= o.t_us
        )
        if recent + need <= it.amount or not 0 < o.retry_after <= lookback / 1e6:
            bad.append(o)
    return bad


@st.composite
def scenarios(draw: st.DrawFn, bursts: bool = False) -> tuple[list[RateLimitItem], list[Event]]:
    """Limits and traffic; ``bursts``: mostly steps of 0 (concurrent checks)."""
    windows = list(WINDOWS_S)
    req_window = draw(st.sampled_from(windows))
    tok_window = draw(st.sampled_from(windows))
    items = []
    if draw(st.booleans()):
        amount = draw(st.integers(0, 8))
        items.append(RateLimitItem("requests", req_window, amount, WINDOWS_S[req_window]))
    if draw(st.booleans()) or not items:
        amount = draw(st.integers(0, 100))
        items.append(RateLimitItem("tokens", tok_window, amount, WINDOWS_S[tok_window]))
    # Steps scaled to the shortest window, with bursts (0) and long gaps.
    scale_us = round(min(it.seconds for it in items) * 1e6)
    step = st.one_of(
        st.just(0),
        st.integers(0, scale_us // 4),
        st.integers(0, 2 * scale_us),
        st.sampled_from([scale_us, scale_us + 1, scale_us - 1, scale_us // K]),
    )
    if bursts:
        step = st.one_of(st.just(0), st.just(0), st.just(0), step)
    size = 120 if bursts else 60
    events = draw(st.lists(st.builds(Event, step, st.integers(0, 40)), min_size=1, max_size=size))
    return items, events


def check_properties(items: Sequence[RateLimitItem], outcomes: Sequence[Outcome]) -> None:
    for it in items:
        assert max_in_any_window(outcomes, it) <= it.amount, it
    assert unjustified_rejections(outcomes, items) == []


_keys = itertools.count()


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_memory_never_exceeds_any_sliding_window(
    scenario: tuple[list[RateLimitItem], list[Event]],
) -> None:
    items, events = scenario
    outcomes = asyncio.run(run(MemoryStorage(), "k", items, events))
    check_properties(items, outcomes)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(scenarios())
def test_redis_never_exceeds_any_sliding_window(
    redis_url: str, scenario: tuple[list[RateLimitItem], list[Event]]
) -> None:
    items, events = scenario
    key = f"prop{next(_keys)}"

    async def go() -> list[Outcome]:
        storage = RedisStorage(redis_url, timeout_s=TIMEOUT_S)
        return await run(storage, key, items, events)

    check_properties(items, asyncio.run(go()))


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(scenarios(bursts=True))
def test_concurrent_checks_decide_as_one_at_a_time(
    redis_url: str, scenario: tuple[list[RateLimitItem], list[Event]]
) -> None:
    """Batched on Redis (concurrent checks share round trips) = one at a time in memory."""
    items, events = scenario
    key = f"batch{next(_keys)}"

    async def go() -> tuple[list[Outcome], int]:
        storage = RedisStorage(redis_url, timeout_s=TIMEOUT_S)
        outcomes = await run_concurrently(storage, key, items, events)
        return outcomes, storage.round_trips.round_trips

    batched, round_trips = asyncio.run(go())
    # One round trip per instant (and one more if Redis had to load the script).
    assert round_trips <= 1 + sum(1 for e in events[1:] if e.dt_us) + 1
    assert batched == asyncio.run(run(MemoryStorage(), "k", items, events))
    check_properties(items, batched)


# ---- negative controls: the checks above must catch a broken limiter ---------------------


class FixedWindowStorage:
    """The classic fixed-window counter: resets at every multiple of T."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str, int], int] = {}

    async def acquire(
        self, key: str, items: Sequence[RateLimitItem], costs: Sequence[int], now_us: int
    ) -> Checked:
        slots = [(key, it.unit, now_us // round(it.seconds * 1e6)) for it in items]
        for i, (slot, it, c) in enumerate(zip(slots, items, costs, strict=True)):
            if self.counts.get(slot, 0) + c > it.amount:
                return Rejection(i, 1), ()
        for slot, c in zip(slots, costs, strict=True):
            self.counts[slot] = self.counts.get(slot, 0) + c
        return None, ()

    async def close(self) -> None:
        pass


class NeverForgetStorage(FixedWindowStorage):
    """Counts forever: safe, but capacity never comes back."""

    async def acquire(
        self, key: str, items: Sequence[RateLimitItem], costs: Sequence[int], now_us: int
    ) -> Checked:
        return await super().acquire(key, items, costs, 0)


@pytest.mark.parametrize(
    ("make", "check"),
    [
        (FixedWindowStorage, lambda items, out: max_in_any_window(out, items[0]) > items[0].amount),
        (NeverForgetStorage, lambda items, out: unjustified_rejections(out, items) != []),
    ],
)
def test_the_checks_catch_broken_limiters(
    make: Callable[[], Storage], check: Callable[[list[RateLimitItem], list[Outcome]], bool]
) -> None:
    items = [RateLimitItem("requests", "minute", 3, 60.0)]
    # 3 just before a minute boundary, 3 just after, then 3 two minutes later.
    before = 60_000_000 - (BASE_US % 60_000_000) - 10
    events = [Event(before, 0), Event(0, 0), Event(0, 0)]
    events += [Event(20, 0), Event(0, 0), Event(0, 0), Event(120_000_000, 0)]
    assert check(items, asyncio.run(run(make(), "k", items, events)))
    # ... and the real limiter passes both checks on the same traffic.
    check_properties(items, asyncio.run(run(MemoryStorage(), "k", items, events)))
