"""Rate limits on a fake clock, over every storage (each test runs on memory and on Redis)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from fair_frontend.admission import (
    MemoryStorage,
    RateLimiter,
    RateLimitItem,
    RedisStorage,
    Storage,
    items_from_limits,
    limit_key,
    rate_limited_error,
    storage_from_uri,
)
from fair_frontend.admission.limits import WINDOWS_S, Unit
from fair_frontend.admission.storage import DEFAULT_BUCKETS, Checked, StorageError
from fair_frontend.config import Limits, RateLimiting, parse_config
from fair_frontend.core.plan import rate_limiter
from fair_frontend.errors import RateLimited

K = DEFAULT_BUCKETS
# A realistic unix time, deliberately not on a bucket boundary of any window.
T0 = 1_700_000_123.456789
US = 1e-6


def item(unit: Unit, window: str, amount: int) -> RateLimitItem:
    return RateLimitItem(unit, window, amount, WINDOWS_S[window])


def limiter(storage: Storage) -> RateLimiter:
    # fail_closed: a storage error in a functional test raises instead of silently admitting.
    return RateLimiter(storage, on_storage_error="fail_closed")


def release_time(admitted_at: float, seconds: float) -> float:
    """When an admission stops counting, per the documented rule: (j + K + 1) * w."""
    width = round(seconds * 1e6) // K
    return ((round(admitted_at * 1e6) // width) + K + 1) * width / 1e6


@pytest.mark.parametrize("window", list(WINDOWS_S))
@pytest.mark.parametrize("unit", ["requests", "tokens"])
async def test_nth_passes_next_fails_and_capacity_returns_on_time(
    storage: Storage, unit: Unit, window: str
) -> None:
    seconds = WINDOWS_S[window]
    rl = limiter(storage)
    if unit == "requests":
        limit, costs = 5, [1, 1, 1, 1, 1]
    else:
        limit, costs = 1000, [300, 300, 399, 1]
    items = [item(unit, window, limit)]

    def cost(n: int) -> dict[str, int]:
        return {"requests": 1, "tokens": n} if unit == "tokens" else {"requests": n, "tokens": 0}

    # Spread the N admissions over the first half of the window.
    times = [T0 + seconds * i / (2 * len(costs)) for i in range(len(costs))]
    for t, c in zip(times, costs, strict=True):
        d = await rl.check("acme:embed", items, **cost(c), now=t)
        assert d.allowed, (t, c)
    now = T0 + seconds / 2
    d = await rl.check("acme:embed", items, **cost(1), now=now)
    assert not d.allowed
    assert d.violated == items[0]
    assert d.retry_after is not None
    # The first admission must leave: strictly after T, at most one bucket (T/K) late.
    expected = release_time(T0, seconds)
    assert T0 + seconds < expected <= T0 + seconds + seconds / K
    assert d.retry_after == pytest.approx(expected - now, abs=2 * US)
    # Not before: at exactly T after the first admission, and 1 µs before the release.
    assert not (await rl.check("acme:embed", items, **cost(1), now=T0 + seconds)).allowed
    retry_at = now + d.retry_after
    assert not (await rl.check("acme:embed", items, **cost(1), now=retry_at - 2 * US)).allowed
    # Then: exactly what the first admission held comes back, no more.
    assert (await rl.check("acme:embed", items, **cost(costs[0]), now=retry_at)).allowed
    assert not (await rl.check("acme:embed", items, **cost(1), now=retry_at)).allowed


async def test_rejected_request_counts_against_no_limit(storage: Storage) -> None:
    rl = limiter(storage)
    rps, tpm = item("requests", "second", 10), item("tokens", "minute", 100)
    items = [rps, tpm]
    assert (await rl.check("k", items, requests=1, tokens=90, now=T0)).allowed
    # Rejected by tokens: must not use up a request slot...
    for _ in range(5):
        d = await rl.check("k", items, requests=1, tokens=20, now=T0)
        assert not d.allowed and d.violated == tpm
    for _ in range(9):  # ... so 9 more requests fit the 10/s limit
        assert (await rl.check("k", items, requests=1, tokens=1, now=T0)).allowed
    # Rejected by requests: must not use up tokens (1 token left).
    for _ in range(5):
        d = await rl.check("k", items, requests=1, tokens=1, now=T0 + 0.1)
        assert not d.allowed and d.violated == rps
    assert (await rl.check("k", items, requests=1, tokens=1, now=T0 + 1.1)).allowed
    assert not (await rl.check("k", items, requests=1, tokens=1, now=T0 + 1.1)).allowed


async def test_binding_limit_is_the_longest_wait(storage: Storage) -> None:
    rl = limiter(storage)
    rps, tpd = item("requests", "second", 1), item("tokens", "day", 10)
    assert (await rl.check("k", [rps, tpd], requests=1, tokens=10, now=T0)).allowed
    d = await rl.check("k", [rps, tpd], requests=1, tokens=1, now=T0)
    assert d.violated == tpd
    assert d.retry_after is not None and d.retry_after > 86400 - 1


@pytest.mark.parametrize("unit", ["requests", "tokens"])
async def test_concurrent_burst_admits_exactly_n(storage: Storage, unit: Unit) -> None:
    rl = limiter(storage)
    n, m = 37, 200
    items = [item(unit, "minute", n * 10 if unit == "tokens" else n)]
    decisions = await asyncio.gather(
        *(rl.check("burst", items, requests=1, tokens=10, now=T0) for _ in range(m))
    )
    assert sum(d.allowed for d in decisions) == n
    assert all(d.violated == items[0] for d in decisions if not d.allowed)


async def test_cost_above_the_limit_never_fits(storage: Storage) -> None:
    rl = limiter(storage)
    rps, tpm = item("requests", "second", 1), item("tokens", "minute", 1000)
    assert (await rl.check("k", [rps, tpm], requests=1, tokens=1, now=T0)).allowed
    # rps has a finite wait, tpm can never fit: the one that never fits binds.
    d = await rl.check("k", [rps, tpm], requests=1, tokens=1001, now=T0)
    assert not d.allowed and d.violated == tpm and d.retry_after is None
    # Even on an empty window, and the rejection counted nothing.
    d = await rl.check("fresh", [tpm], requests=1, tokens=1001, now=T0)
    assert not d.allowed and d.retry_after is None
    assert (await rl.check("fresh", [tpm], requests=1, tokens=1000, now=T0)).allowed


async def test_zero_limit_and_zero_cost(storage: Storage) -> None:
    rl = limiter(storage)
    blocked = item("requests", "day", 0)
    d = await rl.check("k", [blocked], requests=1, tokens=0, now=T0)
    assert not d.allowed and d.retry_after is None
    tpm = item("tokens", "minute", 5)
    assert (await rl.check("k", [tpm], requests=1, tokens=5, now=T0)).allowed
    # A request with no tokens fits a full token window.
    assert (await rl.check("k", [tpm], requests=1, tokens=0, now=T0)).allowed
    assert not (await rl.check("k", [tpm], requests=1, tokens=1, now=T0)).allowed


async def test_keys_are_independent(storage: Storage) -> None:
    rl = limiter(storage)
    rps = [item("requests", "second", 2)]
    for _ in range(2):
        assert (
            await rl.check(limit_key("acme", "embed"), rps, requests=1, tokens=0, now=T0)
        ).allowed
    assert not (
        await rl.check(limit_key("acme", "embed"), rps, requests=1, tokens=0, now=T0)
    ).allowed
    assert (
        await rl.check(limit_key("acme", "generate"), rps, requests=1, tokens=0, now=T0)
    ).allowed
    assert (await rl.check(limit_key("globex", "embed"), rps, requests=1, tokens=0, now=T0)).allowed


async def test_same_window_different_units_are_separate(storage: Storage) -> None:
    rl = limiter(storage)
    items = [item("requests", "minute", 2), item("tokens", "minute", 1000)]
    assert (await rl.check("k", items, requests=1, tokens=500, now=T0)).allowed
    assert (await rl.check("k", items, requests=1, tokens=500, now=T0)).allowed
    d = await rl.check("k", items, requests=1, tokens=0, now=T0)
    assert d.violated == items[0]


async def test_clock_stepping_back_releases_nothing_early(storage: Storage) -> None:
    rl = limiter(storage)
    rpm = [item("requests", "minute", 2)]
    assert (await rl.check("k", rpm, requests=1, tokens=0, now=T0)).allowed
    # A replica whose clock is 30 s behind: still sees the first admission.
    assert (await rl.check("k", rpm, requests=1, tokens=0, now=T0 - 30)).allowed
    assert not (await rl.check("k", rpm, requests=1, tokens=0, now=T0 - 30)).allowed
    # The late clock's admission counts in the newest bucket: both leave together, late.
    assert not (await rl.check("k", rpm, requests=1, tokens=0, now=T0 + 60)).allowed
    release = release_time(T0, 60)
    d = await rl.check("k", rpm, requests=2, tokens=0, now=release)
    assert d.allowed


async def test_no_limits_no_storage(storage: Storage) -> None:
    rl = limiter(storage)
    assert (await rl.check("k", [], requests=10**9, tokens=10**9, now=T0)).allowed


async def test_negative_cost_is_refused(storage: Storage) -> None:
    rl = limiter(storage)
    with pytest.raises(ValueError):
        await rl.check("k", [item("tokens", "minute", 5)], requests=1, tokens=-1, now=T0)


# ---- independent of the storage ----------------------------------------------------------


def test_items_from_limits_follow_the_config_override() -> None:
    cfg = parse_config(
        {
            "tiers": ["standard"],
            "tier_limits": {
                "standard": {"generate": {"requests_per_second": 10, "tokens_per_month": 1000}}
            },
            "tenants": {
                "acme": {"tier": "standard", "limits": {"generate": {"tokens_per_month": 50}}}
            },
        }
    )
    items = items_from_limits(cfg.limits_for("acme", "generate"))
    assert items == [
        RateLimitItem("requests", "second", 10, 1.0),
        RateLimitItem("tokens", "month", 50, 30 * 86400.0),
    ]
    assert items_from_limits(Limits()) == []


def test_rate_limited_error_names_limit_and_window() -> None:
    tpm = item("tokens", "minute", 1000)
    from fair_frontend.admission import Decision

    err = rate_limited_error(
        Decision(False, retry_after=12.3, violated=tpm), tenant="acme", endpoint="embed"
    )
    assert isinstance(err, RateLimited)
    assert err.http_status == 429
    assert "limit: 1000 tokens per minute" in err.message
    assert "'acme'" in err.message and "'embed'" in err.message
    assert "{" not in err.message and "rl:" not in err.message  # never a storage key
    assert err.retry_after == 12.3 and err.retry_after_header == "13"

    never = rate_limited_error(
        Decision(False, retry_after=None, violated=item("requests", "month", 1)),
        tenant="acme",
        endpoint="embed",
    )
    assert "never" in never.message and "1 request per month (30 days)" in never.message
    assert never.retry_after is None and never.retry_after_header is None

    with pytest.raises(ValueError):
        rate_limited_error(Decision(True), tenant="acme", endpoint="embed")


async def test_storage_from_uri_and_config() -> None:
    assert isinstance(storage_from_uri("memory://"), MemoryStorage)
    redis_storage = storage_from_uri("redis://127.0.0.1:1/0", timeout_s=0.01)
    assert isinstance(redis_storage, RedisStorage) and redis_storage.timeout_s == 0.01
    await redis_storage.close()
    with pytest.raises(ValueError, match="memory:// or redis://"):
        storage_from_uri("memcached://localhost:11211")
    rl = rate_limiter(
        RateLimiting(storage="redis://127.0.0.1:1", on_storage_error="fail_closed", timeout_ms=20)
    )
    assert isinstance(rl.storage, RedisStorage) and rl.storage.timeout_s == 0.02
    assert rl.on_storage_error == "fail_closed"
    await rl.close()
    assert isinstance(rate_limiter(RateLimiting()).storage, MemoryStorage)


async def test_memory_storage_drops_idle_windows() -> None:
    storage = MemoryStorage()
    rl = limiter(storage)
    for tenant in range(100):
        await rl.check(
            f"t{tenant}:e", [item("requests", "second", 5)], requests=1, tokens=0, now=T0
        )
    assert len(storage) == 100
    # A minute later every one-second window is empty: the sweep forgets them.
    await rl.check("other:e", [item("requests", "second", 5)], requests=1, tokens=0, now=T0 + 61)
    assert len(storage) == 1


class ScriptedStorage(MemoryStorage):
    """A memory storage the test can take down: while ``down``, every call yields to the
    loop once (a round trip in flight) and fails with ``StorageError(reason)``. The
    limiter's failure policy on a fake clock, without a Redis to break (the Redis tests
    break a real one: ``test_ratelimit_redis``, ``test_ratelimit_under_load``)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.asked = 0

    async def acquire(
        self, key: str, items: Sequence[RateLimitItem], costs: Sequence[int], now_us: int
    ) -> Checked:
        self.asked += 1
        await asyncio.sleep(0)
        if self.down:
            raise StorageError("scripted outage", reason="timeout")
        return await super().acquire(key, items, costs, now_us)


async def test_circuit_opens_only_on_sustained_failure_and_closes_on_the_first_answer() -> None:
    storage = ScriptedStorage()
    rl = RateLimiter(storage, on_storage_error="fail_open", open_after_s=1.0, probe_s=0.25)
    rpm = [item("requests", "minute", 1000)]

    async def check(at: float) -> str:
        d = await rl.check("c:e", rpm, requests=1, tokens=0, now=T0 + at)
        return d.storage_error or "ok"

    storage.down = True
    assert [await check(0.0), await check(0.5)] == ["timeout", "timeout"]
    storage.down = False
    assert await check(0.9) == "ok"  # an answer: the failures before it are forgotten
    storage.down = True
    assert [await check(t) for t in (1.0, 1.5, 1.99)] == ["timeout"] * 3
    assert not rl.circuit_open and storage.asked == 6  # each one asked
    assert await check(2.0) == "timeout"  # 1 s of nothing but failures: open
    assert rl.circuit_open and storage.asked == 7
    assert await check(2.1) == "circuit_open" and storage.asked == 7  # not asked
    assert await check(2.25) == "timeout" and storage.asked == 8  # the probe, failed
    # Two at once when the next probe is due: one probes, the other does not wait for it.
    both = await asyncio.gather(check(2.5), check(2.5))
    assert sorted(both) == ["circuit_open", "timeout"] and storage.asked == 9
    storage.down = False
    assert await check(2.6) == "circuit_open"  # no probe due yet
    assert await check(2.75) == "ok" and not rl.circuit_open  # the probe answers: closed
    assert [await check(2.76), await check(2.77)] == ["ok", "ok"] and storage.asked == 12
    assert rl.storage_errors == 11  # every check that took the mode, asked or not
