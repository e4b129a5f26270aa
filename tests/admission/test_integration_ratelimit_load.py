"""Rate limits under load on the real stack: real Triton, the real frontend (one process, and
two shells), real clients, a real Redis of the test's own, the production timeout (50 ms).

- The core's event loop busy (a CPU hog on it: 150 ms stalls every 50 ms) while a burst of
  concurrent requests meets a small limit, Redis healthy: exactly the limit is admitted and
  no check fails open. Before, checks in flight across a stall timed out with Redis idle,
  were admitted uncounted, and switched the limits off for every tenant for 1 s.
- A Redis that holds every command for 2 s (``CLIENT PAUSE``): each
  request whose check it delayed takes the mode and is counted once in
  ``fair_rate_limit_storage_errors_total{tenant, endpoint, mode, reason="timeout"}``; the
  moment Redis answers again another tenant's burst is exact. Before, that tenant's burst
  was admitted whole, uncounted (the 1 s skip), and the counter had only a ``mode``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

from tests.support import KEYS, RunningFrontend, make_config, running_frontend

if TYPE_CHECKING:
    from tests.support import KServe, RedisProcess, Reply

TIMEOUT_MS = 50.0  # the production default: what the fix must hold with
STALL_S = 0.15
STALL_EVERY_S = 0.05
LOADED = "initech"  # its limit is tight: 20 a minute
OTHER = "hooli"  # another tenant of the same tier: 5 a minute
PAUSE_MS = 2_000  # Redis paused: 40 of the checks' timeouts, long enough for a burst of 8


def load_config(url: str, mode: str) -> Any:
    return make_config(
        tier_limits={"standard": {"embed": {"requests_per_minute": 1_000_000}}},
        tenants={
            LOADED: {
                "tier": "standard",
                "api_keys": [KEYS[LOADED]],
                "limits": {"embed": {"requests_per_minute": 20}},
            },
            OTHER: {
                "tier": "standard",
                "api_keys": [KEYS[OTHER]],
                "limits": {"embed": {"requests_per_minute": 5}},
            },
        },
        rate_limiting={"storage": url, "on_storage_error": mode, "timeout_ms": TIMEOUT_MS},
    )


@contextlib.contextmanager
def load_frontend(
    triton: Any, redis_process: RedisProcess, workers: int, mode: str
) -> Iterator[RunningFrontend]:
    with running_frontend(load_config(redis_process.url, mode), triton, workers=workers) as fe:
        yield fe


def storage_errors(kserve: KServe, fe: RunningFrontend, **labels: str) -> float:
    return kserve.counter(fe.metrics_url, "fair_rate_limit_storage_errors", **labels)


async def burst(
    kserve: KServe, fe: RunningFrontend, tenant: str, count: int, concurrency: int
) -> list[Reply]:
    """``count`` embed requests of ``tenant``, ``concurrency`` at once, gRPC and HTTP
    alternately."""
    gate = asyncio.Semaphore(concurrency)
    urls = (fe.grpc_url, fe.http_url)

    async def one(i: int) -> Reply:
        async with gate:
            protocol = "grpc" if i % 2 else "http"
            return await kserve.infer(protocol, urls, KEYS[tenant], "embed", 1, 8)

    return list(await asyncio.gather(*(one(i) for i in range(count))))


def codes(replies: list[Reply]) -> dict[str, int]:
    out: dict[str, int] = {}
    for reply in replies:
        out[reply.code] = out.get(reply.code, 0) + 1
    return out


class CoreStalls:
    """A CPU hog on the core's own event loop: ``STALL_S`` busy every ``STALL_EVERY_S``."""

    def __init__(self, fe: RunningFrontend) -> None:
        self.loop = fe.background.loop
        self.stalls = 0
        self._future: concurrent.futures.Future[None] | None = None

    async def _run(self) -> None:
        while True:
            end = time.perf_counter() + STALL_S
            while time.perf_counter() < end:
                pass
            self.stalls += 1
            await asyncio.sleep(STALL_EVERY_S)  # pacing the hog, not waiting for a server

    def __enter__(self) -> CoreStalls:
        self._future = asyncio.run_coroutine_threadsafe(self._run(), self.loop)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._future is not None
        self._future.cancel()


@pytest.mark.parametrize("mode", ["fail_open", "fail_closed"])
async def test_a_busy_core_keeps_limits_exact(
    triton: Any, redis_process: RedisProcess, kserve: KServe, workers: int, mode: str
) -> None:
    with load_frontend(triton, redis_process, workers, mode) as fe:
        # Warm: connections made, scripts loaded, the model known (not part of the test).
        assert (await burst(kserve, fe, OTHER, 1, 1))[0].ok
        with CoreStalls(fe) as stalls:
            replies = await burst(kserve, fe, LOADED, 300, 150)
        # The control: the core really stalled while the burst was in flight (the first
        # stall starts as the burst does; a burst of 0.5-0.8 s here sees 2 to 4).
        assert stalls.stalls >= 2, stalls.stalls
        assert codes(replies) == {"OK": 20, "RESOURCE_EXHAUSTED": 280}
        assert storage_errors(kserve, fe) == 0


@pytest.mark.parametrize("mode", ["fail_open", "fail_closed"])
async def test_each_check_redis_holds_back_takes_the_mode_and_is_counted(
    triton: Any, redis_process: RedisProcess, kserve: KServe, workers: int, mode: str
) -> None:
    with load_frontend(triton, redis_process, workers, mode) as fe, redis_process.client() as rc:
        assert (await burst(kserve, fe, LOADED, 1, 1))[0].ok  # warm, and counted: 1 of 20
        # Redis holds every command for PAUSE_MS (CLIENT UNPAUSE would be held as well):
        # the burst's checks meet it; a PING returns once Redis answers again.
        rc.execute_command("CLIENT", "PAUSE", PAUSE_MS, "ALL")
        started = time.monotonic()
        held = await burst(kserve, fe, LOADED, 8, 8)
        assert time.monotonic() - started < PAUSE_MS / 1000, "the burst outlasted the pause"
        await asyncio.to_thread(rc.ping)
        # Redis answers again at once: the other tenant's burst is exact, counted.
        other = await burst(kserve, fe, OTHER, 20, 20)
        assert codes(other) == {"OK": 5, "RESOURCE_EXHAUSTED": 15}

        expected = "OK" if mode == "fail_open" else "UNAVAILABLE"
        assert codes(held) == {expected: 8}, held
        counted = dict(tenant=LOADED, endpoint="embed", mode=mode)
        assert storage_errors(kserve, fe, **counted, reason="timeout") == 8
        assert storage_errors(kserve, fe) == 8  # nothing else: no other reason, no tenant
