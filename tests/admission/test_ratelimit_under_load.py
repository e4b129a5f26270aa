"""Limits that hold under load: the storage timeout measures Redis, and one failure decides
for one check only.

Each test runs the limiter with a timeout of 200 ms on a real ``redis-server`` of its own,
and the same test over ``memory://`` where it applies (a storage that never waits cannot
fail, but must give the same exact count). Four times the production default: what is
tested holds for any timeout (it is measured on the round trip's socket), but a healthy
Redis must answer within it whatever the load, and beside CPU hogs on these two cores one
was seen to leave a round trip unanswered for more than 50 ms (half the busy-loop runs
failed a check then).

- A busy event loop (the core stalled 600 ms at a time, three timeouts, by a CPU hog on its
  own loop, each time it finds checks in flight, of 300 at once) and a healthy Redis: a
  burst admits exactly the limit, and no check fails open. Before, the deadline ran on
  that loop, and counted the wait for one of 64 pooled connections: checks timed out with
  Redis idle, each admitted uncounted, and the first one switched checks off for every
  tenant for 1 s.
- Concurrent checks share round trips on one connection (no pool to wait for).
- One slow reply (Redis stopped, SIGSTOP, until the checks it holds have given up; then
  continued): the checks it delayed take the mode, each counted with its reason; the checks
  after it, another tenant's burst, are exact. Before, that one timeout made every check of
  every tenant take the mode for 1 s.

Redis is held by the test (``stopped``), not paused for a time sized to this machine's
speed, and the checks that fail are timed beside a control wait of one timeout
(``beside_a_wait``), so that what is bounded is what the code waited, not the machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import pytest

from fair_frontend.admission import MemoryStorage, RateLimiter, RateLimitItem, RedisStorage
from fair_frontend.admission.ratelimit import Decision, StorageErrorMode
from fair_frontend.errors import Unavailable
from tests.admission.conftest import Timed, beside_a_wait, typical

if TYPE_CHECKING:
    from tests.support import RedisProcess

TIMEOUT_S = 0.2  # the module's doc: why not the production default's 50 ms
STALL_S = 3 * TIMEOUT_S  # each stall of the loop: three timeouts
STALL_EVERY_S = 0.05  # the loop runs at least this long between stalls
STALLS = 3  # stalls of the loop per burst, at most
LIMIT = RateLimitItem("requests", "minute", 50, 60.0)


def busy(seconds: float) -> None:
    """Hold the CPU (and the GIL, as Python code does) for ``seconds``."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class Pending:
    """How many checks of a burst are waiting for their answer now."""

    def __init__(self) -> None:
        self.checks = 0


class LoopStalls:
    """Stalls the running loop: ``STALL_S`` of CPU-bound work each time it finds checks of
    ``pending`` waiting for their answer, at least ``STALL_EVERY_S`` apart, at most ``STALLS``
    times: each stall holds checks in flight, at whatever speed the burst goes."""

    def __init__(self, pending: Pending) -> None:
        self.pending = pending
        self.stalls = 0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while self.stalls < STALLS:
            if not self.pending.checks:
                await asyncio.sleep(0.002)  # polling, not waiting for a server
                continue
            busy(STALL_S)
            self.stalls += 1
            await asyncio.sleep(STALL_EVERY_S)  # pacing the hog, not waiting for a server

    def __enter__(self) -> LoopStalls:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


@pytest.fixture(params=["memory", "redis"])
async def limiter_factory(
    request: pytest.FixtureRequest,
) -> AsyncIterator[Callable[[StorageErrorMode], RateLimiter]]:
    """Limiters over this test's storage kind; Redis with the module's timeout."""
    made: list[RateLimiter] = []

    def make(mode: StorageErrorMode) -> RateLimiter:
        if request.param == "memory":
            storage: MemoryStorage | RedisStorage = MemoryStorage()
        else:
            server: RedisProcess = request.getfixturevalue("redis_process")
            storage = RedisStorage(server.url, timeout_s=TIMEOUT_S)
        made.append(RateLimiter(storage, on_storage_error=mode))
        return made[-1]

    yield make
    for limiter in made:
        await limiter.close()


async def burst(
    limiter: RateLimiter,
    key: str,
    n: int,
    concurrency: int,
    item: RateLimitItem = LIMIT,
    pending: Pending | None = None,
) -> list[Decision | Unavailable]:
    """``n`` checks of ``key``, ``concurrency`` in flight at once, each at its own now
    (counted in ``pending`` while they wait)."""
    gate = asyncio.Semaphore(concurrency)
    waiting = pending or Pending()

    async def one() -> Decision | Unavailable:
        async with gate:
            waiting.checks += 1
            try:
                return await limiter.check(key, [item], requests=1, tokens=0, now=time.time())
            except Unavailable as err:
                return err
            finally:
                waiting.checks -= 1

    return await asyncio.gather(*(one() for _ in range(n)))


def admitted(results: list[Decision | Unavailable]) -> int:
    return sum(isinstance(r, Decision) and r.allowed for r in results)


def degraded(results: list[Decision | Unavailable]) -> int:
    return sum(isinstance(r, Unavailable) or r.degraded for r in results)


@pytest.mark.parametrize("mode", ["fail_open", "fail_closed"])
async def test_a_busy_event_loop_never_fails_a_check_open(
    limiter_factory: Callable[[StorageErrorMode], RateLimiter], mode: StorageErrorMode
) -> None:
    limiter = limiter_factory(mode)
    pending = Pending()
    with LoopStalls(pending) as stalls:
        results = await burst(limiter, "busy:embed", n=900, concurrency=300, pending=pending)
    if isinstance(limiter.storage, RedisStorage):
        # The control: the loop really stalled while checks waited for Redis. (Memory's
        # checks never wait: nothing can stall them, and the count must be as exact.)
        assert stalls.stalls >= 1, stalls.stalls
    assert degraded(results) == 0 and limiter.storage_errors == 0
    assert admitted(results) == LIMIT.amount


async def test_concurrent_checks_share_round_trips_on_one_connection(
    redis_process: RedisProcess,
) -> None:
    storage = RedisStorage(redis_process.url, timeout_s=TIMEOUT_S)
    limiter = RateLimiter(storage, on_storage_error="fail_closed")
    try:
        results = await burst(limiter, "share:embed", n=600, concurrency=300)
        assert admitted(results) == LIMIT.amount and degraded(results) == 0
        trips = storage.round_trips
        # 600 checks (plus one SCRIPT LOAD resend of a first batch), a few round trips.
        assert trips.round_trips <= 600 / 20, (trips.round_trips, trips.commands)
        with redis_process.client() as client:
            clients = client.client_list()
        assert len(clients) == 2  # the storage's one connection, and this one
    finally:
        await limiter.close()


@contextlib.asynccontextmanager
async def stopped(redis_process: RedisProcess) -> AsyncIterator[None]:
    """Redis stopped (SIGSTOP: its connections stay open and nothing answers) for as long
    as the block runs, then continued and polled until it answers PING: a Redis slower
    than any timeout for exactly as long as the test needs."""
    assert redis_process.proc is not None
    pid = redis_process.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)
    await asyncio.to_thread(redis_process.wait_ready)


@pytest.mark.parametrize("mode", ["fail_open", "fail_closed"])
async def test_one_slow_reply_fails_only_the_checks_it_delayed(
    redis_process: RedisProcess, mode: StorageErrorMode
) -> None:
    storage = RedisStorage(redis_process.url, timeout_s=TIMEOUT_S)
    limiter = RateLimiter(storage, on_storage_error=mode)
    try:
        assert (await burst(limiter, "warm:embed", 1, 1))[0]  # connected, scripts loaded
        # Tenant A's checks meet a Redis that answers only after they have all given up:
        # each takes the mode, counted, with its reason.
        async with stopped(redis_process):
            slow = await burst(limiter, "a:embed", n=20, concurrency=20)
        assert degraded(slow) == 20 and limiter.storage_errors == 20
        # Redis answers again at once: tenant B's burst is exact, nobody skips Redis.
        results = await burst(limiter, "b:embed", n=300, concurrency=300)
        assert degraded(results) == 0 and limiter.storage_errors == 20
        assert admitted(results) == LIMIT.amount
        assert not limiter.circuit_open
        for r in slow:  # A's, each with its reason
            if mode == "fail_open":
                assert isinstance(r, Decision) and r.allowed and r.storage_error == "timeout"
            else:
                assert isinstance(r, Unavailable) and getattr(r, "reason", None) == "timeout"
    finally:
        await limiter.close()


async def test_a_redis_slower_than_the_timeout_fails_each_check_within_the_bound(
    redis_process: RedisProcess,
) -> None:
    """Longer than the timeout, shorter than the circuit's patience: every check asks,
    waits its own timeout and no more, and takes the mode itself."""
    storage = RedisStorage(redis_process.url, timeout_s=TIMEOUT_S)
    limiter = RateLimiter(storage, on_storage_error="fail_open")
    try:
        assert (await burst(limiter, "warm:embed", 1, 1))[0]
        # Four checks 0.1 s apart on the limiter's clock (its ``now``): 0.3 s of failures,
        # short of the circuit's 1 s however long this machine takes over them.
        now = time.time()
        decisions: list[Decision] = []
        waits: list[Timed[Decision]] = []
        async with stopped(redis_process):
            for i in range(4):
                sent = storage.round_trips.round_trips
                t = await beside_a_wait(
                    limiter.check("c:embed", [LIMIT], requests=1, tokens=0, now=now + 0.1 * i),
                    TIMEOUT_S,
                )
                # It asked Redis (one round trip: none skipped it), and really waited.
                assert storage.round_trips.round_trips - sent == 1
                assert t.seconds >= 0.9 * TIMEOUT_S, t
                decisions.append(t.result)
                waits.append(t)
        # Each gave up after its own timeout: less than one more than a control wait of one.
        assert typical(waits) < TIMEOUT_S, waits
        assert limiter.storage_errors == 4 and not limiter.circuit_open
        assert all(d.degraded for d in decisions)
        assert {d.storage_error for d in decisions} == {"timeout"}
        d = await limiter.check("c:embed", [LIMIT], requests=1, tokens=0, now=now + 0.5)
        assert d.allowed and not d.degraded
    finally:
        await limiter.close()
