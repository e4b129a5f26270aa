"""Redis dies while traffic flows through the frontend: the configured mode, within the bound.

Traffic (two gRPC and two HTTP clients, each sending back to back) runs against a frontend
whose rate limits live in a Redis of the test's own; then Redis is killed (SIGKILL) or hung
(SIGSTOP: the connection stays open and nothing answers, the case only the timeout bounds).
With ``fail_open`` every request is still admitted; with ``fail_closed`` every request is
answered UNAVAILABLE / 503; ``fair_rate_limit_storage_errors{mode, reason}`` counts them:
each check asks Redis (``error`` when it is killed, ``timeout`` when it is hung) until it
has answered nothing for a second, then the circuit opens (``circuit_open``: checks take
the mode at once, one probe at a time). In both modes every request is answered sooner than
the storage's backstop could have answered its check (a timer of the core's loop, never
early): so by its round trip's own timeout, or the circuit, and never held (without the
timeout a hung Redis holds each check until the backstop). How long a check waits beyond
its timeout is bounded exactly in ``test_ratelimit_redis``; here a request also waits for
Triton and for a loaded machine. The outage lasts until the traffic has met it (requests
sent after it began, the circuit open), not a time sized to this machine's speed. Once
Redis answers again the limits count again.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

from fair_frontend.admission.ratelimit import DEFAULT_OPEN_AFTER_S
from fair_frontend.admission.storage import BACKSTOP_S, BACKSTOP_TIMEOUTS
from fair_frontend.kit.testing import aeventually, ascrape
from tests.support import KEYS, RunningFrontend, make_config, running_frontend

if TYPE_CHECKING:
    from tests.support import KServe, RedisProcess, Reply

TIMEOUT_S = 0.2  # the storage timeout: above the 50 ms default so that a loaded machine
# never times out before Redis is down, which would make the "before" phase flaky
OPEN_AFTER_S = DEFAULT_OPEN_AFTER_S  # 1 s of failures open the circuit
# The storage's backstop: a check its round trip never answered is answered by the core's
# loop this long after it began (4.2 s), never sooner. A request answered sooner had its
# check answered by its round trip's timeout (0.2 s; the one ahead of it: 0.4 s) or by the
# circuit: what any request may take, Redis up, down or hung.
BOUND_S = BACKSTOP_S + BACKSTOP_TIMEOUTS * TIMEOUT_S
DURING = 20  # requests sent during the outage, at least
OUTAGE_LIMIT_S = 60.0  # for the traffic to meet the outage: far above it, a hang fails
RECOVERY_S = 10.0  # how long Redis may take to count again once it answers
PACE_S = 0.005  # each client's pause between requests (keeps the two cores for the stack)
TRAFFIC = "initech"  # its limit is far away: every refusal here is the storage's
PROBE = "hooli"  # 2 requests a minute: a 429 shows that Redis counts again
REQUESTS_BEFORE = 12


def outage_config(url: str, mode: str) -> Any:
    return make_config(
        tier_limits={"standard": {"embed": {"requests_per_minute": 1_000_000}}},
        tenants={
            TRAFFIC: {"tier": "standard", "api_keys": [KEYS[TRAFFIC]]},
            PROBE: {
                "tier": "standard",
                "api_keys": [KEYS[PROBE]],
                "limits": {"embed": {"requests_per_minute": 2}},
            },
        },
        rate_limiting={
            "storage": url,
            "on_storage_error": mode,
            "timeout_ms": TIMEOUT_S * 1000,
        },
    )


class Traffic:
    """Clients sending back to back until stopped; every reply kept."""

    def __init__(self, kserve: KServe, fe: RunningFrontend) -> None:
        self.kserve = kserve
        self.urls = (fe.grpc_url, fe.http_url)
        self.replies: list[Reply] = []
        self.stopped = False
        self._enough = asyncio.Event()
        self._wanted = 0
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        for protocol in ("grpc", "http", "grpc", "http"):
            self._tasks.append(asyncio.create_task(self._client(protocol)))

    async def _client(self, protocol: str) -> None:
        while not self.stopped:
            reply = await self.kserve.infer(protocol, self.urls, KEYS[TRAFFIC], "embed", 1, 8)
            self.replies.append(reply)
            if len(self.replies) >= self._wanted:
                self._enough.set()
            await asyncio.sleep(PACE_S)

    async def until(self, replies: int) -> None:
        """Until ``replies`` replies in all have come back."""
        self._wanted = replies
        self._enough.clear()
        if len(self.replies) < replies:
            await asyncio.wait_for(self._enough.wait(), 30)

    async def stop(self) -> None:
        self.stopped = True
        # Each client finishes the call it is in (answered within seconds, Redis up or
        # down): a hang fails here instead of at pytest's timeout.
        await asyncio.wait_for(asyncio.gather(*self._tasks), 60)


@pytest.fixture
def outage_frontend(
    triton: Any, redis_process: RedisProcess, request: pytest.FixtureRequest, workers: int
) -> Iterator[RunningFrontend]:
    with running_frontend(
        outage_config(redis_process.url, request.param), triton, workers=workers
    ) as fe:
        yield fe


def storage_errors(kserve: KServe, fe: RunningFrontend, mode: str, **labels: str) -> float:
    return kserve.counter(fe.metrics_url, "fair_rate_limit_storage_errors", mode=mode, **labels)


async def met_the_outage(
    traffic: Traffic, fe: RunningFrontend, mode: str, down_at: float, asked: str
) -> bool:
    """Has the traffic met the whole outage: DURING requests sent after it began, checks
    that asked Redis and failed (``asked``), and then the circuit open?"""
    if sum(r.sent > down_at for r in traffic.replies) < DURING:
        return False
    page = await ascrape(fe.metrics_url)
    errors = "fair_rate_limit_storage_errors"
    return all(
        page.family_sum(errors, mode=mode, tenant=TRAFFIC, reason=reason) >= 1
        for reason in (asked, "circuit_open")
    )


async def probe_until_refused(kserve: KServe, fe: RunningFrontend) -> list[Reply]:
    """The probe tenant's requests, one at a time, until one is refused by its limit."""
    replies: list[Reply] = []
    deadline = time.monotonic() + RECOVERY_S
    while time.monotonic() < deadline:
        reply = await kserve.infer("grpc", (fe.grpc_url, fe.http_url), KEYS[PROBE], "embed", 1, 8)
        replies.append(reply)
        if reply.code == "RESOURCE_EXHAUSTED":
            break
        await asyncio.sleep(0.02)  # pacing the probe, not waiting for a server
    return replies


@pytest.mark.parametrize("failure", ["killed", "hung"])
@pytest.mark.parametrize("outage_frontend", ["fail_open", "fail_closed"], indirect=True)
async def test_redis_down_mid_run(
    outage_frontend: RunningFrontend,
    redis_process: RedisProcess,
    kserve: KServe,
    failure: str,
) -> None:
    fe = outage_frontend
    mode = fe.server.config.rate_limiting.on_storage_error
    assert redis_process.proc is not None
    pid = redis_process.proc.pid
    traffic = Traffic(kserve, fe)
    traffic.start()
    hung = False
    asked = "error" if failure == "killed" else "timeout"  # why the checks that ask fail
    try:
        await traffic.until(REQUESTS_BEFORE)
        errors_before = storage_errors(kserve, fe, mode)
        if failure == "killed":
            redis_process.proc.kill()
            redis_process.proc.wait()
        else:
            os.kill(pid, signal.SIGSTOP)
            hung = True
        down_at = time.monotonic()
        # The outage lasts (traffic keeps flowing) until the traffic has met all of it.
        await aeventually(
            lambda: met_the_outage(traffic, fe, mode, down_at, asked),
            OUTAGE_LIMIT_S,
            what=f"{DURING} requests through the outage, and the circuit open",
        )
        await traffic.stop()
        errors_after = storage_errors(kserve, fe, mode)
    finally:
        traffic.stopped = True
        if hung:
            os.kill(pid, signal.SIGCONT)

    before = [r for r in traffic.replies if r.sent + r.seconds < down_at]
    during = [r for r in traffic.replies if r.sent > down_at]
    assert len(before) >= REQUESTS_BEFORE and all(r.ok for r in before), before[:3]
    assert errors_before == 0
    assert len(during) >= DURING, f"only {len(during)} requests during the outage"

    # Every check after the outage began was a storage error, counted under the mode
    # (those in flight at that moment may or may not have been).
    assert len(during) <= errors_after <= len(during) + 4, (errors_after, len(during))
    if mode == "fail_open":
        assert all(r.ok for r in during), [r for r in during if not r.ok][:3]
    else:
        for reply in during:
            assert reply.code == "UNAVAILABLE", reply
            assert reply.status == ("503" if reply.protocol == "http" else "UNAVAILABLE")
            assert "rate-limit storage unavailable" in reply.message, reply.message
            assert "127.0.0.1" not in reply.message  # no internal address for clients
            assert reply.retry_after in (None, "1"), reply  # the next probe, whole seconds

    slowest = max(traffic.replies, key=lambda r: r.seconds)
    assert slowest.seconds <= BOUND_S, slowest
    if failure == "hung":
        # The control: a hung Redis was really waited for, up to the timeout, by the
        # checks that found it hung (each one, until the circuit opened; then each probe).
        assert max(r.seconds for r in during) >= 0.9 * TIMEOUT_S

    # Each check asked Redis and failed with the outage's reason, until the circuit opened
    # (after OPEN_AFTER_S), and was not asked after.
    assert storage_errors(kserve, fe, mode, tenant=TRAFFIC, reason=asked) >= 1
    assert storage_errors(kserve, fe, mode, tenant=TRAFFIC, reason="circuit_open") >= 1

    # Redis answers again (continued, or restarted empty on the same port): the limits count
    # again at the next probe. The probe tenant's 2 a minute end in a 429.
    if failure == "killed":
        redis_process.start()
    probes = await probe_until_refused(kserve, fe)
    assert probes[-1].code == "RESOURCE_EXHAUSTED", probes[-3:]
    assert "2 requests per minute" in probes[-1].message
    assert all(r.seconds <= BOUND_S for r in probes), max(r.seconds for r in probes)


@pytest.mark.parametrize("outage_frontend", ["fail_closed"], indirect=True)
async def test_fail_closed_storage_errors_are_counted(
    outage_frontend: RunningFrontend, redis_process: RedisProcess, kserve: KServe
) -> None:
    fe = outage_frontend
    redis_process.stop()
    urls = (fe.grpc_url, fe.http_url)
    replies = [await kserve.infer("grpc", urls, KEYS[TRAFFIC], "embed", 1, 8) for _ in range(3)]
    assert [r.code for r in replies] == ["UNAVAILABLE"] * 3
    assert storage_errors(kserve, fe, "fail_closed") == 3
