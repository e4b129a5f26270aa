"""Charge-back (``RateLimiter.adjust``) on a fake clock, over every storage (memory, Redis).

Each test names the mistake it catches: a refund that does not free capacity, a positive
adjustment counted at admission instead of now, a bucket driven below zero, a refund that
lands in another bucket or after its bucket left, a ``requests`` item touched.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from fair_frontend.admission import MemoryStorage, RateLimiter, RateLimitItem, Storage
from fair_frontend.admission.limits import WINDOWS_S
from fair_frontend.admission.storage import DEFAULT_BUCKETS, Checked

K = DEFAULT_BUCKETS
T0 = 1_700_000_123.456789  # not on a bucket boundary of any window
US = 1e-6
TPM = RateLimitItem("tokens", "minute", 1000, 60.0)
RPM = RateLimitItem("requests", "minute", 2, 60.0)


def limiter(storage: Storage) -> RateLimiter:
    return RateLimiter(storage, on_storage_error="fail_closed")


def release_time(at: float, seconds: float) -> float:
    """When what was counted at ``at`` stops counting: (j + K + 1) * w."""
    width = round(seconds * 1e6) // K
    return ((round(at * 1e6) // width) + K + 1) * width / 1e6


async def fits(rl: RateLimiter, key: str, tokens: int, now: float) -> bool:
    return (await rl.check(key, [TPM], requests=1, tokens=tokens, now=now)).allowed


async def test_refund_frees_capacity_in_the_same_window(storage: Storage) -> None:
    rl = limiter(storage)
    assert await fits(rl, "k", 800, T0)
    assert not await fits(rl, "k", 300, T0 + 1)
    # The request produced 300 of the 800 counted: 500 come back at once.
    await rl.adjust("k", [TPM], tokens=-500, admitted_at=T0, now=T0 + 2)
    assert await fits(rl, "k", 300, T0 + 2)  # 300 + 300
    assert not await fits(rl, "k", 401, T0 + 2)  # exactly 500 came back, not more
    assert await fits(rl, "k", 400, T0 + 2)


async def test_positive_adjustment_counts_now_and_blocks_with_exact_retry_after(
    storage: Storage,
) -> None:
    rl = limiter(storage)
    assert await fits(rl, "k", 400, T0)
    produced_at = T0 + 10
    await rl.adjust("k", [TPM], tokens=500, admitted_at=T0, now=produced_at)
    now = T0 + 11
    # Without the adjustment 400 + 200 would fit; with it, 900 + 200 does not.
    d = await rl.check("k", [TPM], requests=1, tokens=200, now=now)
    assert not d.allowed and d.violated == TPM
    # 100 must leave: the admission's bucket (400) frees enough.
    assert d.retry_after == pytest.approx(release_time(T0, 60) - now, abs=2 * US)
    # 500 must leave: only once the adjustment's own bucket (at produced_at) has left.
    d = await rl.check("k", [TPM], requests=1, tokens=600, now=now)
    assert not d.allowed
    assert d.retry_after == pytest.approx(release_time(produced_at, 60) - now, abs=2 * US)
    assert release_time(produced_at, 60) > release_time(T0, 60)
    # When the admission has left, the 500 produced later still count (counted at now,
    # not in the admission's bucket): 500 fit, 501 do not.
    at = release_time(T0, 60)
    assert not await fits(rl, "k", 501, at)
    assert await fits(rl, "k", 500, at)


async def test_window_over_the_limit_delays_even_a_free_request(storage: Storage) -> None:
    """Adjustments may take the window over N: the admitted request stays admitted, the
    next ones wait until enough has left (here even one costing no token)."""
    rl = limiter(storage)
    assert await fits(rl, "k", 1000, T0)
    await rl.adjust("k", [TPM], tokens=300, admitted_at=T0, now=T0 + 1)
    d = await rl.check("k", [TPM], requests=1, tokens=0, now=T0 + 2)
    assert not d.allowed
    assert d.retry_after == pytest.approx(release_time(T0, 60) - (T0 + 2), abs=2 * US)
    # At that release 300 remain counted: 700 fit, 701 do not.
    at = release_time(T0, 60)
    assert not await fits(rl, "k", 701, at)
    assert await fits(rl, "k", 700, at)


async def test_refund_never_makes_a_bucket_negative(storage: Storage) -> None:
    rl = limiter(storage)
    assert await fits(rl, "k", 100, T0)
    assert await fits(rl, "k", 200, T0 + 5)  # another bucket (w = 1.2 s)
    # A refund larger than its bucket empties that bucket, no more: not -400 there, and
    # nothing taken from the other bucket.
    await rl.adjust("k", [TPM], tokens=-500, admitted_at=T0, now=T0 + 6)
    assert not await fits(rl, "k", 801, T0 + 6)
    assert await fits(rl, "k", 800, T0 + 6)
    # Emptied bucket: a second refund there takes nothing either.
    await rl.adjust("k", [TPM], tokens=-50, admitted_at=T0, now=T0 + 6)
    assert not await fits(rl, "k", 1, T0 + 6)


async def test_refund_comes_out_of_the_admission_bucket_only(storage: Storage) -> None:
    rl = limiter(storage)
    assert await fits(rl, "k", 300, T0)
    # A refund for a request admitted in a bucket that holds nothing changes nothing.
    await rl.adjust("k", [TPM], tokens=-300, admitted_at=T0 + 5, now=T0 + 6)
    assert not await fits(rl, "k", 701, T0 + 6)
    assert await fits(rl, "k", 700, T0 + 6)


async def test_refund_after_the_bucket_left_every_window_is_dropped(storage: Storage) -> None:
    rl = limiter(storage)
    assert await fits(rl, "k", 1000, T0)
    gone = release_time(T0, 60)
    assert await fits(rl, "k", 600, gone)
    # The admission no longer counts; taking 1000 off anything now would over-admit.
    await rl.adjust("k", [TPM], tokens=-1000, admitted_at=T0, now=gone)
    assert not await fits(rl, "k", 401, gone)
    assert await fits(rl, "k", 400, gone)


async def test_refund_just_before_the_bucket_leaves_still_applies(storage: Storage) -> None:
    rl = limiter(storage)
    assert await fits(rl, "k", 1000, T0)
    last = release_time(T0, 60) - 2 * US
    assert not await fits(rl, "k", 1, last)
    await rl.adjust("k", [TPM], tokens=-600, admitted_at=T0, now=last)
    assert not await fits(rl, "k", 601, last)
    assert await fits(rl, "k", 600, last)


async def test_requests_items_are_never_adjusted(storage: Storage) -> None:
    rl = limiter(storage)
    items = [RPM, TPM]
    assert (await rl.check("k", items, requests=1, tokens=500, now=T0)).allowed
    # A refund of tokens must not give the request slot back...
    await rl.adjust("k", items, tokens=-500, admitted_at=T0, now=T0 + 1)
    assert (await rl.check("k", items, requests=1, tokens=1000, now=T0 + 1)).allowed
    d = await rl.check("k", items, requests=1, tokens=0, now=T0 + 2)
    assert not d.allowed and d.violated == RPM
    # ... and a charge of tokens must not take one: a fresh key with requests only.
    await rl.adjust("r", [RPM], tokens=10**6, admitted_at=T0, now=T0)
    for _ in range(2):
        assert (await rl.check("r", [RPM], requests=1, tokens=0, now=T0)).allowed


async def test_positive_adjustment_with_a_clock_stepped_back_counts_later(
    storage: Storage,
) -> None:
    rl = limiter(storage)
    assert await fits(rl, "k", 500, T0)
    # A replica 30 s behind reports 500 more: counted in the newest bucket, never earlier.
    await rl.adjust("k", [TPM], tokens=500, admitted_at=T0 - 31, now=T0 - 30)
    assert not await fits(rl, "k", 1, release_time(T0 - 30, 60))
    assert await fits(rl, "k", 1000, release_time(T0, 60))


async def test_adjust_now(storage: Storage) -> None:
    rl = limiter(storage)
    assert await fits(rl, "k", 1000, T0)
    done = rl.adjust_now("k", [TPM], tokens=-1000, admitted_at=T0, now=T0 + 1)
    if isinstance(storage, MemoryStorage):
        assert done is True
        assert await fits(rl, "k", 1000, T0 + 1)
    else:
        assert done is False  # must be awaited: nothing was applied
        assert not await fits(rl, "k", 1, T0 + 1)
    # Nothing to do is done at once, on any storage.
    assert rl.adjust_now("k", [RPM], tokens=-5, admitted_at=T0, now=T0 + 1) is True
    assert rl.adjust_now("k", [TPM], tokens=0, admitted_at=T0, now=T0 + 1) is True


class CountingStorage:
    """Records the storage calls; answers like an empty memory storage."""

    def __init__(self) -> None:
        self.inner = MemoryStorage()
        self.adjusts: list[tuple[list[RateLimitItem], list[int]]] = []

    async def acquire(
        self, key: str, items: Sequence[RateLimitItem], costs: Sequence[int], now_us: int
    ) -> Checked:
        return await self.inner.acquire(key, items, costs, now_us)

    async def adjust(
        self,
        key: str,
        items: Sequence[RateLimitItem],
        deltas: Sequence[int],
        admitted_us: int,
        now_us: int,
    ) -> None:
        self.adjusts.append((list(items), list(deltas)))

    async def close(self) -> None:
        pass


async def test_no_token_limit_no_round_trip() -> None:
    storage = CountingStorage()
    rl = limiter(storage)
    await rl.adjust("k", [RPM], tokens=-5, admitted_at=T0, now=T0)
    await rl.adjust("k", [], tokens=5, admitted_at=T0, now=T0)
    await rl.adjust("k", [RPM, TPM], tokens=0, admitted_at=T0, now=T0)
    assert storage.adjusts == []
    tpd = RateLimitItem("tokens", "day", 10, WINDOWS_S["day"])
    await rl.adjust("k", [RPM, TPM, tpd], tokens=-5, admitted_at=T0, now=T0)
    assert storage.adjusts == [([TPM, tpd], [-5, -5])]  # one call, token items only
