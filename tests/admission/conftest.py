"""Fixtures for the admission tests: a real ``redis-server`` on a free port, and storages.

Every test that takes ``storage`` runs once per storage (``memory``, ``redis``): the same
tests over every storage. The session's ``redis_server`` is flushed before each test;
tests that kill or pause Redis start their own with ``redis_process``.

``kserve`` (for the ``test_integration_*`` tests, on the real stack): calls a running
frontend over gRPC and HTTP keeping the retry hints, and reads Prometheus counters.
``RedisProcess`` and ``KServe`` themselves are in ``tests.support`` (tests elsewhere use
them too).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator

import pytest
import redis.asyncio as aioredis

from fair_frontend.admission import MemoryStorage, RedisStorage, Storage
from tests.support import KServe, RedisProcess

# Functional tests must never see a storage error: a loaded 2-core machine can stall for
# more than the 50 ms production default. The failure tests use the production timeout.
FUNCTIONAL_TIMEOUT_S = 5.0


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
