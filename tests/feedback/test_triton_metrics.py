"""Parsing Triton's metrics, deltas with counter resets, and the scraper's failure handling.

The parser and tracker run on text in Triton's exact format. The scraper's failures
(errors, hangs, garbage, a listener that raises) need an endpoint that misbehaves on
demand, which a real Triton cannot be made to do: a small aiohttp server on a free port
plays it. The real Triton is in ``test_against_triton.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from fair_frontend.backends.triton.embedded import free_port
from fair_frontend.backends.triton.metrics import (
    TENANT_ROWS,
    TENANT_TOKENS,
    CounterTracker,
    TenantUsage,
    TritonMetrics,
    parse_metrics,
)
from fair_frontend.feedback import TritonDelta
from python_backend import metering


def triton_text(
    *,
    execs: int = 0,
    items: int = 0,
    success: int = 0,
    compute_us: int = 0,
    queue_us: int = 0,
    pending: int = 0,
    version2_execs: int = 0,
    tenants: dict[str, tuple[int, int]] | None = None,
) -> str:
    """A metrics page in Triton 2.51's format for models ``embed`` (two versions), ``other``."""
    lines = [
        "# HELP nv_inference_request_success Number of successful inference requests, "
        "all batch sizes",
        "# TYPE nv_inference_request_success counter",
        f'nv_inference_request_success{{model="embed",version="1"}} {success}',
        'nv_inference_request_success{model="other",version="1"} 7',
        "# HELP nv_inference_request_failure Number of failed inference requests, all batch sizes",
        "# TYPE nv_inference_request_failure counter",
        'nv_inference_request_failure{model="embed",reason="BACKEND",version="1"} 1',
        'nv_inference_request_failure{model="embed",reason="REJECTED",version="1"} 2',
        "# TYPE nv_inference_count counter",
        f'nv_inference_count{{model="embed",version="1"}} {items}',
        "# TYPE nv_inference_exec_count counter",
        f'nv_inference_exec_count{{model="embed",version="1"}} {execs}',
        f'nv_inference_exec_count{{model="embed",version="2"}} {version2_execs}',
        'nv_inference_exec_count{model="other",version="1"} 7',
        "# TYPE nv_inference_request_duration_us counter",
        f'nv_inference_request_duration_us{{model="embed",version="1"}} {compute_us + queue_us}',
        "# TYPE nv_inference_queue_duration_us counter",
        f'nv_inference_queue_duration_us{{model="embed",version="1"}} {queue_us}',
        "# TYPE nv_inference_compute_infer_duration_us counter",
        f'nv_inference_compute_infer_duration_us{{model="embed",version="1"}} {compute_us}',
        "# TYPE nv_inference_pending_request_count gauge",
        f'nv_inference_pending_request_count{{model="embed",version="1"}} {pending}',
        "# HELP nv_cpu_utilization CPU utilization rate [0.0 - 1.0]",
        "# TYPE nv_cpu_utilization gauge",
        "nv_cpu_utilization 0.5",
    ]
    if tenants is not None:
        lines += ["# TYPE fair_model_rows_total counter"]
        lines += [
            f'fair_model_rows_total{{model="embed",tenant="{t}"}} {r}'
            for t, (r, _) in tenants.items()
        ]
        lines += ["# TYPE fair_model_tokens_total counter"]
        lines += [
            f'fair_model_tokens_total{{model="embed",tenant="{t}"}} {k}'
            for t, (_, k) in tenants.items()
        ]
    return "\n".join(lines) + "\n"


def test_family_names_match_the_models_metering() -> None:
    assert metering.ROWS_FAMILY == TENANT_ROWS + "_total"
    assert metering.TOKENS_FAMILY == TENANT_TOKENS + "_total"


def test_parse_sums_versions_and_labels_per_model() -> None:
    snap = parse_metrics(
        triton_text(
            execs=10,
            version2_execs=5,
            items=80,
            success=10,
            compute_us=1000,
            pending=3,
            tenants={"acme": (5, 500), "globex": (3, 30)},
        )
    )
    assert set(snap) == {"embed", "other"}
    embed = snap["embed"]
    assert embed.counters["exec_count"] == 15
    assert embed.counters["request_failure"] == 3
    assert embed.counters["compute_infer_us"] == 1000
    assert embed.pending == 3
    assert embed.tenant_totals() == {
        "acme": TenantUsage(5, 500),
        "globex": TenantUsage(3, 30),
    }
    assert snap["other"].counters["exec_count"] == 7 and not snap["other"].has_tenants


def test_parse_rejects_garbage() -> None:
    with pytest.raises(ValueError):
        parse_metrics("this is { not prometheus\n")


def test_deltas_between_scrapes() -> None:
    tracker = CounterTracker()
    first = parse_metrics(triton_text(execs=10, items=80, success=10, compute_us=5000))
    assert tracker.update(first, 1.0) == []  # a baseline only
    second = parse_metrics(
        triton_text(execs=15, items=120, success=20, compute_us=9000, queue_us=300, pending=2)
    )
    deltas = {d.model: d for d in tracker.update(second, 2.5)}
    d = deltas["embed"]
    assert (d.exec_count, d.inference_count, d.request_success) == (5, 40, 10)
    assert d.interval_s == 1.5 and d.at == 2.5
    assert d.compute_infer_us == 4000 and d.queue_us == 300 and d.pending_requests == 2
    assert d.seconds_per_exec == pytest.approx(4000 / 1e6 / 10)
    assert not d.reset and d.rows is None
    assert deltas["other"].exec_count == 0


def test_a_counter_that_goes_down_is_a_reset_not_a_negative_delta() -> None:
    tracker = CounterTracker()
    tracker.update(parse_metrics(triton_text(execs=1000, items=8000, success=1000)), 1.0)
    # Triton restarted in between: it has counted 4 executions since.
    after = parse_metrics(triton_text(execs=4, items=32, success=4, compute_us=40_000))
    (d,) = [d for d in tracker.update(after, 2.0) if d.model == "embed"]
    assert d.reset
    assert (d.exec_count, d.inference_count, d.request_success) == (4, 32, 4)
    assert d.compute_infer_us == 40_000
    # And from there, ordinary deltas again.
    later = parse_metrics(triton_text(execs=6, items=48, success=6, compute_us=60_000))
    (d,) = [d for d in tracker.update(later, 3.0) if d.model == "embed"]
    assert not d.reset and d.exec_count == 2


def test_tenant_counters_reset_on_their_own() -> None:
    tracker = CounterTracker()
    tracker.update(parse_metrics(triton_text(tenants={"a": (100, 1000)})), 1.0)
    # The model was reloaded: its own counters restart while Triton's did not go down.
    (d,) = [
        d
        for d in tracker.update(parse_metrics(triton_text(tenants={"a": (2, 20)})), 2.0)
        if d.model == "embed"
    ]
    assert (d.rows, d.tokens) == (2, 20)


def test_a_model_that_disappears_starts_from_a_new_baseline() -> None:
    tracker = CounterTracker()
    tracker.update(parse_metrics(triton_text(execs=10)), 1.0)
    gone = parse_metrics(triton_text(execs=10).replace('model="embed"', 'model="renamed"'))
    assert all(d.model != "embed" for d in tracker.update(gone, 2.0))
    back = parse_metrics(triton_text(execs=15))
    assert all(d.model != "embed" for d in tracker.update(back, 3.0))  # baseline again
    (d,) = [
        d for d in tracker.update(parse_metrics(triton_text(execs=18)), 4.0) if d.model == "embed"
    ]
    assert d.exec_count == 3


# ---- the scraper, against an endpoint that misbehaves on demand ------------------------


@dataclass
class FakeEndpoint:
    """What the fake metrics endpoint answers next: a page, an HTTP error, or a hang."""

    text: str = field(default_factory=triton_text)
    status: int = 200
    hang: bool = False
    url: str = ""
    release: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: web.Request) -> web.Response:
        if self.hang:
            await self.release.wait()
        return web.Response(text=self.text, status=self.status)


@pytest.fixture
async def endpoint() -> AsyncIterator[FakeEndpoint]:
    fake = FakeEndpoint()
    app = web.Application()
    app.router.add_get("/metrics", fake.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    fake.url = f"http://127.0.0.1:{port}/metrics"
    try:
        yield fake
    finally:
        fake.release.set()
        await runner.cleanup()


async def test_scrapes_report_deltas_and_tenant_totals(endpoint: FakeEndpoint) -> None:
    seen: list[TritonDelta] = []
    attempts: list[bool] = []
    async with TritonMetrics(
        endpoint.url,
        interval_s=1.0,
        on_delta=seen.append,
        on_scrape=lambda at, ok: attempts.append(ok),
    ) as metrics:
        endpoint.text = triton_text(execs=1, tenants={"acme": (1, 10)})
        assert await metrics.scrape_once()
        endpoint.text = triton_text(execs=5, items=40, success=4, tenants={"acme": (9, 90)})
        assert await metrics.scrape_once()
        assert metrics.tenant_totals("embed") == {"acme": TenantUsage(9, 90)}
        assert metrics.tenant_totals("nobody") == {}
        assert metrics.models() == ["embed", "other"]
    (d,) = [d for d in seen if d.model == "embed"]
    assert (d.exec_count, d.inference_count, d.rows, d.tokens) == (4, 40, 8, 80)
    assert attempts == [True, True]
    assert metrics.status().scrapes == 2


async def test_failures_are_counted_and_never_raised(endpoint: FakeEndpoint) -> None:
    attempts: list[bool] = []
    async with TritonMetrics(
        endpoint.url, interval_s=1.0, timeout_s=0.2, on_scrape=lambda at, ok: attempts.append(ok)
    ) as metrics:
        endpoint.status = 500
        assert not await metrics.scrape_once()
        endpoint.status, endpoint.text = 200, "garbage { here\n"
        assert not await metrics.scrape_once()
        endpoint.text, endpoint.hang = triton_text(), True
        assert not await metrics.scrape_once()  # times out after 0.2 s
        status = metrics.status()
        assert (status.failures, status.consecutive_failures, status.scrapes) == (3, 3, 0)
        assert "TimeoutError" in (status.last_error or "")
        endpoint.hang = False
        endpoint.release.set()
        assert await metrics.scrape_once()
        status = metrics.status()
        assert (status.failures, status.consecutive_failures, status.scrapes) == (3, 0, 1)
        assert status.last_error is None
    assert attempts == [False, False, False, True]


async def test_connection_refused_is_a_failure() -> None:
    async with TritonMetrics(f"http://127.0.0.1:{free_port()}/metrics", timeout_s=0.5) as metrics:
        assert not await metrics.scrape_once()
        assert metrics.status().failures == 1


async def test_the_loop_survives_failures_and_a_listener_that_raises(
    endpoint: FakeEndpoint,
) -> None:
    calls: list[bool] = []
    got_delta = asyncio.Event()

    def broken_listener(delta: TritonDelta) -> None:
        got_delta.set()
        raise RuntimeError("listener bug")

    def on_scrape(at: float, ok: bool) -> None:
        calls.append(ok)

    metrics = TritonMetrics(
        endpoint.url, interval_s=0.02, on_delta=broken_listener, on_scrape=on_scrape
    )
    endpoint.status = 503
    task = metrics.start()
    try:
        async with asyncio.timeout(10):
            while len(calls) < 3:  # poll: three failed attempts in a row
                await asyncio.sleep(0.01)
            endpoint.status = 200
            await got_delta.wait()
            while calls[-1] is not True or metrics.status().scrapes < 3:
                await asyncio.sleep(0.01)
        assert not task.done()  # the listener raised; the loop goes on
        assert metrics.status().failures >= 3
    finally:
        await metrics.stop()
    assert task.done()
