"""The fair scheduler on the real stack: bursts, tiers, priorities, deadlines, caps.

These tests count *order*, not time: how many of a noisy tenant's requests the core
dispatches while a quiet tenant's request waits in its queue. That is what a burst costs
the quiet tenant, and it does not depend on how fast these shared machines happen to be
today. The order is the core's own record (``DispatchRecord``: a spy on the model's
scheduler, on the core's loop), not the order in which answers reach the clients. A
flood is queued whole before its probe comes: the core holds the model's batches
meanwhile (``holding``), as a Triton slower than the clients would, whatever the speed
of the machine and of the clients' process.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from fair_frontend.kit.testing import aeventually
from tests.support import KEYS, RunningFrontend, ids_input, make_config, running_frontend

TOKENS = 512  # 8 rows x 512 tokens = one full embed batch (max_batch_tokens 4096)
ROWS_PER_BATCH = 8
FLOOD = 240  # a noisy tenant's calls, all queued before the probe (30 batches)
# The flood reaching the frontend: a second or two here; far above that, a hang fails.
FLOOD_ARRIVAL_S = 60.0
SETTLE_S = 60.0  # bounds every other wait on the core (a hang fails; never a timing)
PROBE_ID = "probe"  # the quiet tenant's request's id (the flood's have none)


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
    """How many of one tenant's requests have been answered (or failed), and the errors."""

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


async def _at_least(fe: RunningFrontend, tenant: str, n: int) -> bool:
    return await fe.acall(_queued(fe, tenant)) >= n


@dataclass(frozen=True)
class Step:
    """One request queued, dispatched (in batch number ``batch``) or ended (``outcome``)."""

    what: str
    request: Any  # the core's request
    batch: int = -1
    outcome: str = ""
    queued: dict[str, int] | None = None  # queued requests per tenant once it was queued

    @property
    def tenant(self) -> str:
        return str(self.request.tenant)


class DispatchRecord:
    """The core's record of one model's requests, in the order its loop handled them: a
    spy on the model's scheduler (``enqueue``, ``next_batch``) and the runtime's
    ``on_done`` and ``on_served`` (a one-hop part's served rows, counted together), put
    in and taken out on the core's own loop (the core runs in this process, whatever the
    number of shells)."""

    def __init__(self, fe: RunningFrontend, model: str) -> None:
        self.fe = fe
        self.model = model
        self.steps: list[Step] = []
        self._restore: Callable[[], None] = lambda: None

    async def install(self) -> None:
        await self.fe.frontend.model_info(self.model)  # its runtime, made before any call
        runtime = self.fe.frontend.runtimes[self.model]
        scheduler = runtime.scheduler
        enqueue, next_batch, on_done = scheduler.enqueue, scheduler.next_batch, runtime.on_done
        on_served = runtime.on_served
        batches = iter(range(1 << 62))

        def spied_enqueue(req: Any, now: float) -> None:
            enqueue(req, now)
            self.steps.append(Step("queued", req, queued=scheduler.depths()))

        def spied_next_batch(now: float) -> list[Any]:
            batch: list[Any] = next_batch(now)
            number = next(batches)
            self.steps += [Step("dispatched", req, batch=number) for req in batch]
            return batch

        def spied_on_done(req: Any, outcome: Any, err: Any, version: str) -> None:
            on_done(req, outcome, err, version)
            self.steps.append(Step("ended", req, outcome=outcome.value))

        def spied_on_served(reqs: Any, version: str) -> None:  # a part's served rows
            on_served(reqs, version)
            self.steps += [Step("ended", req, outcome="dispatched") for req in reqs]

        scheduler.enqueue, scheduler.next_batch, runtime.on_done, runtime.on_served = (
            spied_enqueue,
            spied_next_batch,
            spied_on_done,
            spied_on_served,
        )

        def restore() -> None:
            del scheduler.enqueue, scheduler.next_batch
            runtime.on_done, runtime.on_served = on_done, on_served

        self._restore = restore

    async def remove(self) -> None:
        self._restore()

    def settled(self) -> bool:
        """Every request queued since the spy went in has ended."""
        steps = list(self.steps)
        return sum(s.what == "ended" for s in steps) == sum(s.what == "queued" for s in steps)


@contextlib.asynccontextmanager
async def recording(fe: RunningFrontend, model: str = "embed") -> AsyncIterator[DispatchRecord]:
    record = DispatchRecord(fe, model)
    await fe.acall(record.install())
    try:
        yield record
    finally:
        await fe.acall(record.remove())


@dataclass(frozen=True)
class Probe:
    """What a burst cost one request sent in the middle of it, in the core's order."""

    result: Any  # the probe's answer, or the exception it got
    queued: int  # the noisy tenant's requests queued when the probe was queued
    ahead: int  # ... of them dispatched after the probe was queued, before it (or its end)
    outcome: str  # the probe's outcome as the core recorded it


@contextlib.asynccontextmanager
async def holding(fe: RunningFrontend, model: str = "embed") -> AsyncIterator[None]:
    """The core sends no batch of ``model`` while within: what arrives queues there, as
    behind a Triton slower than its clients; on the way out it sends again at once. A
    gate the test holds at the core, in place of a flood sized to outpace Triton: on a
    loaded machine one client's 240-320 calls drained as they came (0-4 of them queued,
    three tries running), and a test of what a queue does found none."""

    async def hold() -> None:
        await fe.frontend.model_info(model)  # its runtime, made before any call
        runtime = fe.frontend.runtimes[model]
        runtime._may_send = lambda now: None

    async def release() -> None:
        runtime = fe.frontend.runtimes[model]
        del runtime._may_send
        runtime.kick()

    await fe.acall(hold())
    try:
        yield
    finally:
        await fe.acall(release())


async def _flood_then_probe(
    fe: RunningFrontend, noisy: str, quiet: str, flood: int, **probe_kw: Any
) -> Probe:
    """Flood with ``noisy`` while the core holds the model's batches (``holding``), send
    one ``quiet`` request once the whole flood is queued, and let the batches go once the
    probe is queued too (or answered: refused, expired).

    The probe's client connects before the flood (its request is then one message on a
    connection already open). Read from the core's record: how many of the noisy
    tenant's requests were queued when the probe was, and how many of them the core
    dispatched after that, before the probe went (or ended, if it never did).
    """
    client = grpcaio.InferenceServerClient(fe.grpc_url)
    probe_client = grpcaio.InferenceServerClient(fe.grpc_url)
    tracker = Tracker()

    async def send_probe() -> Any:
        try:
            return await probe_client.infer(
                "embed",
                [ids_input(grpcaio, _ids())],
                request_id=PROBE_ID,
                headers={"x-api-key": KEYS[quiet]},
                **probe_kw,
            )
        except InferenceServerException as err:
            return err

    try:
        assert await probe_client.is_server_live(headers={"x-api-key": KEYS[quiet]})
        async with recording(fe) as record:
            async with holding(fe):
                tasks = [asyncio.ensure_future(tracker.send(client, noisy)) for _ in range(flood)]

                async def arrived() -> bool:
                    return await fe.acall(_queued(fe, noisy)) >= flood or bool(tracker.errors)

                what = f"{noisy}'s flood queued"
                await aeventually(arrived, FLOOD_ARRIVAL_S, 0.005, what=what)
                assert not tracker.errors, tracker.errors[:3]
                probe_task = asyncio.ensure_future(send_probe())

                def probe_in() -> bool:
                    came = any(s.request.request.id == PROBE_ID for s in list(record.steps))
                    return came or probe_task.done()

                await aeventually(probe_in, SETTLE_S, 0.005, what="the probe queued")
            probe = await probe_task
            await asyncio.gather(*tasks, return_exceptions=True)
            assert not tracker.errors, tracker.errors[:3]
            await aeventually(record.settled, SETTLE_S, 0.01, what="every request's end")
        steps = record.steps
        came = next(i for i, s in enumerate(steps) if s.request.request.id == PROBE_ID)
        req = steps[came].request
        left = next(i for i, s in enumerate(steps) if s.request is req and s.what != "queued")
        ahead = sum(1 for s in steps[came:left] if s.what == "dispatched" and s.tenant == noisy)
        depths = steps[came].queued
        assert depths is not None
        queued = depths.get(noisy, 0) - (1 if quiet == noisy else 0)
        outcome = next(s.outcome for s in steps[left:] if s.request is req and s.what == "ended")
        return Probe(probe, queued, ahead, outcome)
    finally:
        await client.close()
        await probe_client.close()


async def test_a_burst_does_not_delay_another_tenant_beyond_one_batch(mode_frontend) -> None:
    """Same tier: the quiet tenant's request goes in the next batch, whatever is queued:
    the core dispatches no more of the burst after it arrives than the rest of the noisy
    tenant's turn in progress (deficit round robin: one quantum, a full batch).

    In fifo mode (the negative control) every request of the burst queued before it goes
    first.
    """
    fe = mode_frontend
    got = await _flood_then_probe(fe, "initech", "hooli", flood=FLOOD)
    assert not isinstance(got.result, Exception), got.result
    assert got.queued == FLOOD, f"the flood was not all queued when the probe came ({got})"
    if fe.server.config.scheduling == "fair":
        assert got.ahead <= ROWS_PER_BATCH, f"{got.ahead} flood requests went first ({got})"
    else:
        assert got.ahead == got.queued, f"fifo should serve the burst first ({got})"


async def test_higher_tier_goes_first(frontend) -> None:
    # umbrella is trial, acme enterprise: the enterprise request overtakes trial's backlog
    # (strict tiers: it is the next request dispatched).
    got = await _flood_then_probe(frontend, "umbrella", "acme", flood=FLOOD)
    assert not isinstance(got.result, Exception), got.result
    assert got.queued == FLOOD, f"the flood was not all queued when the probe came ({got})"
    assert got.ahead == 0, f"{got.ahead} trial requests went first ({got})"


async def test_priority_overtakes_within_a_tenant(frontend) -> None:
    got = await _flood_then_probe(frontend, "globex", "globex", flood=FLOOD, priority=1)
    assert not isinstance(got.result, Exception), got.result
    assert got.queued == FLOOD, f"the flood was not all queued when the probe came ({got})"
    assert got.ahead == 0, f"{got.ahead} of its own lower-priority requests went first ({got})"


async def test_a_queued_request_expires_at_its_deadline(frontend) -> None:
    got = await _flood_then_probe(
        frontend,
        "initech",
        "initech",
        flood=FLOOD,
        timeout=1000,  # 1 ms, microseconds
        # The lowest level: behind the whole flood (earliest-deadline-first alone would put
        # it at the head of its tenant's queue, next in line within the same millisecond).
        priority=10,
    )
    probe = got.result
    assert isinstance(probe, InferenceServerException)
    assert probe.status() == "StatusCode.UNAVAILABLE"
    assert probe.message() == "Request timeout expired"
    assert got.outcome == "expired"
    assert got.queued == FLOOD, f"the flood was not all queued when the probe came ({got})"
    # Answered at its deadline, not when its turn came (after every one queued ahead of
    # it): most of the flood was still queued when it expired.
    assert got.ahead < got.queued / 2, got


async def test_batches_carry_several_tenants_and_accounting_adds_up(triton, workers: int) -> None:
    with running_frontend(make_config(), triton, workers=workers) as fe:
        seen: list[dict[str, int]] = []
        observer = fe.frontend.observer
        original = observer.batches_finished

        def record(reports: Any) -> None:  # a loop turn's batches, reported together
            seen.extend(dict(report.tenants) for report in reports)
            original(reports)

        observer.batches_finished = record
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

        def reported() -> int:  # a batch is reported just after its answers are sent
            return sum(sum(b.values()) for b in list(seen))

        await aeventually(lambda: reported() >= 200, SETTLE_S, 0.01, what="every batch reported")
        assert any(len(batch) >= 2 for batch in seen), seen
        assert reported() == 200
        counters = await fe.acall(fe.counters("embed"))
        assert counters.admitted == counters.dispatched == 200
        assert counters.expired == counters.cancelled == 0


async def test_a_cancelled_request_leaves_the_queue_and_is_never_sent(triton, workers: int) -> None:
    with running_frontend(make_config(), triton, workers=workers) as fe:
        client = grpcaio.InferenceServerClient(fe.grpc_url)
        victim_client = grpcaio.InferenceServerClient(fe.grpc_url)
        try:
            async with holding(fe):  # acme's flood queued ahead of the victim
                flood = [
                    asyncio.ensure_future(
                        client.infer(
                            "embed",
                            [ids_input(grpcaio, _ids())],
                            headers={"x-api-key": KEYS["acme"]},
                        )
                    )
                    for _ in range(320)
                ]
                await aeventually(
                    lambda: _at_least(fe, "acme", 320),
                    FLOOD_ARRIVAL_S,
                    0.005,
                    what="acme's flood queued",
                )
                victim = asyncio.ensure_future(
                    victim_client.infer(
                        "embed",
                        [ids_input(grpcaio, _ids())],
                        headers={"x-api-key": KEYS["umbrella"]},  # trial: behind all of acme
                    )
                )
                await aeventually(
                    lambda: _at_least(fe, "umbrella", 1), SETTLE_S, 0.005, what="the victim queued"
                )
                victim.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await victim

                async def gone() -> bool:  # its cancellation reached the core's queue
                    return await _queued(fe, "umbrella") == 0

                await aeventually(lambda: fe.acall(gone()), SETTLE_S, 0.005, what="the victim gone")
            await asyncio.gather(*flood)
        finally:
            await client.close()
            await victim_client.close()

        async def settled() -> Any:
            counters = fe.frontend.runtimes["embed"].scheduler.counters
            return counters if counters.cancelled >= 1 else None

        what = "the victim's cancellation counted"
        counters = await aeventually(lambda: fe.acall(settled()), SETTLE_S, 0.01, what=what)
        assert counters.cancelled == 1
        assert counters.dispatched == 320
        assert counters.admitted == 321


async def test_queue_caps_reject_with_the_cap_named(triton, workers: int) -> None:
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
