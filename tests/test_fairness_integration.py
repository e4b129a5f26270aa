"""The fair scheduler on the real stack: bursts, tiers, priorities, deadlines, caps.

These tests count *order*, not time: how many of a noisy tenant's requests finish while
a quiet tenant's request waits. That is what a burst costs the quiet tenant, and it does
not depend on how fast these shared machines happen to be today.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from fair_frontend.testing import aeventually
from tests.support import KEYS, RunningFrontend, ids_input, make_config, running_frontend

TOKENS = 512  # 8 rows x 512 tokens = one full embed batch (max_batch_tokens 4096)
ROWS_PER_BATCH = 8
# The flood reaching the frontend: a second or two here; far above that, a hang fails.
FLOOD_ARRIVAL_S = 60.0


@pytest.fixture(params=["fair", "fifo"])
def mode_frontend(
    request: pytest.FixtureRequest, triton: Any, workers: int
) -> Iterator[RunningFrontend]:
    config = make_config(scheduling=request.param)
    with running_frontend(config, triton, workers=workers) as running:
        yield running


def _ids() -> np.ndarray:
    return np.full((1, TOKENS), 7, dtype=np.int32)


class Tracker:
    """Client-side completion order of one tenant's requests."""

    def __init__(self) -> None:
        self.done = 0
        self.errors: list[BaseException] = []

    async def send(self, client: grpcaio.InferenceServerClient, tenant: str, **kw: Any) -> Any:
        try:
            return await client.infer(
                "embed", [ids_input(grpcaio, _ids())], headers={"x-api-key": KEYS[tenant]}, **kw
            )
        except BaseException as err:
            self.errors.append(err)
            raise
        finally:
            self.done += 1


async def _queued(fe: RunningFrontend, tenant: str) -> int:
    runtime = fe.frontend.runtimes.get("embed")
    return 0 if runtime is None else runtime.scheduler.depth(tenant)


async def _inflight(fe: RunningFrontend) -> int:
    runtime = fe.frontend.runtimes.get("embed")
    return 0 if runtime is None else runtime.inflight


async def _flood_then_probe(
    fe: RunningFrontend, noisy: str, quiet: str, flood: int, **probe_kw: Any
) -> tuple[int, int, Any]:
    """Flood with ``noisy``, then send one ``quiet`` request once the flood is queued.

    Returns (noisy requests queued when the probe was sent, noisy requests that finished
    while the probe waited, the probe's result or exception, the bound on those: the
    batches in Triton when the probe was sent (two within ``dispatch_lead_ms`` of a
    batch's predicted end: the early send) and the probe's own, in requests).
    """
    client = grpcaio.InferenceServerClient(fe.grpc_url)
    probe_client = grpcaio.InferenceServerClient(fe.grpc_url)
    tracker = Tracker()
    try:
        tasks = [asyncio.ensure_future(tracker.send(client, noisy)) for _ in range(flood)]

        async def arrived() -> tuple[int] | None:
            # Every flood request has arrived: queued, in the batch in flight, or answered.
            queued = await fe.acall(_queued(fe, noisy))
            return (queued,) if queued + tracker.done >= flood - ROWS_PER_BATCH else None

        what = f"{noisy}'s flood to arrive"
        (queued,) = await aeventually(arrived, FLOOD_ARRIVAL_S, 0.005, what=what)
        done_before = tracker.done
        bound = (max(1, await fe.acall(_inflight(fe))) + 1) * ROWS_PER_BATCH
        probe: Any
        try:
            probe = await probe_client.infer(
                "embed",
                [ids_input(grpcaio, _ids())],
                headers={"x-api-key": KEYS[quiet]},
                **probe_kw,
            )
        except InferenceServerException as err:
            probe = err
        finished_meanwhile = tracker.done - done_before
        await asyncio.gather(*tasks, return_exceptions=True)
        assert not tracker.errors, tracker.errors[:3]
        return queued, finished_meanwhile, probe, bound
    finally:
        await client.close()
        await probe_client.close()


async def test_a_burst_does_not_delay_another_tenant_beyond_one_batch(mode_frontend) -> None:  # type: ignore[no-untyped-def]
    """Same tier: the quiet tenant's request goes in the next batch, whatever is queued.

    In fifo mode (the negative control) it waits behind the whole burst instead.
    """
    fe = mode_frontend
    queued, finished, probe, bound = await _flood_then_probe(fe, "initech", "hooli", flood=240)
    assert not isinstance(probe, Exception), probe
    assert queued >= 4 * ROWS_PER_BATCH, f"the flood drained before the probe ({queued} queued)"
    # Fair: the batches running when the probe arrived, plus the rest of the probe's own
    # batch (filled with the flood's rows, work-conserving).
    if fe.server.config.scheduling == "fair":
        assert finished <= bound, f"{finished} flood requests finished first"
    else:
        assert finished >= queued - bound, f"fifo should serve the burst first ({finished})"


async def test_higher_tier_goes_first(frontend) -> None:  # type: ignore[no-untyped-def]
    # umbrella is trial, acme enterprise: the enterprise request overtakes trial's backlog.
    queued, finished, probe, bound = await _flood_then_probe(
        frontend, "umbrella", "acme", flood=240
    )
    assert not isinstance(probe, Exception), probe
    assert queued >= 4 * ROWS_PER_BATCH
    assert finished <= bound


async def test_priority_overtakes_within_a_tenant(frontend) -> None:  # type: ignore[no-untyped-def]
    queued, finished, probe, bound = await _flood_then_probe(
        frontend, "globex", "globex", flood=240, priority=1
    )
    assert not isinstance(probe, Exception), probe
    assert queued >= 4 * ROWS_PER_BATCH
    assert finished <= bound


async def test_a_queued_request_expires_at_its_deadline(frontend) -> None:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    queued, finished, probe, _ = await _flood_then_probe(
        frontend,
        "initech",
        "initech",
        flood=240,
        timeout=1000,  # 1 ms, microseconds
        # The lowest level: behind the whole flood (earliest-deadline-first alone would put
        # it at the head of its tenant's queue, next in line within the same millisecond).
        priority=10,
    )
    assert isinstance(probe, InferenceServerException)
    assert probe.status() == "StatusCode.UNAVAILABLE"
    assert probe.message() == "Request timeout expired"
    # Answered at its deadline, not when its turn came: most of the flood was still
    # queued behind it.
    assert finished < queued / 2, (finished, queued, time.perf_counter() - t0)


async def test_batches_carry_several_tenants_and_accounting_adds_up(triton, workers: int) -> None:  # type: ignore[no-untyped-def]
    with running_frontend(make_config(), triton, workers=workers) as fe:
        seen: list[dict[str, int]] = []
        observer = fe.frontend.observer
        original = observer.batch_finished

        def record(report: Any) -> None:
            seen.append(dict(report.tenants))
            original(report)

        observer.batch_finished = record
        client = grpcaio.InferenceServerClient(fe.grpc_url)
        tenants = ["acme", "globex", "initech", "hooli"]
        try:
            results = await asyncio.gather(
                *(
                    client.infer(
                        "embed",
                        [ids_input(grpcaio, _ids())],
                        headers={"x-api-key": KEYS[tenants[i % len(tenants)]]},
                    )
                    for i in range(200)
                ),
                return_exceptions=True,
            )
        finally:
            await client.close()
        assert not [r for r in results if isinstance(r, Exception)]
        assert any(len(batch) >= 2 for batch in seen), seen
        assert sum(sum(b.values()) for b in seen) == 200
        counters = await fe.acall(fe.counters("embed"))
        assert counters.admitted == counters.dispatched == 200
        assert counters.expired == counters.cancelled == 0


async def test_a_cancelled_request_leaves_the_queue_and_is_never_sent(triton, workers: int) -> None:  # type: ignore[no-untyped-def]
    with running_frontend(make_config(), triton, workers=workers) as fe:
        client = grpcaio.InferenceServerClient(fe.grpc_url)
        victim_client = grpcaio.InferenceServerClient(fe.grpc_url)
        try:
            flood = [
                asyncio.ensure_future(
                    client.infer(
                        "embed", [ids_input(grpcaio, _ids())], headers={"x-api-key": KEYS["acme"]}
                    )
                )
                for _ in range(320)
            ]
            while await fe.acall(_queued(fe, "acme")) < 4 * ROWS_PER_BATCH:
                await asyncio.sleep(0.005)
            victim = asyncio.ensure_future(
                victim_client.infer(
                    "embed",
                    [ids_input(grpcaio, _ids())],
                    headers={"x-api-key": KEYS["umbrella"]},  # trial: behind all of acme
                )
            )
            while await fe.acall(_queued(fe, "umbrella")) < 1:
                await asyncio.sleep(0.005)
            victim.cancel()
            with pytest.raises(asyncio.CancelledError):
                await victim
            await asyncio.gather(*flood)
        finally:
            await client.close()
            await victim_client.close()

        async def settled() -> Any:
            return fe.frontend.runtimes["embed"].scheduler.counters

        deadline = time.monotonic() + 10
        counters = await fe.acall(settled())
        while counters.cancelled < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
            counters = await fe.acall(settled())
        assert counters.cancelled == 1
        assert counters.dispatched == 320
        assert counters.admitted == 321


async def test_queue_caps_reject_with_the_cap_named(triton, workers: int) -> None:  # type: ignore[no-untyped-def]
    config = make_config()
    data = config.model_dump(mode="json")
    data["tenants"]["hooli"]["max_queued"] = 5
    from fair_frontend.config import parse_config

    with running_frontend(parse_config(data), triton, workers=workers) as fe:
        client = grpcaio.InferenceServerClient(fe.grpc_url)
        try:
            results = await asyncio.gather(
                *(
                    client.infer(
                        "embed", [ids_input(grpcaio, _ids())], headers={"x-api-key": KEYS["hooli"]}
                    )
                    for _ in range(100)
                ),
                return_exceptions=True,
            )
        finally:
            await client.close()
        rejected = [r for r in results if isinstance(r, InferenceServerException)]
        assert rejected, "100 concurrent requests against max_queued=5 must hit the cap"
        for r in rejected:
            assert r.status() == "StatusCode.UNAVAILABLE"
            assert r.message().startswith("Exceeds maximum queue size")
            assert "hooli" in r.message() and "max_queued=5" in r.message()
        served = [r for r in results if not isinstance(r, Exception)]
        assert len(served) + len(rejected) == 100
