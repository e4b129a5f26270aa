"""Fixtures for the admission tests: a real ``redis-server`` on a free port, and storages.

Every test that takes ``storage`` runs once per storage (``memory``, ``redis``): the same
tests over every storage. The session's ``redis_server`` is flushed before each test;
tests that kill or pause Redis start their own with ``redis_process``.

``kserve`` (for the ``test_integration_*`` tests, on the real stack): calls a running
frontend over gRPC and HTTP keeping the retry hints, and reads Prometheus counters.
``RedisProcess`` and ``KServe`` themselves are in ``tests.support`` (tests elsewhere use
them too).

``beside_a_wait``: how long a storage call took, beside a control wait started with it, so
that the tests of a Redis that is down or hung bound what the code waited, not how busy the
machine is.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import pytest
import redis.asyncio as aioredis

from fair_frontend.admission import MemoryStorage, RedisStorage, Storage
from tests.support import KServe, RedisProcess

# Functional tests must never see a storage error: a loaded 2-core machine can stall for
# more than the 50 ms production default. The failure tests use the production timeout.
FUNCTIONAL_TIMEOUT_S = 5.0

T = TypeVar("T")


@dataclass(frozen=True)
class Timed(Generic[T]):
    """What a call returned, how long it took, and how long its control wait took."""

    result: T
    seconds: float
    control: float

    @property
    def beyond(self) -> float:
        """How much longer than its control wait the call took (< 0: it ended first)."""
        return self.seconds - self.control


async def clocked(call: Awaitable[T]) -> tuple[T, float]:
    """What ``call`` returned, and how long it took (seconds)."""
    start = time.perf_counter()
    result = await call
    return result, time.perf_counter() - start


async def beside_a_wait(call: Awaitable[T], wait_s: float) -> Timed[T]:
    """Await ``call`` beside a control started with it: a thread that blocks for ``wait_s``
    and then hands back to this loop, as the storage's round-trip thread does when Redis
    stays silent for its timeout (``RoundTrips``).

    A loaded machine delays both alike: measured beside four CPU hogs on two cores, a
    check that waited out a 50 ms timeout ended within 10 ms of its control, while either
    alone took up to 110 ms. So ``beyond`` is what the call waited past one such wait,
    whatever the load: a bound on it is a bound on the code, not on the machine's speed.
    A check that waited a second timeout (a retry), the 1.8 s backstop (a socket without
    its timeout) or a backoff between reconnects is a whole timeout or more beyond.
    Bound the ``typical`` of a test's calls, not each: once in about 150 calls, in a suite
    run beside two hogs and the neighbours' tests, one thread alone was held up 56 ms."""
    (result, seconds), (_, control) = await asyncio.gather(
        clocked(call), clocked(asyncio.to_thread(time.sleep, wait_s))
    )
    return Timed(result, seconds, control)


def typical(timed: Sequence[Timed[Any]]) -> float:
    """The median ``beyond`` of a test's calls (three or more): what the code waits each
    time, past one call that a rare stall of its own thread held up."""
    assert len(timed) >= 3, timed
    return statistics.median(t.beyond for t in timed)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisProcess]:
    server = RedisProcess()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisProcess) -> str:
    return redis_server.url


@pytest.fixture
async def redis_client(redis_server: RedisProcess) -> AsyncIterator[aioredis.Redis]:
    """A client of the test's own on the session's Redis, to read what a storage wrote."""
    client = aioredis.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


@pytest.fixture
def redis_process() -> Iterator[RedisProcess]:
    """A Redis of the test's own, to kill, pause or restart; stopped after the test."""
    server = RedisProcess()
    server.start()
    yield server
    server.stop()


StorageFactory = Callable[[], Storage]


@pytest.fixture(params=["memory", "redis"])
def storage_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def new_storage(storage_kind: str, request: pytest.FixtureRequest) -> StorageFactory:
    """Makes fresh storages of this test's kind over clean state (Redis flushed once)."""
    if storage_kind == "memory":
        return MemoryStorage
    server: RedisProcess = request.getfixturevalue("redis_server")
    with server.client() as c:
        c.flushall()
    return lambda: RedisStorage(server.url, timeout_s=FUNCTIONAL_TIMEOUT_S)


@pytest.fixture
async def storage(new_storage: StorageFactory) -> AsyncIterator[Storage]:
    made = new_storage()
    yield made
    await made.close()


@pytest.fixture
async def kserve() -> AsyncIterator[KServe]:
    made = KServe()
    yield made
    await made.close()
