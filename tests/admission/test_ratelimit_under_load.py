"""Limits that hold under load: the storage timeout measures Redis, and one failure decides
for one check only.

Each test runs the limiter with the production timeout (50 ms) on a real ``redis-server``
of its own, and the same test over ``memory://`` where it applies (a storage that never
waits cannot fail, but must give the same exact count).

- A busy event loop (the core stalled 150 ms at a time by a CPU hog on its own loop, while
  300 checks are in flight) and a healthy Redis: a burst admits exactly the limit, and no
  check fails open. Before, the 50 ms deadline ran on that loop, and counted the wait for
  one of 64 pooled connections: checks timed out with Redis idle, each admitted
  uncounted, and the first one switched checks off for every tenant for 1 s.
- Concurrent checks share round trips on one connection (no pool to wait for).
- One slow reply (``CLIENT PAUSE`` of four timeouts): the checks it delayed take the mode,
  each counted with its reason; the checks after it, another tenant's burst, are exact.
  Before, that one timeout made every check of every tenant take the mode for 1 s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING

import pytest

from fair_frontend.admission import MemoryStorage, RateLimiter, RateLimitItem, RedisStorage
from fair_frontend.admission.ratelimit import Decision
from fair_frontend.admission.storage import DEFAULT_TIMEOUT_S
from fair_frontend.errors import Unavailable

if TYPE_CHECKING:
    from tests.support import RedisProcess

TIMEOUT_S = DEFAULT_TIMEOUT_S  # 50 ms, the production default
STALL_S = 0.15  # each stall of the loop: three timeouts
STALL_EVERY_S = 0.05  # the loop runs this long between stalls
LIMIT = RateLimitItem("requests", "minute", 50, 60.0)


def busy(seconds: float) -> None:
    """Hold the CPU (and the GIL, as Python code does) for ``seconds``."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class LoopStalls:
    """Stalls the running loop: ``STALL_S`` of CPU-bound work every ``STALL_EVERY_S``."""

    def __init__(self) -> None:
        self.stalls = 0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
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
) -> AsyncIterator[Callable[[str], RateLimiter]]:
    """Limiters over this test's storage kind; Redis with the production timeout."""
    made: list[RateLimiter] = []

    def make(mode: str) -> RateLimiter:
        if request.param == "memory":
            storage: MemoryStorage | RedisStorage = MemoryStorage()
        else:
            server: RedisProcess = request.getfixturevalue("redis_process")
            storage = RedisStorage(server.url, timeout_s=TIMEOUT_S)
        made.append(RateLimiter(storage, on_storage_error=mode))  # type: ignore[arg-type]
        return made[-1]

    yield make
    for limiter in made:
        await limiter.close()


async def burst(
    limiter: RateLimiter, key: str, n: int, concurrency: int, item: RateLimitItem = LIMIT
) -> list[Decision | Unavailable]:
    """``n`` checks of ``key``, ``concurrency`` in flight at once, each at its own now."""
    gate = asyncio.Semaphore(concurrency)

    async def one() -> Decision | Unavailable:
        async with gate:
            try:
                return await limiter.check(key, [item], requests=1, tokens=0, now=time.time())
            except Unavailable as err:
                return err

    return await asyncio.gather(*(one() for _ in range(n)))


def admitted(results: list[Decision | Unavailable]) -> int:
    return sum(isinstance(r, Decision) and r.allowed for r in results)


def degraded(results: list[Decision | Unavailable]) -> int:
    return sum(isinstance(r, Unavailable) or r.degraded for r in results)


@pytest.mark.parametrize("mode", ["fail_open", "fail_closed"])
async def test_a_busy_event_loop_never_fails_a_check_open(
    limiter_factory: Callable[[str], RateLimiter], mode: str
) -> None:
    limiter = limiter_factory(mode)
    with LoopStalls() as stalls:
        results = await burst(limiter, "busy:embed", n=900, concurrency=300)
    assert stalls.stalls >= 1  # the control: the loop really stalled during the burst
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


@pytest.fixture
def paused(redis_process: RedisProcess) -> Iterator[Callable[[float], None]]:
    """Pause every client of the test's Redis for a while (``CLIENT PAUSE``), and wait
    (PING, which the pause holds back: bounded by the client's socket timeout) for it
    to end."""
    client = redis_process.client()

    def pause(seconds: float) -> None:
        client.execute_command("CLIENT", "PAUSE", round(seconds * 1000), "ALL")

    yield pause
    client.close()


def wait_unpaused(redis_process: RedisProcess) -> None:
    with redis_process.client() as client:  # socket timeout 5 s: the wait's deadline
        assert client.ping()


@pytest.mark.parametrize("mode", ["fail_open", "fail_closed"])
async def test_one_slow_reply_fails_only_the_checks_it_delayed(
    redis_process: RedisProcess, paused: Callable[[float], None], mode: str
) -> None:
    storage = RedisStorage(redis_process.url, timeout_s=TIMEOUT_S)
    limiter = RateLimiter(storage, on_storage_error=mode)  # type: ignore[arg-type]
    try:
        assert (await burst(limiter, "warm:embed", 1, 1))[0]  # connected, scripts loaded
        paused(4 * TIMEOUT_S)
        # Tenant A's checks meet the pause: each takes the mode, counted, with its reason.
        slow = await burst(limiter, "a:embed", n=20, concurrency=20)
        assert degraded(slow) == 20 and limiter.storage_errors == 20
        await asyncio.to_thread(wait_unpaused, redis_process)
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
    redis_process: RedisProcess, paused: Callable[[float], None]
) -> None:
    """Longer than the timeout, shorter than the circuit's patience: every check asks,
    waits at most a round trip ahead of it and its own, and takes the mode itself."""
    storage = RedisStorage(redis_process.url, timeout_s=TIMEOUT_S)
    limiter = RateLimiter(storage, on_storage_error="fail_open")
    try:
        assert (await burst(limiter, "warm:embed", 1, 1))[0]
        paused(0.5)
        started = time.perf_counter()
        took: list[float] = []
        decisions: list[Decision] = []
        while time.perf_counter() - started < 0.4:
            t = time.perf_counter()
            d = await limiter.check("c:embed", [LIMIT], requests=1, tokens=0, now=time.time())
            took.append(time.perf_counter() - t)
            decisions.append(d)
        assert len(took) >= 4 and limiter.storage_errors == len(took)
        assert all(d.degraded for d in decisions)
        assert min(took) >= 0.9 * TIMEOUT_S, took  # each one asked Redis, none skipped it
        assert max(took) < 2 * TIMEOUT_S + 0.1, max(took)
        assert {d.storage_error for d in decisions} == {"timeout"}
        await asyncio.to_thread(wait_unpaused, redis_process)
        d = await limiter.check("c:embed", [LIMIT], requests=1, tokens=0, now=time.time())
        assert d.allowed and not d.degraded
    finally:
        await limiter.close()
