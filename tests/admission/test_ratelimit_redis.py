"""Redis only: replicas sharing one server, key layout, and Redis down, hung or restarted.

The failure tests use the production timeout (50 ms) on a Redis of their own. A check never
hangs a request: each is timed beside a control wait of one timeout started with it
(``beside_a_wait``: a loaded machine delays both alike), and the checks of a test must end,
typically, less than one more timeout after their controls (a hung Redis: each waited out
its own timeout once, not a retry's, not the backstop's), or before them (a refused
connection is not waited out); and the round trips each made are counted (one; a refused
one: and one reconnect at once).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import AsyncIterator
from typing import Any, Protocol

import pytest
from redis.asyncio import Redis
from redis.crc import key_slot

from fair_frontend.admission import RateLimiter, RateLimitItem, RedisStorage
from fair_frontend.admission.limits import WINDOWS_S, Unit
from fair_frontend.admission.ratelimit import (
    DEFAULT_OPEN_AFTER_S,
    DEFAULT_PROBE_S,
    StorageErrorMode,
    StorageUnavailable,
)
from fair_frontend.admission.storage import DEFAULT_BUCKETS, DEFAULT_TIMEOUT_S
from fair_frontend.errors import Unavailable
from tests.admission.conftest import Timed, beside_a_wait, clocked, typical

T0 = 1_700_000_123.456789
TIMEOUT_S = DEFAULT_TIMEOUT_S  # 50 ms, the production default
OPEN_AFTER_S = DEFAULT_OPEN_AFTER_S
PROBE_S = DEFAULT_PROBE_S
RPM = RateLimitItem("requests", "minute", 3, 60.0)


class RedisServer(Protocol):
    """What the tests use of conftest's ``RedisProcess``."""

    url: str
    proc: subprocess.Popen[bytes] | None

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def wait_ready(self) -> None: ...


def item(unit: Unit, window: str, amount: int) -> RateLimitItem:
    return RateLimitItem(unit, window, amount, WINDOWS_S[window])


async def check(rl: RateLimiter, now: float) -> object:
    """A check of ``acme:embed``: its Decision, or the Unavailable it raised."""
    try:
        return await rl.check("acme:embed", [RPM], requests=1, tokens=0, now=now)
    except Unavailable as err:
        return err


async def timed_check(rl: RateLimiter, now: float) -> Timed[object]:
    """``check``, timed beside a control wait of one storage timeout."""
    return await beside_a_wait(check(rl, now), TIMEOUT_S)


def trips(storage: RedisStorage) -> int:
    """Round trips the storage has sent (a reconnect counts once more)."""
    return storage.round_trips.round_trips


# ---- shared by replicas ------------------------------------------------------------------


async def test_two_replicas_never_exceed_the_limit_together(redis_url: str) -> None:
    """Two limiters with their own Redis clients, checking concurrently, share one limit."""
    items = [item("requests", "minute", 100), item("tokens", "day", 10**9)]
    replicas = [
        RateLimiter(RedisStorage(redis_url, timeout_s=5.0), on_storage_error="fail_closed")
        for _ in range(2)
    ]
    try:
        # 15 waves of 20 concurrent checks, 10 from each replica (each replica's 10 share a
        # round trip; the two replicas' round trips race): 5 waves fill the limit.
        decisions = []
        for _ in range(15):
            decisions += await asyncio.gather(
                *(
                    replicas[i % 2].check("shared:embed", items, requests=1, tokens=7, now=T0)
                    for i in range(20)
                )
            )
        assert sum(d.allowed for d in decisions) == 100
        # Both replicas admitted some: the limit really was shared, not split.
        assert {i % 2 for i, d in enumerate(decisions) if d.allowed} == {0, 1}
    finally:
        for rl in replicas:
            await rl.close()


async def test_keys_share_a_cluster_slot_and_expire(redis_url: str, redis_client: Redis) -> None:
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

        client = redis_client
        for it in items:
            ttl_ms = await client.pttl(storage.key_name("acme:embed", it))
            width_s = it.seconds / DEFAULT_BUCKETS
            assert 0 < ttl_ms <= ((DEFAULT_BUCKETS + 1) * width_s + 1) * 1000
    finally:
        await rl.close()


async def test_script_is_loaded_again_after_a_flush(redis_url: str, redis_client: Redis) -> None:
    storage = RedisStorage(redis_url, timeout_s=5.0)
    rl = RateLimiter(storage, on_storage_error="fail_closed")
    try:
        for _ in range(2):
            assert (await rl.check("flush:e", [RPM], requests=1, tokens=0, now=T0)).allowed
        await redis_client.script_flush()
        assert (await rl.check("flush:e", [RPM], requests=1, tokens=0, now=T0)).allowed
        assert not (await rl.check("flush:e", [RPM], requests=1, tokens=0, now=T0)).allowed
    finally:
        await rl.close()


async def test_running_sum_survives_far_jumps(redis_url: str, redis_client: Redis) -> None:
    """The script's O(1) path keeps a running sum; stale buckets far back are still dropped."""
    storage = RedisStorage(redis_url, timeout_s=5.0)
    rl = RateLimiter(storage, on_storage_error="fail_closed")
    rpm = item("requests", "minute", 3)
    name = storage.key_name("jump:e", rpm)
    width_us = 60_000_000 // DEFAULT_BUCKETS
    now_bucket = round(T0 * 1e6) // width_us
    try:
        # A bound 'o' far older than the index range the script walks: it must scan.
        await redis_client.hset(
            name,
            mapping={"t": 3, "o": 0, "n": now_bucket, "0": 2, str(now_bucket): 1},
        )
        assert (await rl.check("jump:e", [rpm], requests=1, tokens=0, now=T0)).allowed
        assert (await rl.check("jump:e", [rpm], requests=1, tokens=0, now=T0)).allowed
        assert not (await rl.check("jump:e", [rpm], requests=1, tokens=0, now=T0)).allowed
        assert await redis_client.hget(name, "0") is None
        # Idle for a day: everything left the window, the key starts afresh.
        for _ in range(3):
            assert (await rl.check("jump:e", [rpm], requests=1, tokens=0, now=T0 + 86400)).allowed
        assert not (await rl.check("jump:e", [rpm], requests=1, tokens=0, now=T0 + 86400)).allowed
        t = await redis_client.hget(name, "t")
        assert t is not None
        assert int(t) == 3
    finally:
        await rl.close()


# ---- Redis down, hung, back ----------------------------------------------------------------


def reason_of(d: object) -> str | None:
    """The reason a check took the mode: from a Decision or a StorageUnavailable."""
    if isinstance(d, StorageUnavailable):
        return d.reason
    return getattr(d, "storage_error", None)


@pytest.mark.parametrize("mode", ["fail_open", "fail_closed"])
async def test_redis_killed_then_restarted(
    redis_process: RedisServer, mode: StorageErrorMode
) -> None:
    server = redis_process
    storage = RedisStorage(server.url, timeout_s=TIMEOUT_S)
    rl = RateLimiter(storage, on_storage_error=mode)
    try:
        d = await check(rl, T0)
        assert getattr(d, "allowed", False) and not getattr(d, "degraded", True)

        server.stop()
        # Each check asks Redis and takes the mode on its own (no skip after one failure)
        # until Redis has answered nothing for open_after_s; then the circuit opens.
        waits: list[Timed[object]] = []
        for n, now in enumerate([T0 + 1, T0 + 1, T0 + 1.5, T0 + 1 + OPEN_AFTER_S], start=1):
            sent = trips(storage)
            t = await timed_check(rl, now)
            waits.append(t)
            d = t.result
            # It asked: one round trip, and one reconnect at once (Redis closed the
            # connection), no more.
            assert 1 <= trips(storage) - sent <= 2, trips(storage) - sent
            assert reason_of(d) == "error", d
            if mode == "fail_open":
                assert getattr(d, "allowed", False) and getattr(d, "degraded", False)
            else:
                assert isinstance(d, Unavailable) and d.http_status == 503
                assert "rate-limit storage unavailable" in d.message
                assert "127.0.0.1" not in d.message  # no internal address in a 503
                assert d.retry_after == (PROBE_S if rl.circuit_open else None)
            assert rl.storage_errors == n
            assert rl.circuit_open == (n == 4)
        # Each was answered before a wait of one timeout, started with it, had ended: a
        # refused connection is neither waited out nor backed off.
        assert typical(waits) < 0, waits

        # Open: the mode at once, without asking, until a probe is due.
        sent = trips(storage)
        d = await check(rl, T0 + 2.1)
        assert reason_of(d) == "circuit_open" and rl.storage_errors == 5
        if mode == "fail_closed":
            assert isinstance(d, Unavailable) and d.retry_after == pytest.approx(0.15)
        server.start()  # same port: Redis is back, empty
        d = await check(rl, T0 + 2.0 + PROBE_S / 2)  # no probe due yet
        assert reason_of(d) == "circuit_open" and rl.storage_errors == 6
        assert trips(storage) == sent  # neither asked
        # A probe is due: it reconnects, Redis answers, the circuit closes, limits count.
        for _ in range(3):
            d = await check(rl, T0 + 2.0 + PROBE_S)
            assert getattr(d, "allowed", False) and not getattr(d, "degraded", True), d
        assert not rl.circuit_open
        d = await check(rl, T0 + 2.0 + PROBE_S)
        assert getattr(d, "allowed", True) is False and getattr(d, "violated", None) == RPM
        assert rl.storage_errors == 6
    finally:
        await rl.close()


@pytest.mark.parametrize("mode", ["fail_open", "fail_closed"])
async def test_hung_redis_times_out_then_recovers(
    redis_process: RedisServer, mode: StorageErrorMode
) -> None:
    """A Redis that stops answering (SIGSTOP): each check still returns within the bound."""
    server = redis_process
    assert server.proc is not None
    pid = server.proc.pid
    storage = RedisStorage(server.url, timeout_s=TIMEOUT_S)
    rl = RateLimiter(storage, on_storage_error=mode)
    try:
        assert (await rl.check("acme:embed", [RPM], requests=1, tokens=0, now=T0)).allowed
        os.kill(pid, signal.SIGSTOP)
        waits: list[Timed[object]] = []
        try:
            for now in (T0 + 1, T0 + 1.2, T0 + 2.5):  # each asks; the third opens it
                sent = trips(storage)
                t = await timed_check(rl, now)
                waits.append(t)
                d = t.result
                # It asked once, and really waited for Redis.
                assert trips(storage) - sent == 1, trips(storage) - sent
                assert t.seconds >= 0.9 * TIMEOUT_S, t
                assert reason_of(d) == "timeout", d
                if mode == "fail_open":
                    assert getattr(d, "degraded", False)
                else:
                    assert isinstance(d, Unavailable)
        finally:
            os.kill(pid, signal.SIGCONT)
        # Each gave up after its own timeout: less than one more after a control wait of one.
        assert typical(waits) < TIMEOUT_S, waits
        server.wait_ready()
        d = await check(rl, T0 + 4)
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
async def test_silent_server_fails_each_round_trip_then_one_probe_at_a_time(
    black_hole: BlackHole, mode: StorageErrorMode
) -> None:
    """A server that never answers: concurrent checks share one round trip (one connection:
    the timeout drops it), each takes the mode after that one timeout; once it has answered
    nothing for open_after_s the circuit opens and one check per probe_s asks."""
    async with black_hole as url:
        storage = RedisStorage(url, timeout_s=TIMEOUT_S)
        rl = RateLimiter(storage, on_storage_error=mode)

        waits: list[Timed[Any]] = []

        async def burst(now: float) -> list[object]:
            sent = trips(storage)
            t = await beside_a_wait(asyncio.gather(*(check(rl, now) for _ in range(10))), TIMEOUT_S)
            waits.append(t)
            assert trips(storage) - sent <= 1  # the ten share one round trip, or none asks
            return list(t.result)

        try:
            t = await timed_check(rl, T0)
            waits.append(t)
            assert t.seconds >= 0.9 * TIMEOUT_S and reason_of(t.result) == "timeout"  # waited
            assert black_hole.connections == 1
            # Each asks again (no skip after a failure): ten checks, one round trip.
            results = await burst(T0 + 0.5)
            assert [reason_of(d) for d in results] == ["timeout"] * 10
            assert black_hole.connections == 2 and rl.storage_errors == 11
            assert not rl.circuit_open
            # 1.5 s of failures: this round trip opens the circuit.
            await burst(T0 + 1.5)
            assert black_hole.connections == 3 and rl.circuit_open
            # Open, no probe due: nobody asks.
            results = await burst(T0 + 1.5 + PROBE_S / 2)
            assert [reason_of(d) for d in results] == ["circuit_open"] * 10
            assert black_hole.connections == 3
            # A probe is due: one of the ten asks (and times out), the others do not wait.
            results = await burst(T0 + 1.5 + PROBE_S)
            reasons = sorted(str(reason_of(d)) for d in results)
            assert reasons == ["circuit_open"] * 9 + ["timeout"]
            assert black_hole.connections == 4 and rl.storage_errors == 41
            # Together, each round trip's checks waited one timeout at most (one round trip
            # between them, not one after another): less than one more than a control wait.
            assert typical(waits) < TIMEOUT_S, waits
        finally:
            await rl.close()


async def test_a_call_the_thread_never_answers_is_answered_by_the_backstop(
    black_hole: BlackHole,
) -> None:
    """The round-trip thread stuck past the backstop (here: a 1 s socket timeout on a
    server that never answers, and the backstop shortened to 0.2 s: a stand-in for a
    DNS lookup that hangs, which no local server can produce): the loop answers each
    call itself, a StorageError the limiter turns into the mode, and the thread's late
    answer changes nothing."""
    async with black_hole as url:
        storage = RedisStorage(url, timeout_s=1.0)
        storage.round_trips.backstop_s = 0.2
        rl = RateLimiter(storage, on_storage_error="fail_closed")
        try:
            t = await beside_a_wait(
                asyncio.gather(*(clocked(check(rl, T0)) for _ in range(3))), 0.2
            )
            for d, took in t.result:
                assert took > 0.15, took  # the backstop is a loop timer: never early
                assert reason_of(d) == "timeout"
            # The backstop answered, not the 1 s socket timeout: the three ended nearer a
            # control wait of the backstop's 0.2 s, started with them, than 0.8 s after it.
            assert t.beyond < (1.0 - 0.2) / 2, t
            assert rl.storage_errors == 3
        finally:
            await rl.close()  # waits for the thread's own timeout: nothing left behind
