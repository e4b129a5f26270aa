"""The asyncio shell around one model's scheduler: queue, dispatch, answer, expire.

The scheduler core is pure and synchronous; this module owns the clock (the event
loop's monotonic ``loop.time()``, read once per operation), the futures callers await,
the deadline timer, and the bound on batches in flight. Invariants:

* every request enqueued here is answered exactly once: a result, or an error
  (expired, cancelled, Triton's error, unavailable);
* at most ``max_inflight_batches`` batches of this model are in Triton at once (by
  default one per model instance), so requests wait here, where fairness is decided,
  not in Triton's queue, and each batch is assembled at the moment an instance frees
  up: a request that arrives while Triton is busy can still make the very next batch;
* work-conserving: whenever a slot is free and anything is queued, a batch goes out
  (unless ``max_queue_delay_ms`` asks to wait for a fuller batch, Triton-style);
* a batch whose model call fails for one bad row does not fail its neighbours: on a
  model error the items are retried one by one, so only the culprit sees the error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from fair_frontend.admission import Throttle
from fair_frontend.batching import Item, Packed, pack, unpack
from fair_frontend.config import Endpoint
from fair_frontend.errors import (
    FrontendError,
    Internal,
    TimeoutExpired,
    Unavailable,
)
from fair_frontend.feedback import ServiceModel
from fair_frontend.forwarder import StreamReply, TritonForwarder
from fair_frontend.models import ModelInfo
from fair_frontend.protocol import Tensor
from fair_frontend.scheduler import QueuedRequest, Scheduler

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Pending:
    """What the shell keeps with a queued request (the scheduler's opaque payload).

    ``future`` resolves once, with (model version, outputs) or the error the request is
    answered with. A request to a decoupled model also has a ``stream``: its responses,
    then ``None``; an error ends the stream as a ``StreamReply`` carrying it.
    """

    item: Item
    future: asyncio.Future[tuple[str, list[Tensor]]]  # (model version, outputs)
    enqueued_at: float  # time.monotonic(): statistics want more than the loop clock's ms
    dispatched_at: float | None = None
    stream: asyncio.Queue[StreamReply | None] | None = None

    def fail(self, err: FrontendError) -> None:
        if self.future.done():
            return
        self.future.set_exception(err)
        if self.stream is not None:
            self.stream.put_nowait(StreamReply(error=err))
            self.stream.put_nowait(None)

    def finish(self, version: str, outputs: list[Tensor]) -> None:
        if self.future.done():
            return
        self.future.set_result((version, outputs))
        if self.stream is not None:
            self.stream.put_nowait(None)


class TierShares:
    """Each tier's recent share of an endpoint's capacity (an EMA over batches).

    A batch's capacity is ``batch_rows`` rows and ``batch_tokens`` tokens (or what it
    holds, if more); a tier's share of a batch is the larger of its share of the rows and
    of the tokens: whichever cap fills first. So a tier that fills half of every batch
    takes half the capacity, whether the rest is filled by lower tiers or left empty (a
    lower tier the throttle holds back does not make the higher tiers look larger).
    """

    def __init__(
        self, alpha: float = 0.1, batch_rows: int = 1, batch_tokens: int | None = None
    ) -> None:
        self.alpha = alpha
        self.batch_rows = max(1, batch_rows)
        self.batch_tokens = batch_tokens
        self.share: dict[str, float] = {}

    def observe(
        self, rows_by_tier: dict[str, int], tokens_by_tier: dict[str, int] | None = None
    ) -> None:
        rows_cap = max(sum(rows_by_tier.values()), self.batch_rows)
        tokens_cap = 0
        if tokens_by_tier is not None and self.batch_tokens is not None:
            tokens_cap = max(sum(tokens_by_tier.values()), self.batch_tokens)
        for tier in set(self.share) | set(rows_by_tier):
            now = rows_by_tier.get(tier, 0) / rows_cap
            if tokens_cap and tokens_by_tier is not None:
                now = max(now, tokens_by_tier.get(tier, 0) / tokens_cap)
            self.share[tier] = (1 - self.alpha) * self.share.get(tier, 0.0) + self.alpha * now

    def above(self, tier: str, tiers: list[str]) -> float:
        """The share of the tiers served before ``tier`` (strict order)."""
        if tier not in tiers:
            return 0.0
        return sum(self.share.get(t, 0.0) for t in tiers[: tiers.index(tier)])


@dataclass(slots=True)
class BatchReport:
    """A finished batch, for metrics and the feedback loop."""

    model: str
    rows: int
    tokens: int
    items: int
    tenants: dict[str, int]  # rows per tenant
    tenant_tokens: dict[str, int]
    tenant_cost: dict[str, float]
    started: float
    finished: float
    ok: bool

    @property
    def seconds(self) -> float:
        return self.finished - self.started


class Backend:
    """Is Triton reachable? Batches are held (not failed) while it is not.

    A batch that fails with UNAVAILABLE marks the backend down; from then on queued
    requests stay queued (their deadlines still expire) and a probe polls Triton's
    readiness every ``probe_interval_s`` until it answers, then dispatch resumes.
    """

    def __init__(
        self,
        probe: Callable[[], Awaitable[bool]] | None = None,
        probe_interval_s: float = 0.1,
        max_outage_s: float = 60.0,
    ) -> None:
        self.available = asyncio.Event()
        self.available.set()
        self.listeners: list[Callable[[], None]] = []  # called when Triton is back
        self.give_up_listeners: list[Callable[[], None]] = []  # ... when the outage is too long
        self.probe = probe
        self.probe_interval_s = probe_interval_s
        self.max_outage_s = max_outage_s
        self.down_since: float | None = None
        self.gave_up = False
        self._recovery: asyncio.Task[None] | None = None

    def mark_down(self) -> None:
        if self.available.is_set():
            log.warning("Triton unavailable: holding queued requests until it is back")
            self.down_since = time.monotonic()
        self.available.clear()
        if self.probe is not None and (self._recovery is None or self._recovery.done()):
            self._recovery = asyncio.get_running_loop().create_task(self._recover())

    async def _recover(self) -> None:
        assert self.probe is not None
        while not self.available.is_set():
            try:
                if await self.probe():
                    self.mark_up()
                    return
            except Exception:  # a probe that errs is a "not yet"
                log.debug("Triton readiness probe failed", exc_info=True)
            if not self.gave_up and self.outage_s > self.max_outage_s:
                log.error(
                    "Triton unavailable for %.0f s: answering queued requests UNAVAILABLE",
                    self.outage_s,
                )
                self.gave_up = True
                for give_up in self.give_up_listeners:
                    give_up()
            await asyncio.sleep(self.probe_interval_s)

    @property
    def outage_s(self) -> float:
        if self.available.is_set() or self.down_since is None:
            return 0.0
        return time.monotonic() - self.down_since

    def mark_up(self) -> None:
        if not self.available.is_set():
            log.info("Triton available again: resuming dispatch")
            self.available.set()
            self.down_since = None
            self.gave_up = False
            for kick in self.listeners:
                kick()

    async def close(self) -> None:
        if self._recovery is not None:
            self._recovery.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._recovery


@dataclass
class EndpointRuntime:
    """Feeds one model's batches to Triton, at most ``max_inflight`` at a time."""

    model: str
    info: ModelInfo
    endpoint: Endpoint
    scheduler: Scheduler
    forwarder: TritonForwarder
    backend: Backend
    on_batch: Callable[[BatchReport], None] = lambda report: None
    service: ServiceModel | None = None  # what batches cost (feedback)
    throttle: Throttle | None = None  # admission's early reject
    tier_shares: TierShares = field(default_factory=TierShares)
    inflight: int = 0
    batches_sent: int = 0
    _busy_until: float = 0.0  # when the batches in flight are predicted to be done
    _timer: asyncio.TimerHandle | None = field(default=None, repr=False)
    _timer_at: float | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.backend.listeners.append(self.kick)
        self.backend.give_up_listeners.append(self.give_up)

    @property
    def max_inflight(self) -> int:
        configured = self.endpoint.max_inflight_batches
        return configured if configured is not None else self.info.instances

    def now(self) -> float:
        return self.loop.time()

    # ---- the request side ---------------------------------------------------------------

    async def submit(self, qr: QueuedRequest, item: Item) -> tuple[str, list[Tensor]]:
        """Queue a request and wait for (model version, its outputs), or the error it is
        answered with."""
        now = self.now()
        pending = Pending(item, self.loop.create_future(), time.monotonic())
        # A cancelled caller no longer reads its future; mark its exception as retrieved.
        pending.future.add_done_callback(_retrieve)
        qr.payload = pending
        self.scheduler.enqueue(qr, now)  # raises QueueFull before anything is queued
        self.kick()
        try:
            return await pending.future
        except asyncio.CancelledError:
            # The client went away (awaiting the future directly cancels it too). Still
            # queued: it leaves and is never sent. Already in a batch: the batch still
            # serves its neighbours, and its answer for this one is dropped.
            if self.scheduler.cancel(qr, self.now()):
                self.kick()
            raise

    async def submit_stream(self, qr: QueuedRequest, item: Item) -> AsyncIterator[StreamReply]:
        """Queue a request to a decoupled model; yield its responses as they come."""
        now = self.now()
        pending = Pending(item, self.loop.create_future(), time.monotonic(), stream=asyncio.Queue())
        pending.future.add_done_callback(_retrieve)
        qr.payload = pending
        self.scheduler.enqueue(qr, now)
        self.kick()
        assert pending.stream is not None
        try:
            while (reply := await pending.stream.get()) is not None:
                if reply.error is not None:
                    raise reply.error
                yield reply
        finally:
            if not pending.future.done() and self.scheduler.cancel(qr, self.now()):
                pending.future.cancel()
                self.kick()

    # ---- the dispatch side --------------------------------------------------------------

    def kick(self) -> None:
        """Send batches while a slot is free and work is queued; re-arm the timers."""
        now = self.now()
        self._expire(now)
        while self.backend.available.is_set() and self._may_send(now):
            hold = self._hold_until(now)
            if hold is not None:
                self._arm(hold)
                break
            batch = self.scheduler.next_batch(now)
            if not batch:
                break
            self.inflight += 1
            self.batches_sent += 1
            self._busy_until = max(now, self._busy_until) + self._predict(batch)
            task = self.loop.create_task(self._run(batch, now))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if self.inflight >= self.max_inflight and self.scheduler.queued_requests:
            lead = self._lead()
            if lead > 0 and self.inflight == self.max_inflight:
                self._arm(self._busy_until - lead)
        deadline = self.scheduler.next_deadline()
        if deadline is not None:
            self._arm(deadline)

    def _may_send(self, now: float) -> bool:
        """A free slot, or the early send: one more batch ``dispatch_lead_ms`` before the
        batches in flight are predicted to finish, so that Triton starts it without a gap
        while it is still assembled at the last moment (late binding)."""
        if self.inflight < self.max_inflight:
            return True
        lead = self._lead()
        return lead > 0 and self.inflight == self.max_inflight and now >= self._busy_until - lead

    def _lead(self) -> float:
        if self.service is None or not self.service.has_data:
            return 0.0
        return self.endpoint.dispatch_lead_ms / 1000.0

    def _predict(self, batch: list[QueuedRequest]) -> float:
        if self.service is None or not self.service.has_data:
            return 0.0
        rows = sum(qr.rows for qr in batch)
        tokens = sum(qr.tokens for qr in batch)
        return float(self.service.predict_batch_seconds(rows, tokens))

    def _hold_until(self, now: float) -> float | None:
        """Triton-style max_queue_delay: wait (only while idle) for a fuller batch."""
        delay = self.endpoint.max_queue_delay_ms / 1000.0
        if delay <= 0 or self.inflight > 0:
            return None
        oldest = self.scheduler.oldest_arrival()
        if oldest is None or oldest + delay <= now:
            return None
        limit = self.scheduler.policy.max_batch_size or 1
        if self.scheduler.queued_rows >= limit:
            return None
        return oldest + delay

    def _arm(self, at: float) -> None:
        """One timer per model, at the earliest moment something is due."""
        if self._timer is not None and self._timer_at is not None and self._timer_at <= at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = self.loop.call_at(at, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        self.kick()

    def _expire(self, now: float) -> None:
        for qr in self.scheduler.expire(now):
            qr.payload.fail(TimeoutExpired())  # Pending.fail answers once

    async def _run(self, batch: list[QueuedRequest], now: float) -> None:
        pendings: list[Pending] = [qr.payload for qr in batch]
        for p in pendings:
            p.dispatched_at = time.monotonic()
        started = time.monotonic()
        ok = False
        try:
            ok = await self._send(pendings)
        except Exception as err:  # never lose an answer, whatever went wrong
            log.exception("batch for %s failed unexpectedly", self.model)
            self._fail(pendings, Internal(f"internal error: {type(err).__name__}"))
        finally:
            self.inflight -= 1
            self.on_batch(_report(self.model, batch, started, time.monotonic(), ok))
            self.kick()

    async def _send(self, pendings: list[Pending]) -> bool:
        # A caller that went away between batch assembly and now is not sent at all.
        pendings = [p for p in pendings if not p.future.done()]
        if not pendings:
            return True
        items = [p.item for p in pendings]
        if self.info.decoupled:
            return await self._send_stream(pendings[0])
        try:
            packed = pack(items, self.info, self.endpoint)
            while True:
                try:
                    version, outputs = await self._forward(packed, items)
                    break
                except Unavailable as err:
                    self.backend.mark_down()
                    if not err.never_sent:
                        raise
                    # It never reached Triton: hold the batch (its slot too) and send it
                    # first once Triton is back; its deadlines still apply meanwhile.
                    pendings = await self._hold(pendings)
                    if not pendings:
                        return False
                    items = [p.item for p in pendings]
                    packed = pack(items, self.info, self.endpoint)
        except Unavailable as err:
            self._fail(pendings, err)
            return False
        except FrontendError as err:
            if len(pendings) == 1:
                self._fail(pendings, err)
                return False
            # One bad row must not fail its neighbours: isolate by sending each alone.
            await self._send_one_by_one(pendings)
            return False
        for p, outs in zip(
            pendings,
            unpack(outputs, items, self.info, self.endpoint, packed.stripped),
            strict=True,
        ):
            if not p.future.done():
                p.finish(version, outs)
        return True

    async def _send_stream(self, pending: Pending) -> bool:
        """A decoupled model: relay each of its responses as it arrives."""
        packed = pack([pending.item], self.info, self.endpoint)
        req = pending.item.request
        version = req.version
        assert pending.stream is not None
        async for reply in self.forwarder.stream(
            self.model,
            req.version,
            packed.inputs,
            packed.outputs,
            packed.parameters,
            request_id=req.id,
            sequence=packed.sequence,
        ):
            if reply.error is not None:
                if isinstance(reply.error, Unavailable):
                    self.backend.mark_down()
                pending.fail(reply.error)
                return False
            version = reply.version
            if not pending.future.done():
                pending.stream.put_nowait(reply)
        pending.finish(version, [])
        return True

    async def _hold(self, pendings: list[Pending]) -> list[Pending]:
        """Wait until Triton is available; expire held items at their deadlines."""
        while not self.backend.available.is_set():
            deadlines = [
                p.item.deadline_mono
                for p in pendings
                if p.item.deadline_mono is not None and not p.future.done()
            ]
            timeout = max(0.0, min(deadlines) - self.now()) if deadlines else None
            if self.backend.gave_up:
                self._fail(pendings, self.outage_error())
                return []
            timeout = min(timeout, 1.0) if timeout is not None else 1.0
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.backend.available.wait(), timeout)
            now = self.now()
            for p in pendings:
                due = p.item.deadline_mono
                if due is not None and due <= now and not p.future.done():
                    p.fail(TimeoutExpired())
            pendings = [p for p in pendings if not p.future.done()]
        return pendings

    async def _send_one_by_one(self, pendings: list[Pending]) -> None:
        for p in pendings:
            if p.future.done():
                continue
            try:
                packed = pack([p.item], self.info, self.endpoint)
                version, outputs = await self._forward(packed, [p.item])
            except FrontendError as err:
                if isinstance(err, Unavailable):
                    self.backend.mark_down()
                self._fail([p], err)
                continue
            (outs,) = unpack(outputs, [p.item], self.info, self.endpoint, packed.stripped)
            if not p.future.done():
                p.finish(version, outs)

    async def _forward(self, packed: Packed, items: list[Item]) -> tuple[str, list[Tensor]]:
        first = items[0].request
        return await self.forwarder.infer(
            self.model,
            first.version,
            packed.inputs,
            packed.outputs,
            packed.parameters,
            request_id=first.id if len(items) == 1 else "",
            sequence=packed.sequence,
        )

    @staticmethod
    def _fail(pendings: list[Pending], err: FrontendError) -> None:
        for p in pendings:
            p.fail(err)

    def outage_error(self) -> Unavailable:
        return Unavailable(
            f"Triton has been unavailable for {self.backend.outage_s:.0f} s "
            f"(triton.max_outage_s is {self.backend.max_outage_s:g})"
        )

    def give_up(self) -> None:
        """The outage outlasted ``max_outage_s``: answer what is queued, UNAVAILABLE."""
        self.fail_queued(self.outage_error())

    @property
    def idle(self) -> bool:
        return self.inflight == 0 and self.scheduler.queued_requests == 0

    def fail_queued(self, err: FrontendError) -> int:
        """Answer everything still queued with ``err`` (shutdown); returns how many."""
        failed = 0
        now = self.now()
        while batch := self.scheduler.next_batch(now):
            pendings = [qr.payload for qr in batch]
            self._fail(pendings, err)
            failed += len(pendings)
        self._expire(now)
        return failed

    async def drain(self) -> None:
        """Wait for every batch in flight (shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


def _report(
    model: str, batch: list[QueuedRequest], started: float, finished: float, ok: bool
) -> BatchReport:
    rows: dict[str, int] = {}
    tokens: dict[str, int] = {}
    cost: dict[str, float] = {}
    for qr in batch:
        rows[qr.tenant] = rows.get(qr.tenant, 0) + qr.rows
        tokens[qr.tenant] = tokens.get(qr.tenant, 0) + qr.tokens
        cost[qr.tenant] = cost.get(qr.tenant, 0.0) + qr.cost
    return BatchReport(
        model=model,
        rows=sum(rows.values()),
        tokens=sum(tokens.values()),
        items=len(batch),
        tenants=rows,
        tenant_tokens=tokens,
        tenant_cost=cost,
        started=started,
        finished=finished,
        ok=ok,
    )


def _retrieve(fut: asyncio.Future[tuple[str, list[Tensor]]]) -> None:
    if not fut.cancelled():
        fut.exception()
