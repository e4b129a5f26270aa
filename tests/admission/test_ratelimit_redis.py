"""Redis only: replicas sharing one server, key layout, and Redis down, hung or restarted.

The failure tests use the production timeout (50 ms) on a Redis of their own, and bound
every check by timeout + 100 ms of wall time: a check never hangs a request.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from typing import Protocol

import pytest
from redis.crc import key_slot

from fair_frontend.admission import RateLimiter, RateLimitItem, RedisStorage
from fair_frontend.admission.storage import DEFAULT_BUCKETS, DEFAULT_TIMEOUT_S
from fair_frontend.config import WINDOWS_S
from fair_frontend.errors import Unavailable

T0 = 1_700_000_123.456789
TIMEOUT_S = DEFAULT_TIMEOUT_S  # 50 ms, the production default
BOUND_S = TIMEOUT_S + 0.1  # what any check may take, storage down or not
BACKOFF_S = 1.0
RPM = RateLimitItem("requests", "minute", 3, 60.0)


class RedisServer(Protocol):
    """What the tests use of conftest's ``RedisProcess``."""

    url: str
    proc: subprocess.Popen[bytes] | None

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def wait_ready(self) -> None: ...


def item(unit: str, window: str, amount: int) -> RateLimitItem:
    return RateLimitItem(unit, window, amount, WINDOWS_S[window])  # type: ignore[arg-type]


async def timed_check(rl: RateLimiter, now: float) -> tuple[float, object]:
    """(seconds taken, the Decision or the exception raised)."""
    start = time.perf_counter()
    try:
        result: object = await rl.check("acme:embed", [RPM], requests=1, tokens=0, now=now)
    except Unavailable as err:
        result = err
    return time.perf_counter() - start, result


# ---- shared by replicas ------------------------------------------------------------------


async def test_two_replicas_never_exceed_the_limit_together(redis_url: str) -> None:
    """Two limiters with their own Redis clients, checking concurrently, share one limit."""
    items = [item("requests", "minute", 100), item("tokens", "day", 10**9)]
    replicas = [
        RateLimiter(RedisStorage(redis_url, timeout_s=5.0), on_storage_error="fail_closed")
        for _ in range(2)
    ]
    try:
        decisions = await asyncio.gather(
            *(
                replicas[i % 2].check("shared:embed", items, requests=1, tokens=7, now=T0)
                for i in range(300)
            )
        )
        assert sum(d.allowed for d in decisions) == 100
        # Both replicas admitted some: the limit really was shared, not split.
        assert {i % 2 for i, d in enumerate(decisions) if d.allowed} == {0, 1}
    finally:
        for rl in replicas:
            await rl.close()


async def test_keys_share_a_cluster_slot_and_expire(redis_url: str) -> None:
    storage = RedisStorage(redis_url, timeout_s=5.0)
    rl = RateLimiter(storage, on_storage_error="fail_closed")
    items = [item("requests", "second", 5), item("tokens", "month", 100)]
    try:
        for key in ("acme:embed", "we{ir}d:m%o}del", "}:{"):
            names = [storage.key_name(key, it) for it in items]
            assert len(set(names)) == 2
            assert len({key_slot(n.encode()) for n in names}) == 1, names
            assert (await rl.check(key, items, requests=1, tokens=10, now=T0)).allowed
        # Escaping keeps distinct keys distinct.
        assert storage.key_name("a{b", items[0]) != storage.key_name("a%7Bb", items[0])

        client = storage._client
        for it in items:
            ttl_ms = await client.pttl(storage.key_name("acme:embed", it))
            width_s = it.seconds / DEFAULT_BUCKETS
            assert 0 < ttl_ms <= ((DEFAULT_BUCKETS + 1) * width_s + 1) * 1000
    finally:
        await rl.close()


async def test_script_is_loaded_again_after_a_flush(redis_url: str) -> None:
    storage = RedisStorage(redis_url, timeout_s=5.0)
    rl = RateLimiter(storage, on_storage_error="fail_closed")
    try:
        for _ in range(2):
            assert (await rl.check("flush:e", [RPM], requests=1, tokens=0, now=T0)).allowed
        await storage._client.script_flush()
        assert (await rl.check("flush:e", [RPM], requests=1, tokens=0, now=T0)).allowed
        assert not (await rl.check("flush:e", [RPM], requests=1, tokens=0, now=T0)).allowed
    finally:
        await rl.close()


async def test_running_sum_survives_far_jumps(redis_url: str) -> None:
    """The script's O(1) path keeps a running sum; stale buckets far back are still dropped."""
    storage = RedisStorage(redis_url, timeout_s=5.0)
    rl = RateLimiter(storage, on_storage_error="fail_closed")
    rpm = item("requests", "minute", 3)
    name = storage.key_name("jump:e", rpm)
    width_us = 60_000_000 // DEFAULT_BUCKETS
    now_bucket = round(T0 * 1e6) // width_us
    try:
        # A bound 'o' far older than the index range the script walks: it must scan.
        await storage._client.hset(
            name,
            mapping={"t": 3, "o": 0, "n": now_bucket, "0": 2, str(now_bucket): 1},
        )
        assert (await rl.check("jump:e", [rpm], requests=1, tokens=0, now=T0)).allowed
        assert (await rl.check("jump:e", [rpm], requests=1, tokens=0, now=T0)).allowed
        assert not (await rl.check("jump:e", [rpm], requests=1, tokens=0, now=T0)).allowed
        assert await storage._client.hget(name, "0") is None
        # Idle for a day: everything left the window, the key starts afresh.
        for _ in range(3):
            assert (await rl.check("jump:e", [rpm], requests=1, tokens=0, now=T0 + 86400)).allowed
        assert not (await rl.check("jump:e", [rpm], requests=1, tokens=0, now=T0 + 86400)).allowed
        assert int(await storage._client.hget(name, "t")) == 3
    finally:
        await rl.close()


# ---- Redis down, hung, back ----------------------------------------------------------------


@pytest.mark.parametrize("mode", ["fail_open", "fail_closed"])
async def test_redis_killed_then_restarted(redis_process: RedisServer, mode: str) -> None:
    server = redis_process
    rl = RateLimiter(
        RedisStorage(server.url, timeout_s=TIMEOUT_S),
        on_storage_error=mode,  # type: ignore[arg-type]
        backoff_s=BACKOFF_S,
    )
    try:
        took, d = await timed_check(rl, T0)
        assert getattr(d, "allowed", False) and not getattr(d, "degraded", True)

        server.stop()
        # The first check after the kill pays the round trip; the next ones, within the
        # back-off, take the mode at once.
        for n, now in enumerate([T0 + 1, T0 + 1, T0 + 1.5], start=1):
            took, d = await timed_check(rl, now)
            assert took < BOUND_S, took
            if mode == "fail_open":
                assert getattr(d, "allowed", False) and getattr(d, "degraded", False)
            else:
                assert isinstance(d, Unavailable) and d.http_status == 503
                assert "rate-limit storage unavailable" in d.message
                assert "127.0.0.1" not in d.message  # no internal address in a 503
                assert d.retry_after is not None and 0 < d.retry_after <= BACKOFF_S
            assert rl.storage_errors == n

        server.start()  # same port: Redis is back, empty
        # Still inside the back-off: the mode applies without trying.
        took, d = await timed_check(rl, T0 + 1.9)
        assert rl.storage_errors == 4
        # Back-off over: the limiter reconnects and counts again.
        for _ in range(3):
            took, d = await timed_check(rl, T0 + 2.1)
            assert getattr(d, "allowed", False) and not getattr(d, "degraded", True), d
        took, d = await timed_check(rl, T0 + 2.1)
        assert getattr(d, "allowed", True) is False and getattr(d, "violated", None) == RPM
        assert rl.storage_errors == 4
    finally:
        await rl.close()


@pytest.mark.parametrize("mode", ["fail_open", "fail_closed"])
async def test_hung_redis_times_out_then_recovers(redis_process: RedisServer, mode: str) -> None:
    """A Redis that stops answering (SIGSTOP): each check still returns within the bound."""
    server = redis_process
    assert server.proc is not None
    pid = server.proc.pid
    rl = RateLimiter(
        RedisStorage(server.url, timeout_s=TIMEOUT_S),
        on_storage_error=mode,  # type: ignore[arg-type]
        backoff_s=BACKOFF_S,
    )
    try:
        assert (await rl.check("acme:embed", [RPM], requests=1, tokens=0, now=T0)).allowed
        os.kill(pid, signal.SIGSTOP)
        try:
            for now in (T0 + 1, T0 + 1.2, T0 + 2.5):  # a round trip, back-off, a probe
                took, d = await timed_check(rl, now)
                assert took < BOUND_S, took
                if mode == "fail_open":
                    assert getattr(d, "degraded", False)
                else:
                    assert isinstance(d, Unavailable)
        finally:
            os.kill(pid, signal.SIGCONT)
        server.wait_ready()
        took, d = await timed_check(rl, T0 + 4)
        assert getattr(d, "allowed", False) and not getattr(d, "degraded", True), d
    finally:
        await rl.close()


class BlackHole:
    """A TCP listener that accepts connections and never answers a byte."""

    def __init__(self) -> None:
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        while await reader.read(4096):
            pass

    async def __aenter__(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"redis://127.0.0.1:{port}/0"

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        for w in self._writers:
            w.close()
        self._server.close()
        await self._server.wait_closed()


@pytest.fixture
async def black_hole() -> AsyncIterator[BlackHole]:
    yield BlackHole()


@pytest.mark.parametrize("mode", ["fail_open", "fail_closed"])
async def test_silent_server_times_out_and_only_one_check_probes(
    black_hole: BlackHole, mode: str
) -> None:
    async with black_hole as url:
        rl = RateLimiter(
            RedisStorage(url, timeout_s=TIMEOUT_S),
            on_storage_error=mode,  # type: ignore[arg-type]
            backoff_s=BACKOFF_S,
        )
        try:
            took, d = await timed_check(rl, T0)
            assert took < BOUND_S, took
            assert getattr(d, "degraded", False) or isinstance(d, Unavailable)
            assert black_hole.connections == 1
            # Back-off over: of 10 concurrent checks one probes, the others do not wait.
            start = time.perf_counter()
            results = await asyncio.gather(*(timed_check(rl, T0 + 1.5) for _ in range(10)))
            assert time.perf_counter() - start < BOUND_S
            assert all(took < BOUND_S for took, _ in results)
            assert black_hole.connections == 2
            assert rl.storage_errors == 11
        finally:
            await rl.close()
