"""Checks and charge-backs on random traffic: memory and Redis agree exactly.

One random sequence of checks and adjustments (positive, refunds within and beyond what
was counted, for admissions still counted or long gone; clocks that step back) runs on
both storages on one fake clock. After every operation:

- both gave the same decision (allowed, retry_after to the µs, binding limit);
- both hold the same live buckets (index -> amount) for every limit;
- no bucket is negative, and Redis's running sum ``t`` equals its buckets;
- right after an admission, what a limit counts is at most N (adjustments may take a
  window over N, but an admission never does).
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass

import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fair_frontend.admission import MemoryStorage, RateLimiter, RateLimitItem, RedisStorage
from fair_frontend.admission.limits import WINDOWS_S
from fair_frontend.admission.storage import DEFAULT_BUCKETS, bucket_width_us

K = DEFAULT_BUCKETS
BASE_US = 1_700_000_000_000_000


@dataclass(frozen=True)
class Check:
    dt_us: int
    tokens: int


@dataclass(frozen=True)
class Adjust:
    dt_us: int
    back: int  # which earlier check (counting back) this adjusts; its time is admitted_at
    tokens: int


Op = Check | Adjust


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[RateLimitItem], list[Op]]:
    windows = list(WINDOWS_S)
    items = []
    if draw(st.booleans()):
        w = draw(st.sampled_from(windows))
        items.append(RateLimitItem("requests", w, draw(st.integers(0, 6)), WINDOWS_S[w]))
    for w in draw(st.lists(st.sampled_from(windows), min_size=1, max_size=2, unique=True)):
        items.append(RateLimitItem("tokens", w, draw(st.integers(0, 100)), WINDOWS_S[w]))
    scale_us = round(min(it.seconds for it in items) * 1e6)
    step = st.one_of(
        st.just(0),
        st.integers(0, scale_us // 4),
        st.integers(0, 2 * scale_us),
        st.sampled_from([scale_us, scale_us + 1, scale_us - 1, scale_us // K]),
        st.integers(-scale_us // 2, 0),  # a clock stepping back
    )
    op = st.one_of(
        st.builds(Check, step, st.integers(0, 60)),
        st.builds(Adjust, step, st.integers(0, 8), st.integers(-80, 60)),
    )
    return items, draw(st.lists(op, min_size=1, max_size=50))


def live(buckets: dict[int, int], now_us: int, width: int) -> dict[int, int]:
    oldest = now_us // width - K
    return {b: a for b, a in buckets.items() if b >= oldest and a != 0}


async def compare(redis_url: str, key: str, items: list[RateLimitItem], ops: list[Op]) -> None:
    memory = MemoryStorage()
    redis = RedisStorage(redis_url, timeout_s=5.0)
    client = aioredis.Redis.from_url(redis_url)  # reads what the storage wrote
    limiters = [RateLimiter(s, on_storage_error="fail_closed") for s in (memory, redis)]
    checked: list[float] = [BASE_US / 1e6]
    t = BASE_US
    try:
        for op in ops:
            t += op.dt_us
            now = t / 1e6
            assert round(now * 1e6) == t
            if isinstance(op, Check):
                d_mem, d_red = [
                    await rl.check(key, items, requests=1, tokens=op.tokens, now=now)
                    for rl in limiters
                ]
                assert d_mem == d_red, (op, d_mem, d_red)
                checked.append(now)
            else:
                admitted_at = checked[max(0, len(checked) - 1 - op.back)]
                for rl in limiters:
                    await rl.adjust(key, items, tokens=op.tokens, admitted_at=admitted_at, now=now)
                assert rl.storage_errors == 0
                d_mem = None
            for it in items:
                width = bucket_width_us(it.seconds, K)
                window = memory._windows.get((key, it.unit, it.seconds))
                mem_all = {b: a for b, a in window.buckets} if window else {}
                fields = await client.hgetall(redis.key_name(key, it))
                red_all = {int(f): int(v) for f, v in fields.items() if f not in (b"t", b"o", b"n")}
                assert all(a >= 0 for a in mem_all.values()), mem_all
                assert all(a > 0 for a in red_all.values()), red_all
                if fields:
                    assert int(fields[b"t"]) == sum(red_all.values())
                mem_live, red_live = live(mem_all, t, width), live(red_all, t, width)
                assert mem_live == red_live, (it, op)
                if d_mem is not None and d_mem.allowed:
                    assert sum(mem_live.values()) <= it.amount, (it, mem_live)
    finally:
        for rl in limiters:
            await rl.close()
        await client.aclose()


_keys = itertools.count()


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(scenarios())
def test_memory_and_redis_agree_on_checks_and_adjustments(
    redis_url: str, scenario: tuple[list[RateLimitItem], list[Op]]
) -> None:
    items, ops = scenario
    asyncio.run(compare(redis_url, f"adj{next(_keys)}", items, ops))
