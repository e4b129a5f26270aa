"""Charge-back on Redis only: the hash stays consistent, keys expire, and a Redis that is
down or hung never makes ``adjust`` raise or wait past the timeout.

Failure tests use the production timeout (50 ms) on a Redis of their own, and time each
adjustment beside a control wait of one timeout started with it (``beside_a_wait``: a loaded
machine delays both alike): against a killed Redis they end, typically, before their
controls, against a hung one less than one more timeout after them, each after one round
trip (and, refused, one reconnect at once).
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Protocol

import pytest
from redis.asyncio import Redis

from fair_frontend.admission import RateLimiter, RateLimitItem, RedisStorage
from fair_frontend.admission.ratelimit import DEFAULT_OPEN_AFTER_S, StorageErrorMode
from fair_frontend.admission.storage import DEFAULT_BUCKETS, DEFAULT_TIMEOUT_S
from tests.admission.conftest import Timed, beside_a_wait, typical

T0 = 1_700_000_123.456789
TIMEOUT_S = DEFAULT_TIMEOUT_S
OPEN_AFTER_S = DEFAULT_OPEN_AFTER_S
TPM = RateLimitItem("tokens", "minute", 1000, 60.0)
RPM = RateLimitItem("requests", "minute", 3, 60.0)
WIDTH_US = 60_000_000 // DEFAULT_BUCKETS


class RedisServer(Protocol):
    url: str
    proc: subprocess.Popen[bytes] | None

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def wait_ready(self) -> None: ...


def bucket(at: float) -> bytes:
    return str(round(at * 1e6) // WIDTH_US).encode()


async def test_hash_keeps_its_running_sum_and_drops_emptied_buckets(
    redis_url: str, redis_client: Redis
) -> None:
    storage = RedisStorage(redis_url, timeout_s=5.0)
    rl = RateLimiter(storage, on_storage_error="fail_closed")
    name = storage.key_name("hash:e", TPM)
    client = redis_client
    try:
        assert (await rl.check("hash:e", [TPM], requests=1, tokens=300, now=T0)).allowed
        await rl.adjust("hash:e", [TPM], tokens=200, admitted_at=T0, now=T0 + 5)
        await rl.adjust("hash:e", [TPM], tokens=-100, admitted_at=T0, now=T0 + 6)
        assert await client.hgetall(name) == {
            bucket(T0): b"200",
            bucket(T0 + 5): b"200",
            b"t": b"400",
            b"o": bucket(T0),
            b"n": bucket(T0 + 5),
        }
        # A refund beyond the newest bucket empties it: the field goes, the sum follows,
        # and 'n' still names it.
        await rl.adjust("hash:e", [TPM], tokens=-999, admitted_at=T0 + 5, now=T0 + 6)
        fields = await client.hgetall(name)
        assert bucket(T0 + 5) not in fields
        assert fields[b"t"] == b"200" and fields[b"n"] == bucket(T0 + 5)
        # A clock stepped back counts into that (gone) newest bucket, from zero.
        assert (await rl.check("hash:e", [TPM], requests=1, tokens=500, now=T0 + 4)).allowed
        # The current bucket being that newest one, counting adds to it.
        assert (await rl.check("hash:e", [TPM], requests=1, tokens=300, now=T0 + 5)).allowed
        assert not (await rl.check("hash:e", [TPM], requests=1, tokens=1, now=T0 + 5)).allowed
        fields = await client.hgetall(name)
        assert fields[bucket(T0)] == b"200" and fields[bucket(T0 + 5)] == b"800"
        assert fields[b"t"] == b"1000"
    finally:
        await rl.close()


async def test_key_made_by_a_positive_adjustment_expires(
    redis_url: str, redis_client: Redis
) -> None:
    storage = RedisStorage(redis_url, timeout_s=5.0)
    rl = RateLimiter(storage, on_storage_error="fail_closed")
    try:
        await rl.adjust("ttl:e", [TPM], tokens=50, admitted_at=T0, now=T0)
        name = storage.key_name("ttl:e", TPM)
        ttl_ms = await redis_client.pttl(name)
        assert 0 < ttl_ms <= ((DEFAULT_BUCKETS + 1) * WIDTH_US / 1000) + 1000
        # A refund on a key that does not exist creates nothing.
        await rl.adjust("none:e", [TPM], tokens=-50, admitted_at=T0, now=T0)
        assert await redis_client.exists(storage.key_name("none:e", TPM)) == 0
    finally:
        await rl.close()


async def test_adjust_script_is_loaded_again_after_a_flush(
    redis_url: str, redis_client: Redis
) -> None:
    storage = RedisStorage(redis_url, timeout_s=5.0)
    rl = RateLimiter(storage, on_storage_error="fail_closed")
    try:
        assert (await rl.check("flush:a", [TPM], requests=1, tokens=1000, now=T0)).allowed
        await redis_client.script_flush()
        await rl.adjust("flush:a", [TPM], tokens=-400, admitted_at=T0, now=T0)
        assert rl.storage_errors == 0
        assert (await rl.check("flush:a", [TPM], requests=1, tokens=400, now=T0)).allowed
    finally:
        await rl.close()


async def timed_adjust(rl: RateLimiter, now: float) -> Timed[None]:
    """A refund (never raises), timed beside a control wait of one storage timeout."""
    return await beside_a_wait(
        rl.adjust("acme:gen", [TPM], tokens=-100, admitted_at=T0, now=now), TIMEOUT_S
    )


def trips(rl: RateLimiter) -> int:
    """Round trips the limiter's Redis storage has sent (a reconnect counts once more)."""
    assert isinstance(rl.storage, RedisStorage)
    return rl.storage.round_trips.round_trips


@pytest.mark.parametrize("mode", ["fail_open", "fail_closed"])
async def test_redis_killed_adjust_never_raises_and_counts_towards_the_circuit(
    redis_process: RedisServer, mode: StorageErrorMode
) -> None:
    server = redis_process
    rl = RateLimiter(
        RedisStorage(server.url, timeout_s=TIMEOUT_S),
        on_storage_error=mode,
    )
    try:
        assert (await rl.check("acme:gen", [TPM], requests=1, tokens=1000, now=T0)).allowed
        server.stop()
        # Each adjustment asks Redis and fails on its own: no skip after one failure.
        waits: list[Timed[None]] = []
        for n, now in enumerate([T0 + 1, T0 + 1.2, T0 + 1.5], start=1):
            sent = trips(rl)
            waits.append(await timed_adjust(rl, now))  # must not raise, even under fail_closed
            assert 1 <= trips(rl) - sent <= 2, trips(rl) - sent  # it asked; one reconnect
            assert rl.storage_errors == n
            assert not rl.circuit_open
        # Answered before a wait of one timeout, started with each, had ended: nothing
        # waited out, nor backed off.
        assert typical(waits) < 0, waits
        # Failing for open_after_s (1 s) opens the circuit, for admissions too.
        await timed_adjust(rl, T0 + 1 + OPEN_AFTER_S)
        assert rl.circuit_open and rl.storage_errors == 4
        if mode == "fail_open":
            d = await rl.check("acme:gen", [TPM], requests=1, tokens=1, now=T0 + 2.1)
            assert d.degraded and d.storage_error == "circuit_open"
        server.start()  # back, empty
        await timed_adjust(rl, T0 + 2.6)  # a probe is due: it answers, the circuit closes
        assert not rl.circuit_open
        errors = rl.storage_errors
        d = await rl.check("acme:gen", [TPM], requests=1, tokens=1, now=T0 + 2.7)
        assert d.allowed and not d.degraded
        assert rl.storage_errors == errors
    finally:
        await rl.close()


@pytest.mark.parametrize("mode", ["fail_open", "fail_closed"])
async def test_hung_redis_adjust_returns_within_the_timeout(
    redis_process: RedisServer, mode: StorageErrorMode
) -> None:
    server = redis_process
    assert server.proc is not None
    pid = server.proc.pid
    rl = RateLimiter(
        RedisStorage(server.url, timeout_s=TIMEOUT_S),
        on_storage_error=mode,
    )
    try:
        assert (await rl.check("acme:gen", [TPM], requests=1, tokens=1000, now=T0)).allowed
        os.kill(pid, signal.SIGSTOP)
        waits: list[Timed[None]] = []
        try:
            for now in (T0 + 1, T0 + 1.2, T0 + 2.5):  # two round trips; the third opens it
                sent = trips(rl)
                t = await timed_adjust(rl, now)
                waits.append(t)
                assert trips(rl) - sent == 1, trips(rl) - sent  # one round trip
                assert t.seconds >= 0.9 * TIMEOUT_S, t  # that really waited
            assert rl.storage_errors == 3
            # Each gave up after its own timeout: less than one more than a control wait.
            assert typical(waits) < TIMEOUT_S, waits
        finally:
            os.kill(pid, signal.SIGCONT)
        server.wait_ready()
        await timed_adjust(rl, T0 + 4)
        assert rl.storage_errors == 3
    finally:
        await rl.close()


async def test_unused_requests_limit_is_not_sent(redis_url: str, redis_client: Redis) -> None:
    """Only token keys appear in Redis after an adjustment on a fresh key."""
    storage = RedisStorage(redis_url, timeout_s=5.0)
    rl = RateLimiter(storage, on_storage_error="fail_closed")
    try:
        await rl.adjust("only:e", [RPM, TPM], tokens=10, admitted_at=T0, now=T0)
        assert await redis_client.exists(storage.key_name("only:e", RPM)) == 0
        assert await redis_client.exists(storage.key_name("only:e", TPM)) == 1
    finally:
        await rl.close()
