"""The early-reject throttle on the real stack: real Triton, the real frontend, real clients.

``embed`` with ``throttle: true`` and a tight ``latency_target_ms`` (300 ms, a handful of
full batches on these CPUs). An idle system admits everything. Then one tenant floods
``embed`` with full-batch requests at about three times what Triton serves (measured in the
same test, from the idle trickle): new work of that tenant whose predicted wait exceeds the
target is answered at once, 503 / UNAVAILABLE with a retry hint and a message giving the
predicted wait and the target, while a tenant of a higher tier, with a short queue ahead,
is admitted; and what the throttle admits is answered near its target.

(A quiet tenant of the flooder's own tier is not asserted on: the scheduler counts the
flooder's DRR share ahead of it, about two batches, so with batches slowed down by the
neighbours its predicted wait can honestly exceed a target of a few batches.)

How near its target an admitted request was answered comes from the request log
(``fair_frontend.requests``, written by the core in this process): its latency from its
arrival to its answer, not the client's, whose own lag on a loaded machine is no part of
what the throttle decides; a refusal is judged beside what was admitted in the same flood.
The latency assertions are loose on purpose: these 2 shared cores change speed under the
neighbours' load, and the throttle predicts from batch times measured a moment earlier.
``benchmarks/bench_overload.py`` measures how well it holds the target.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import random
import re
import statistics
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fair_frontend.admission import ThrottleDecision, overloaded_error
from fair_frontend.config import parse_config
from fair_frontend.kit.testing import aeventually
from fair_frontend.observability.logs import REQUEST_LOGGER
from tests.support import (
    KEYS,
    TIERS,
    Answer,
    RunningFrontend,
    config_dict,
    connect,
    read_answer,
    running_frontend,
    send_head,
)

if TYPE_CHECKING:
    from tests.support import KServe, Reply

TARGET_S = 0.3
SERVICE_DATA_S = 30.0  # a served batch's report reaches the core (a loaded machine's)
ROWS, TOKENS = 32, 128  # one request = one full embed batch (32 rows, 4096 tokens)
FLOOD_S = 3.0
OVERLOAD = 3.0  # offered load / measured capacity
FLOODER = "initech"  # standard tier
HIGHER = "acme"  # enterprise: above the flooder's tier
OVERLOADED = re.compile(
    r"^Server overloaded on model 'embed': predicted wait (\d+\.\d+) s exceeds the latency "
    r"target of (0\.30*) s; retry after \d+\.\d\d s$"
)


@pytest.fixture
def throttled(triton: Any, workers: int) -> Iterator[RunningFrontend]:
    data = config_dict()
    data["endpoints"]["embed"].update(throttle=True, latency_target_ms=TARGET_S * 1000)
    data["observability"] = {"request_log": "core"}  # the oracle: the core's every record
    with running_frontend(parse_config(data), triton, workers=workers) as fe:
        yield fe


def decisions(kserve: KServe, fe: RunningFrontend, decision: str) -> float:
    return kserve.counter(
        fe.metrics_url, "fair_throttle_decisions", endpoint="embed", decision=decision
    )


async def trickle(kserve: KServe, fe: RunningFrontend, count: int = 12) -> float:
    """One request at a time, nothing rejected; returns the median time of one (a full
    batch served alone: the capacity is about one request per that time).

    After the first, the core has learned from its batch before the next is sent: a
    one-hop shell answers its client, then reports the rows served, so the next request,
    through the other shell, may reach the core before that report does."""
    urls = (fe.grpc_url, fe.http_url)
    replies = []
    for i in range(count):
        protocol = ("grpc", "http")[i % 2]
        replies.append(await kserve.infer(protocol, urls, KEYS[FLOODER], "embed", ROWS, TOKENS))
        if i == 0:
            await aeventually(
                lambda: (
                    kserve.counter(
                        fe.metrics_url, "fair_service_source", endpoint="embed", source="default"
                    )
                    == 0
                ),
                SERVICE_DATA_S,
                0.02,
                what="the core's service estimates from the first batch",
            )
    assert all(r.ok for r in replies), [r for r in replies if not r.ok][:2]
    return statistics.median(r.seconds for r in replies[2:])


async def open_loop(
    kserve: KServe,
    fe: RunningFrontend,
    rates: dict[str, float],
    seconds: float,
    *,
    rows: dict[str, int] | None = None,
    even: frozenset[str] = frozenset(),
) -> dict[str, list[Reply]]:
    """Poisson arrivals per tenant (requests/s; evenly spaced for the tenants in ``even``)
    for ``seconds``, all sent on schedule over gRPC, every 4th HTTP (JSON costs the client
    more); each request ``rows`` rows (default: ROWS, a full batch); every reply, by
    tenant."""
    urls = (fe.grpc_url, fe.http_url)
    rng = random.Random(7)
    arrivals: list[tuple[float, str]] = []
    for tenant, rate in rates.items():
        at = 1 / rate if tenant in even else rng.expovariate(rate)
        while at < seconds:
            arrivals.append((at, tenant))
            at += 1 / rate if tenant in even else rng.expovariate(rate)
    arrivals.sort()
    tasks: dict[str, list[asyncio.Task[Reply]]] = {tenant: [] for tenant in rates}
    loop = asyncio.get_running_loop()
    start = loop.time()
    for n, (at, tenant) in enumerate(arrivals):
        await asyncio.sleep(max(0.0, start + at - loop.time()))  # the schedule, not a server
        protocol = "http" if n % 4 == 3 else "grpc"
        size = (rows or {}).get(tenant, ROWS)
        tasks[tenant].append(
            asyncio.create_task(kserve.infer(protocol, urls, KEYS[tenant], "embed", size, TOKENS))
        )
    return {tenant: list(await asyncio.gather(*ts)) for tenant, ts in tasks.items()}


def request_log(caplog: pytest.LogCaptureFixture, tenant: str | None, outcome: str) -> list[Any]:
    """The request log's records of ``tenant``'s ``embed`` requests with ``outcome``: the
    core's, and the shell's where it runs in this process (each with ``latency_ms``, from
    the request's arrival to its answer; ``queued_ms`` where it was queued)."""
    return [
        r
        for r in caplog.records
        if r.name == REQUEST_LOGGER
        and getattr(r, "endpoint", None) == "embed"
        and (tenant is None or getattr(r, "tenant", None) == tenant)
        and getattr(r, "outcome", None) == outcome
    ]


async def recorded(caplog: pytest.LogCaptureFixture, tenant: str | None, count: int) -> list[Any]:
    """``tenant``'s (None: every tenant's) ``dispatched`` records once there are ``count``,
    no more: a record is written where the outcome is known, which in one-hop mode is the
    core, when the shell's report of the batch arrives, and that can be after the shell
    answered its client."""
    found: list[Any] | Literal[False] = await aeventually(
        lambda: len(log := request_log(caplog, tenant, "dispatched")) >= count and log,
        20.0,
        what=f"{count} dispatched records of {tenant or 'every tenant'}",
    )
    assert found  # aeventually returns only a truthy value: the list
    assert len(found) == count, (len(found), count)
    return found


def near_target(latencies_ms: list[float], target_s: float = TARGET_S) -> dict[str, float]:
    """Fractions of admitted requests answered within 1, 1.5 and 2 times the target."""
    return {
        f"within {k}x target": round(
            sum(ms <= k * target_s * 1e3 for ms in latencies_ms) / len(latencies_ms), 2
        )
        for k in (1, 1.5, 2)
    }


def work_ahead_s(served: list[Any], dispatched: list[Any], service_s: float) -> list[float]:
    """Each admitted request's wait in the machine's solo time: the work dispatched from
    its arrival to its own dispatch, itself included (any tenant's, in full batches: a
    record's prompt tokens over a full batch's), each full batch taking ``service_s``, as
    one did alone; plus one batch, the one in Triton when it arrived.

    What the throttle decides is how much work may be ahead of an admitted request: the
    wall clock times that by the speed of the batches, which on these 2 shared cores
    changes fourfold from one moment to the next under the neighbours' load (a full-suite
    run beside two CPU hogs answered a quarter of the lower tier's admissions after 4.1-4.6
    s against a 1 s target, the batches as slow). In work ahead the throttle's choice is
    judged, not the machine's speed; a throttle that did not count the higher tier's
    arrivals (they pass the lower tier in the queue) still fails it."""
    batch_tokens = ROWS * TOKENS
    events = sorted(
        (r.created - r.service_ms / 1e3, r.tokens_in / batch_tokens) for r in dispatched
    )
    times = [at for at, _ in events]
    sums = list(itertools.accumulate((w for _, w in events), initial=0.0))
    waits = []
    for r in served:
        arrived = r.created - r.latency_ms / 1e3
        sent = r.created - r.service_ms / 1e3
        first = bisect.bisect_right(times, arrived)
        last = bisect.bisect_right(times, sent)
        waits.append((sums[last] - sums[first] + 1) * service_s)
    return waits


def assert_near_target(
    served: list[Any],
    dispatched: list[Any],
    service_s: float,
    target_s: float = TARGET_S,
    *,
    tail: float = 0.9,
) -> None:
    """The records of what the throttle admitted (``request_log``): answered near the
    target in work ahead (``work_ahead_s``; ``dispatched``: every tenant's dispatched
    records of the same time), not after a queue left to grow (at 3x overload, seconds
    deep by the end of the flood). Loose: the throttle admits up to a prediction of the
    target from the batch times just measured, so a fraction of what it admits lands just
    over it (measured: 20-100 % within the target, one tier)."""
    assert served, "nothing was admitted"
    waits_ms = [s * 1e3 for s in work_ahead_s(served, dispatched, service_s)]
    summary = near_target(waits_ms, target_s)
    slowest = sorted(zip(waits_ms, [r.latency_ms for r in served], strict=True))[-5:]
    assert summary["within 1.5x target"] >= 0.5, (summary, slowest, service_s)
    assert summary["within 2x target"] >= tail, (summary, slowest, service_s)


async def test_throttle_admits_idle_traffic_and_rejects_a_flood_early(
    throttled: RunningFrontend, kserve: KServe, caplog: pytest.LogCaptureFixture
) -> None:
    fe = throttled
    caplog.set_level(logging.INFO, logger=REQUEST_LOGGER)

    # ---- idle: a trickle, one request at a time, nothing rejected --------------------------
    service_s = await trickle(kserve, fe)
    # The throttle did decide (with service data after the first batch), and admitted all.
    assert decisions(kserve, fe, "over_target") == 0
    assert decisions(kserve, fe, "no_service_data") <= 1
    assert decisions(kserve, fe, "short_queue") + decisions(kserve, fe, "within_target") >= 11

    # ---- a flood of one tenant; the higher tier now and then ---------------------------------
    # The higher tier's requests are one row each, evenly spaced: its own queue stays
    # short (within the throttle's short-queue batches) however slow a loaded machine
    # makes the batches, so only the flooder's queue, which strict priority puts behind
    # it, could refuse it.
    capacity = 1 / service_s  # full-batch requests per second
    caplog.clear()
    replies = await open_loop(
        kserve,
        fe,
        {FLOODER: min(200.0, OVERLOAD * capacity), HIGHER: 3.0},
        FLOOD_S,
        rows={HIGHER: 1},
        even=frozenset({HIGHER}),
    )
    flood, higher = replies[FLOODER], replies[HIGHER]
    admitted = [r for r in flood if r.ok]
    rejected = [r for r in flood if not r.ok]
    assert len(rejected) >= 0.3 * len(flood), (len(rejected), len(flood), service_s)
    for protocol in ("grpc", "http"):
        assert any(r.protocol == protocol for r in rejected), f"no rejection over {protocol}"
    for reply in rejected:
        assert reply.code == "UNAVAILABLE", reply
        assert reply.status == ("503" if reply.protocol == "http" else "UNAVAILABLE"), reply
        match = OVERLOADED.match(reply.message)
        assert match, reply.message
        # The message never says a wait exceeds an equal target ("0.30 s ... 0.30 s").
        assert float(match.group(1)) > float(match.group(2)), reply.message
        assert reply.retry_after is not None and int(reply.retry_after) >= 1, reply
    # Rejected at admission: never queued (no refusal in the request log has a queue
    # wait), and answered far sooner than what was admitted in the same flood (the same
    # clients: a loaded machine delays both alike). Refused after queueing, they would
    # wait as long.
    refusals = request_log(caplog, FLOODER, "rejected_overload")
    assert not [r for r in refusals if hasattr(r, "queued_ms")], "refused after queueing"
    rejected_s = statistics.median(r.seconds for r in rejected)
    assert rejected_s < statistics.median(r.seconds for r in admitted) / 2, rejected_s

    # A short queue ahead: the higher tier is admitted while the flooder is turned away.
    assert len(higher) >= 3
    assert all(r.ok for r in higher), [r for r in higher if not r.ok][:2]

    # Each admitted one recorded, once.
    served = await recorded(caplog, FLOODER, len(admitted))
    dispatched = await recorded(caplog, None, len(admitted) + len(higher))
    assert_near_target(served, dispatched, service_s)


LOWER_TIER_TARGET_S = 1.0  # room for the higher tier's Poisson bursts (full batches)


@pytest.fixture
def throttled_1s(triton: Any, workers: int) -> Iterator[RunningFrontend]:
    data = config_dict()
    data["endpoints"]["embed"].update(throttle=True, latency_target_ms=LOWER_TIER_TARGET_S * 1e3)
    data["observability"] = {"request_log": "core"}  # the oracle: the core's every record
    with running_frontend(parse_config(data), triton, workers=workers) as fe:
        yield fe


async def test_a_lower_tier_is_admitted_near_its_target_while_a_higher_tier_is_busy(
    throttled_1s: RunningFrontend, kserve: KServe, caplog: pytest.LogCaptureFixture
) -> None:
    """The higher tier alone offers half the capacity, evenly spaced (all admitted: short
    queues, strict priority; evenly, so that its own queue stays short unless the machine
    slows down by half after the capacity was measured); the lower tier floods. What the
    throttle admits of the lower tier should be answered as near its target as in one
    tier (``assert_near_target``): the throttle stretches a lower tier's predicted wait by
    the higher tiers' recent share. Without that, it was admitted for about twice its
    target."""
    fe = throttled_1s
    caplog.set_level(logging.INFO, logger=REQUEST_LOGGER)
    # The flood and the higher tier's half are sized by the capacity measured just before
    # them. Where the machine's speed changed between the two (fresh clones beside CPU
    # hogs: 237 of 381 admitted, the flood was not one; or a higher-tier request refused,
    # its half was more than half), or the admitted missed their target by a hair (a
    # fresh clone beside three other test runs: 0.74 within 2x, the tail asks 0.75), the
    # scenario is measured again, up to three times. A throttle that does not stretch the
    # lower tier's wait admits it for about twice its target every time.
    missed: AssertionError | None = None
    for _ in range(3):
        service_s = await trickle(kserve, fe)
        capacity = 1 / service_s
        caplog.clear()
        replies = await open_loop(
            kserve,
            fe,
            {HIGHER: 0.5 * capacity, FLOODER: min(200.0, 2.5 * capacity)},
            3 * FLOOD_S,
            even=frozenset({HIGHER}),
        )
        refused = [r for r in replies[HIGHER] if not r.ok]
        lower = [r for r in replies[FLOODER] if r.ok]
        # The higher tier's half all admitted, the flood really throttled.
        if refused or len(lower) >= 0.5 * len(replies[FLOODER]):
            continue
        # The tail is looser than in one tier: the lower tier gets what the higher one
        # leaves, a few dozen admissions here, and one burst of the higher tier's Poisson
        # arrivals just after a decision delays the three or four the throttle admitted
        # then (seen in a full-suite run: 0.8 within 2x, all four late ones at 2.3-2.5 s,
        # 0.65 within 1x).
        served = await recorded(caplog, FLOODER, len(lower))
        dispatched = await recorded(caplog, None, len(lower) + len(replies[HIGHER]))
        try:
            assert_near_target(served, dispatched, service_s, LOWER_TIER_TARGET_S, tail=0.75)
        except AssertionError as err:
            missed = err
            continue
        return
    if missed is not None:
        raise missed
    pytest.fail(
        f"no try held its calibration: the higher tier refused {refused[:2]}, the flood "
        f"admitted {len(lower)} of {len(replies[FLOODER])}"
    )


@given(
    target_ms=st.integers(min_value=1, max_value=60_000),
    over=st.floats(min_value=1e-9, max_value=5.0),
)
def test_the_overload_message_tells_the_wait_from_the_target(target_ms: int, over: float) -> None:
    """Found through the frontend: "predicted wait 0.30 s exceeds the latency target of
    0.30 s". A wait just over its target must read as larger."""
    target = target_ms / 1000
    wait = target + over * target
    decision = ThrottleDecision(False, wait, target, 3, "over target", False, wait - target)
    message = overloaded_error(decision, "embed").message
    found = re.search(r"predicted wait (\d+(?:\.\d+)?) s exceeds the latency target of "
                      r"(\d+(?:\.\d+)?) s", message)  # fmt: skip
    assert found, message
    if wait - target >= 1e-6:
        assert float(found.group(1)) > float(found.group(2)), message


async def test_a_tier_the_throttle_closed_is_refused_by_the_shell_from_its_headers(
    throttled: RunningFrontend, kserve: KServe
) -> None:
    """The higher tier floods ``embed``: its queue, at about the target, is ahead of any
    request of a lower tier, so even the lower tier's most favourable request would be
    refused, and the core tells the shells so (``QueueView.overloaded``). A lower-tier
    request is then refused from its headers, before its body is sent (the core never
    sees it), with the core's 503, message and Retry-After; and counted as the core
    counts its own refusals."""
    fe = throttled
    capacity = 1 / await trickle(kserve, fe)
    before = kserve.counter(
        fe.metrics_url, "fair_requests", tenant=FLOODER, outcome="rejected_overload"
    )
    probe_headers = {"authorization": f"Bearer {KEYS[FLOODER]}", "Content-Length": "2000"}

    def probe() -> Answer | None:
        """A lower-tier request whose body never comes: answered only if refused from its
        headers (None: the shell waited for the body)."""
        with connect(fe.http_url) as sock:
            sock.settimeout(1.0)
            send_head(sock, "/v2/models/embed/infer", probe_headers)
            try:
                return read_answer(sock)
            except TimeoutError:
                return None

    def closed() -> bool:
        """Has the core closed the lower tier on embed (read from this thread: a dict
        lookup)? What the shells then refuse from headers."""
        return fe.frontend.shedding.overloaded(TIERS[FLOODER], "embed") is not None

    async def probes() -> list[Answer | None]:
        # The higher tier's queue builds up until the core closes the lower tier; then
        # probes, until three are refused or the flood is over (at most ten).
        await aeventually(closed, 30, 0.01, what="the throttle to close the lower tier")
        out: list[Answer | None] = []
        while len(out) < 10 and sum(a is not None for a in out) < 3 and not flood.done():
            out.append(await asyncio.to_thread(probe))
            await asyncio.sleep(0.05)  # pacing the probes, not waiting for a server
        return out

    flood = asyncio.create_task(
        open_loop(kserve, fe, {HIGHER: min(200.0, OVERLOAD * capacity)}, FLOOD_S)
    )
    answers = await probes()
    await flood
    refused = [a for a in answers if a is not None]
    assert len(refused) >= 3, answers
    for answer in refused:
        assert answer.status == 503, answer
        match = OVERLOADED.match(answer.error)
        assert match, answer.error
        assert float(match.group(1)) > float(match.group(2)), answer.error
        assert int(answer.headers["retry-after"]) >= 1, answer
    after = kserve.counter(
        fe.metrics_url, "fair_requests", tenant=FLOODER, outcome="rejected_overload"
    )
    assert after - before == len(refused)
