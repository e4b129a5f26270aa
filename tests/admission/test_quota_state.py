"""What a check reports of each limit afterwards (``storage.WindowState``): remaining and
reset, on a fake clock, over both storages (``storage`` runs each test on memory and on a
real Redis).

The two numbers are checked for what they promise a client, not against a copy of the
bucket arithmetic:

- ``remaining`` is exact: at the same instant a request costing ``remaining`` fits that
  limit, one costing a unit more does not;
- ``reset`` is exact: with no traffic after, the window is empty (the whole limit left)
  exactly ``reset`` later, and not a microsecond before; in between, ``reset`` counts down
  in real time and ``remaining`` only grows.

Histories mix admissions, refusals, clocks that stepped back, and refunds (which may empty
the newest bucket: the state must skip it, a path of its own in the Redis script).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fair_frontend.admission import MemoryStorage, RateLimitItem, RedisStorage, Storage
from fair_frontend.admission.limits import WINDOWS_S, Unit
from fair_frontend.admission.ratelimit import RateLimiter
from fair_frontend.admission.storage import DEFAULT_BUCKETS, WindowState
from tests.admission.conftest import StorageFactory

K = DEFAULT_BUCKETS
BASE_US = 1_700_000_000_000_000
TIMEOUT_S = 5.0
_keys = itertools.count()


def item(unit: Unit, window: str, amount: int) -> RateLimitItem:
    return RateLimitItem(unit, window, amount, WINDOWS_S[window])


def width(it: RateLimitItem) -> int:
    return -(-round(it.seconds * 1e6) // K)


async def test_remaining_counts_down_and_a_refusal_counts_nothing(storage: Storage) -> None:
    rps, tpm = item("requests", "second", 3), item("tokens", "minute", 100)
    items = [rps, tpm]
    t = BASE_US
    states = []
    for _ in range(3):
        rejection, state = await storage.acquire("k", items, [1, 30], t)
        assert rejection is None
        states.append(list(state))
        t += 1000
    assert [s[0][0] for s in states] == [2, 1, 0]
    assert [s[1][0] for s in states] == [70, 40, 10]
    # Every admission so far sits in the bucket of BASE_US (a bucket is 20 ms for a
    # second, 1.2 s for a minute), which leaves the window one bucket after T.
    for n, ((_, reset_r), (_, reset_t)) in enumerate(states):
        at = BASE_US + 1000 * n
        assert reset_r == (BASE_US // width(rps) + K + 1) * width(rps) - at
        assert reset_t == (BASE_US // width(tpm) + K + 1) * width(tpm) - at
    # The fourth is refused by the requests limit and counts nothing, in either limit.
    rejection, state = await storage.acquire("k", items, [1, 5], t)
    assert rejection is not None and rejection.index == 0
    assert [s[0] for s in state] == [0, 10]
    # A check that costs nothing reads the state without counting.
    rejection, state = await storage.acquire("k", items, [0, 0], t)
    assert rejection is None and [s[0] for s in state] == [0, 10]


async def test_an_empty_window_has_its_whole_limit_and_no_reset(storage: Storage) -> None:
    items = [item("requests", "minute", 5), item("tokens", "day", 1000)]
    rejection, state = await storage.acquire("fresh", items, [0, 0], BASE_US)
    assert rejection is None and list(state) == [(5, 0), (1000, 0)]
    # Cost alone above the limit: refused, and the state is still the empty one.
    rejection, state = await storage.acquire("fresh", items, [1, 2000], BASE_US)
    assert rejection is not None and rejection.wait_us is None
    assert list(state) == [(5, 0), (1000, 0)]


async def test_a_refund_that_empties_the_newest_bucket_moves_the_reset_back(
    storage: Storage,
) -> None:
    tpd = item("tokens", "day", 1000)
    w = width(tpd)
    first, second = BASE_US, BASE_US + 3 * w  # two admissions, three buckets apart
    await storage.acquire("r", [tpd], [100], first)
    _, state = await storage.acquire("r", [tpd], [50], second)
    assert state[0] == (850, (second // w + K + 1) * w - second)
    await storage.adjust("r", [tpd], [-50], second, second + 1)
    _, state = await storage.acquire("r", [tpd], [0], second + 1)
    # The newest bucket holds nothing now: the window empties when the first one leaves.
    assert state[0] == (900, (first // w + K + 1) * w - (second + 1))


async def test_a_clock_that_stepped_back_counts_and_resets_from_the_newest_bucket(
    storage: Storage,
) -> None:
    rpm = item("requests", "minute", 10)
    w = width(rpm)
    await storage.acquire("b", [rpm], [1], BASE_US + 5 * w)
    _, state = await storage.acquire("b", [rpm], [1], BASE_US)  # five buckets earlier
    assert state[0] == (8, ((BASE_US + 5 * w) // w + K + 1) * w - BASE_US)


async def test_the_limiter_reports_the_binding_windows(new_storage: StorageFactory) -> None:
    limiter = RateLimiter(new_storage(), on_storage_error="fail_closed")
    items = [item("requests", "second", 3), item("requests", "day", 2), item("tokens", "hour", 50)]
    now = BASE_US / 1e6
    try:
        first = await limiter.check("q", items, requests=1, tokens=20, now=now)
        assert first.allowed and first.quota is not None
        # Requests: the day's 1 left binds before the second's 2.
        assert first.quota.requests is not None and first.quota.tokens is not None
        assert (first.quota.requests.remaining, first.quota.requests.window) == (1, "day")
        assert (first.quota.tokens.limit, first.quota.tokens.remaining) == (50, 30)
        await limiter.check("q", items, requests=1, tokens=20, now=now + 0.001)
        refused = await limiter.check("q", items, requests=1, tokens=20, now=now + 0.002)
        assert not refused.allowed and refused.violated == items[1]
        assert refused.quota is not None and refused.quota.requests is not None
        assert refused.quota.requests.remaining == 0 and refused.quota.tokens is not None
        assert refused.quota.tokens.remaining == 10  # the refusal counted nothing
        # No limits: no quota.
        assert (await limiter.check("q", [], requests=1, tokens=5, now=now)).quota is None
    finally:
        await limiter.close()


# ---- the promises, on random histories ----------------------------------------------------


@dataclass(frozen=True)
class Step:
    dt_us: int  # since the previous step (negative: the clock stepped back)
    tokens: int
    refund: int  # > 0: after this check, refund that many tokens of the last admission


@st.composite
def histories(draw: st.DrawFn) -> tuple[list[RateLimitItem], list[Step]]:
    windows = list(WINDOWS_S)
    units: list[Unit] = ["requests", "tokens"]
    pairs = draw(
        st.lists(
            st.tuples(st.sampled_from(units), st.sampled_from(windows)),
            min_size=1,
            max_size=3,
            unique=True,
        )
    )
    items = [
        item(u, w, draw(st.integers(0, 6) if u == "requests" else st.integers(0, 80)))
        for u, w in pairs
    ]
    scale = round(min(it.seconds for it in items) * 1e6)
    step = st.one_of(
        st.just(0),
        st.integers(0, scale // 8),
        st.integers(0, 2 * scale),
        st.sampled_from([scale // K, scale, scale + 1]),
        st.integers(-scale // 4, 0),  # a clock that stepped back
    )
    steps = draw(
        st.lists(
            st.builds(Step, step, st.integers(0, 30), st.sampled_from([0, 0, 0, 5, 40])),
            min_size=1,
            max_size=30,
        )
    )
    return items, steps


async def replay(
    storage: Storage, key: str, items: Sequence[RateLimitItem], steps: Sequence[Step]
) -> tuple[int, list[WindowState]]:
    """The history on ``storage``: the time after it, and the state then (read by a
    check that costs nothing)."""
    t = BASE_US
    tokens_items = [it for it in items if it.unit == "tokens"]
    for s in steps:
        t += s.dt_us
        costs = [1 if it.unit == "requests" else s.tokens for it in items]
        rejection, _ = await storage.acquire(key, items, costs, t)
        if rejection is None and s.refund and tokens_items:
            refund = -min(s.refund, s.tokens)
            await storage.adjust(key, tokens_items, [refund] * len(tokens_items), t, t)
    _, got = await storage.acquire(key, items, [0] * len(items), t)  # the state, uncounted
    return t, list(got)


async def check_promises(
    make: StorageFactory, items: Sequence[RateLimitItem], steps: Sequence[Step]
) -> list[WindowState]:
    prefix = f"promise{next(_keys)}"
    storage = make()
    try:
        now, state = await replay(storage, f"{prefix}:t", items, steps)
        for it, (left, reset) in zip(items, state, strict=True):
            assert 0 <= left <= it.amount and reset >= 0
            assert reset > 0 or left == it.amount  # an empty window has its whole limit
        # remaining is exact: each limit alone, at the same instant (a fresh replay each).
        for i, (it, (left, _)) in enumerate(zip(items, state, strict=True)):
            key = f"{prefix}:r{i}"
            await replay(storage, key, items, steps)
            over = [0] * len(items)
            over[i] = left + 1
            rejection, _ = await storage.acquire(key, items, over, now)
            assert rejection is not None and rejection.index == i, (it, left)
            exact = [0] * len(items)
            exact[i] = left
            rejection, after = await storage.acquire(key, items, exact, now)
            assert rejection is None and after[i][0] == 0
        # reset is exact: no traffic after, the window empties exactly reset later.
        key = f"{prefix}:z"
        await replay(storage, key, items, steps)
        probes = sorted({now + d for _, r in state for d in (r - 1, r, r + 1) if d > 0})
        for at in probes:
            _, later = await storage.acquire(key, items, [0] * len(items), at)
            for it, (left, reset), (left_at, reset_at) in zip(items, state, later, strict=True):
                assert reset_at == max(0, reset - (at - now)), (it, at - now)
                assert left_at >= left
                if reset_at == 0:
                    assert left_at == it.amount, (it, at - now)
        return state
    finally:
        await storage.close()


@settings(max_examples=300, deadline=None)
@given(histories())
def test_memory_state_keeps_its_promises(scenario: tuple[list[RateLimitItem], list[Step]]) -> None:
    items, steps = scenario
    asyncio.run(check_promises(MemoryStorage, items, steps))


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(histories())
def test_redis_state_keeps_its_promises_and_matches_memory(
    redis_url: str, scenario: tuple[list[RateLimitItem], list[Step]]
) -> None:
    items, steps = scenario
    on_redis = asyncio.run(
        check_promises(lambda: RedisStorage(redis_url, timeout_s=TIMEOUT_S), items, steps)
    )
    assert on_redis == asyncio.run(check_promises(MemoryStorage, items, steps))
