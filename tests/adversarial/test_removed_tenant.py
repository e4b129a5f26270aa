"""A tenant removed while its request is admitted gets identity's answer, not a 500
(issue 11, item 9).

A request's identity is checked in the shell; in the core, admission may then wait (its
rate-limit check on Redis). A reload that removes the tenant meanwhile left the request
to a scheduler that no longer knew it: ``Internal: scheduler: unknown tenant``, a 500.
Now the core refuses it as identity would now: 401 (UNAUTHENTICATED), answered once.

The stack is real (Triton, Redis, the frontend, its clients); the test holds the
rate-limit check at a gate in front of the real Redis storage, so the reload lands while
the check is in flight, every time, without timing.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from fair_frontend.admission import RateLimiter, RedisStorage
from fair_frontend.admission.storage import Checked
from fair_frontend.backends.protocol import BackendServer
from fair_frontend.backends.triton.embedded import EmbeddedTriton
from fair_frontend.config import Config
from fair_frontend.core import Core
from fair_frontend.server import BackgroundServer, FrontendServer, Listen
from tests.support import KEYS, KServe, RedisProcess, make_config

DOOMED = "doomed"
DOOMED_KEY = "doomed-test-key"
CHECK_TIMEOUT_S = 5.0  # the storage's own deadline: never reached while the gate holds


class GatedStorage:
    """The real Redis storage, each check held at a gate until the test opens it."""

    def __init__(self, inner: RedisStorage) -> None:
        self.inner = inner
        self.entered = threading.Semaphore(0)  # released once per check that reached the gate
        self.gate = asyncio.Event()  # set on the frontend's loop

    async def acquire(
        self, key: str, items: Sequence[Any], costs: Sequence[int], now_us: int
    ) -> Checked:
        self.entered.release()
        await self.gate.wait()
        return await self.inner.acquire(key, items, costs, now_us)

    async def adjust(self, *args: Any) -> None:
        await self.inner.adjust(*args)

    async def close(self) -> None:
        await self.inner.close()


@pytest.fixture
def redis() -> Iterator[RedisProcess]:
    server = RedisProcess()
    server.start()
    yield server
    server.stop()


def limited_config(with_doomed: bool) -> Config:
    """Test tenants plus ``doomed``, all limited on ``embed`` (so every request's
    admission checks Redis)."""
    config = make_config(
        tier_limits={"standard": {"embed": {"requests_per_minute": 1000}}},
    )
    tenants = dict(config.tenants)
    if with_doomed:
        tenants[DOOMED] = tenants["initech"].model_copy(update={"api_keys": [DOOMED_KEY]})
    return config.model_copy(update={"tenants": tenants})


async def test_a_tenant_removed_during_its_rate_limit_check_is_unauthenticated(
    triton: EmbeddedTriton, redis: RedisProcess
) -> None:
    storage = GatedStorage(RedisStorage(redis.url, timeout_s=CHECK_TIMEOUT_S))
    config = limited_config(with_doomed=True)
    config = config.model_copy(
        update={"triton": config.triton.model_copy(update={"http_url": triton.http_url})}
    )

    def core(c: Config, f: list[BackendServer]) -> Core:
        return Core(c, f, limiter=RateLimiter(storage))

    server = FrontendServer(config, triton.grpc_url, Listen(), core_factory=core)
    kserve = KServe()
    background = BackgroundServer(server)
    with background:
        urls = (f"127.0.0.1:{server.grpc_port}", f"127.0.0.1:{server.http_port}")
        calls = [
            asyncio.ensure_future(kserve.infer(protocol, urls, DOOMED_KEY, "embed", 1, 4))
            for protocol in ("grpc", "http")
        ]
        for _ in calls:  # both are in their rate-limit check, held at the gate
            assert await asyncio.to_thread(storage.entered.acquire, True, 30)
        reloaded = limited_config(with_doomed=False).model_copy(
            update={"triton": server.config.triton}
        )

        async def reload_then_open() -> list[str]:
            notes: list[str] = server.reload(reloaded)
            storage.gate.set()
            return notes

        assert (
            await asyncio.wrap_future(
                asyncio.run_coroutine_threadsafe(reload_then_open(), background.loop)
            )
            == []
        )
        replies = await asyncio.gather(*calls)
        # Another tenant's request goes through the same (now open) check.
        other = await kserve.infer("grpc", urls, KEYS["initech"], "embed", 1, 4)
        await kserve.close()
    for reply in replies:
        assert reply.code == "UNAUTHENTICATED" or reply.status == "401", reply
        assert "removed" in reply.message, reply
    assert other.ok, other
