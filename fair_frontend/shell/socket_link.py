"""A shell process's link to the core (``fair_frontend.shell.link.CoreLink``): the
records of ``fair_frontend.wire.records``, framed over the core's Unix socket
(``fair_frontend.wire.framing``)."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from typing import Any

from tritonclient.grpc import service_pb2

from fair_frontend.errors import FrontendError, Overloaded, Unavailable
from fair_frontend.models import ModelInfo
from fair_frontend.shell.link import Inbox, TickTokens, gone_before_answered
from fair_frontend.wire.framing import Framed, to_shell
from fair_frontend.wire.records import (
    PRODUCED_TICK_S,
    Answer,
    Call,
    Cancel,
    Draining,
    Ended,
    Fault,
    Flushed,
    FlushTally,
    Grant,
    Group,
    InfoAnswer,
    InfoQuery,
    Precharge,
    Precharged,
    Produced,
    QueueView,
    Rows,
    RowsDone,
    Settings,
    StatsAnswer,
    StatsQuery,
    Stop,
    Tally,
    TallyEntry,
)

log = logging.getLogger(__name__)

TALLY_INTERVAL_S = 0.25
TALLY_MAX_KEYS = 1024  # distinct (tenant, model, outcome) before a tally goes early


RowsTaker = Callable[[Rows, list[Inbox | None]], None]
"""(a grant of rows, the inbox of each of its calls or None where gone): the gateway's
``send_rows``."""


class SocketLink(Framed):
    """A shell process's link to the core (``fair_frontend.shell.link.CoreLink``); it
    takes grants of rows (``records.Rows``) for the calls whose tensors its shell kept."""

    decoder = to_shell
    takes_rows = True

    def __init__(
        self,
        on_settings: Callable[[Settings], None],
        on_stop: Callable[[], None],
        on_lost: Callable[[], None],
    ) -> None:
        super().__init__()
        self.on_settings = on_settings
        self.on_stop = on_stop
        self.on_lost = on_lost
        self._ids = itertools.count(1)
        self._inboxes: dict[int, Inbox] = {}
        self._queries: dict[int, asyncio.Future[Any]] = {}
        self._tally: dict[tuple[str | None, str, str, str | None, str], list[float]] = {}
        self._tally_timer: asyncio.TimerHandle | None = None
        self._full: dict[tuple[str, str], str] = {}
        self._room: dict[tuple[str, str], tuple[int, str]] = {}
        self._overloaded: dict[tuple[str, str], tuple[str, float]] = {}  # (model, tier)
        # Output tokens of granted streams not yet told to the core, per call: told
        # within ``PRODUCED_TICK_S``, all calls' in one ``Produced``.
        self._pending = TickTokens()
        self.accepting = True
        self.on_rows: RowsTaker | None = None  # who sends granted rows (the gateway)

    @classmethod
    async def connect(
        cls,
        path: str,
        on_settings: Callable[[Settings], None],
        on_stop: Callable[[], None],
        on_lost: Callable[[], None],
    ) -> SocketLink:
        loop = asyncio.get_running_loop()
        _, link = await loop.create_unix_connection(
            lambda: cls(on_settings, on_stop, on_lost), path
        )
        return link

    # CoreLink

    def new_id(self) -> int:
        return next(self._ids)

    def submit(self, call: Call) -> Inbox:
        if self.closed:
            inbox = Inbox()
            inbox.answer(Answer(call.id, fault=Fault.of(Unavailable(_CORE_GONE))))
            return inbox
        inbox = self._register(call)
        super().send(call)
        return inbox

    def submit_group(self, calls: list[Call]) -> list[Inbox]:
        if self.closed:
            return [self.submit(call) for call in calls]  # each answered: the core is gone
        inboxes = [self._register(call) for call in calls]
        super().send(Group(calls))
        return inboxes

    async def precharge(self, tenant: str, model: str, requests: int, tokens: int) -> float | None:
        answer: Precharged = await self._query(
            lambda i: Precharge(i, tenant, model, requests, tokens)
        )
        if answer.fault is not None:
            raise answer.fault.error()
        return answer.at

    def _register(self, call: Call) -> Inbox:
        """The inbox of ``call``, wired to this link."""
        inbox = Inbox()
        call_id = call.id
        key = (call.tenant, call.request.model)
        self._inboxes[call_id] = inbox
        inbox._cancel = lambda: self._cancel(call_id)
        inbox._produced = lambda tokens, first, gap: self._tokens(call_id, key, tokens, first, gap)
        inbox._end = lambda version, fault, cancelled: self._ended(
            call_id, version, fault, cancelled
        )
        return inbox

    def _cancel(self, call_id: int) -> None:
        if self._inboxes.pop(call_id, None) is not None:
            super().send(Cancel(call_id))

    def _tokens(
        self, call_id: int, key: tuple[str, str], tokens: int, first_s: float, gap_s: float
    ) -> None:
        """Output tokens a granted stream (of ``key``: its tenant and model) relayed: told
        to the core within ``PRODUCED_TICK_S``, with every other stream's (one
        ``Produced`` per tick); the time since its last response binned here, with every
        other stream's of its tenant and model (no time per token crosses the link)."""
        if not self._pending.streams:
            asyncio.get_running_loop().call_later(PRODUCED_TICK_S, self._send_produced)
        self._pending.add(call_id, call_id, key, tokens, first_s, gap_s)

    def _send_produced(self) -> None:
        entries, times = self._pending.take()
        if (entries or times) and not self.closed:
            super().send(Produced(entries, times))

    def _ended(
        self,
        call_id: int,
        version: str,
        fault: FrontendError | None,
        cancelled: bool,
    ) -> None:
        """A granted stream ended: its tokens not yet told go first (none after). One
        given back (``Inbox.again``) keeps its inbox: the core's next grant or its answer
        comes to it."""
        again = gone_before_answered(fault)
        if (self._inboxes.get(call_id) if again else self._inboxes.pop(call_id, None)) is None:
            return
        entry = self._pending.streams.pop(call_id, None)
        if entry is not None:
            super().send(Produced([tuple(entry)]))
        sent = Fault.of(fault) if fault is not None else None
        super().send(Ended(call_id, version, sent, cancelled))

    def rows_done(self, done: RowsDone) -> None:
        """Report a part of a granted batch; the calls it served are answered here (the
        core sends no answer for them)."""
        if done.fault is None:
            for call_id, _ in done.served:
                self._inboxes.pop(call_id, None)
        super().send(done)

    async def model_info(self, model: str) -> ModelInfo:
        answer: InfoAnswer = await self._query(lambda i: InfoQuery(i, model))
        if answer.fault is not None:
            raise answer.fault.error()
        assert answer.model is not None  # a core answers a fault or the model
        return ModelInfo.of(answer.model)

    async def statistics(self, model: str, version: str) -> Any:
        answer: StatsAnswer = await self._query(lambda i: StatsQuery(i, model, version))
        if answer.fault is not None:
            raise answer.fault.error()
        return service_pb2.ModelStatisticsResponse.FromString(answer.message)

    async def _query(self, make: Callable[[int], Any]) -> Any:
        if self.closed:
            raise Unavailable(_CORE_GONE)
        query_id = self.new_id()
        fut = asyncio.get_running_loop().create_future()
        self._queries[query_id] = fut
        try:
            super().send(make(query_id))
            return await fut
        finally:
            self._queries.pop(query_id, None)

    def tally(self, entry: TallyEntry) -> None:
        """Aggregated, and sent every ``TALLY_INTERVAL_S``: a flood of refusals costs the
        core one record per interval, not one per request."""
        key = (entry.tenant, entry.model, entry.outcome, entry.failed_version, entry.door)
        counts = self._tally.get(key)
        if counts is None:
            self._tally[key] = [entry.count, entry.failed_s]
        else:
            counts[0] += entry.count
            counts[1] += entry.failed_s
        if len(self._tally) >= TALLY_MAX_KEYS:
            self.flush_tally()
        elif self._tally_timer is None:
            loop = asyncio.get_running_loop()
            self._tally_timer = loop.call_later(TALLY_INTERVAL_S, self.flush_tally)

    def queue_full(self, tenant: str, model: str, nbytes: int = 0) -> str | None:
        full = self._full
        if full:
            cap = full.get((tenant, model)) or full.get(("*", "*"))
            if cap is not None:
                return cap
        room = self._room
        if nbytes and room:
            for key in ((tenant, model), (tenant, "*"), ("*", "*")):
                left = room.get(key)
                if left is not None and nbytes > left[0]:
                    return left[1]
        return None

    def overloaded(self, tier: str, model: str) -> Overloaded | None:
        closed = self._overloaded.get((model, tier)) if self._overloaded else None
        return Overloaded(closed[0], retry_after=closed[1]) if closed is not None else None

    def flush_tally(self) -> None:
        if self._tally_timer is not None:
            self._tally_timer.cancel()
            self._tally_timer = None
        if not self._tally:
            return
        entries = [
            TallyEntry(tenant, model, outcome, int(n), version, failed_s, door)
            for (tenant, model, outcome, version, door), (n, failed_s) in self._tally.items()
        ]
        self._tally.clear()
        super().send(Tally(entries))

    # from the core

    def received(self, record: Any) -> None:
        if isinstance(record, Answer):
            inbox = self._inboxes.get(record.id)
            if inbox is None:
                return  # its client went away
            if not inbox.granted:  # (a granted one's stream ends, then it goes)
                del self._inboxes[record.id]
            inbox.answer(record)
        elif isinstance(record, Grant):
            inbox = self._inboxes.get(record.id)
            if inbox is not None:
                inbox.answer(record)
        elif isinstance(record, Rows):
            inboxes = [self._inboxes.get(call_id) for call_id in record.calls]
            if self.on_rows is not None:
                self.on_rows(record, inboxes)
            else:  # nobody here sends rows: the core hears they are gone
                self.rows_done(RowsDone(record.model, record.batch, [], list(record.calls)))
        elif isinstance(record, (InfoAnswer, StatsAnswer, Precharged)):
            fut = self._queries.get(record.id)
            if fut is not None and not fut.done():
                fut.set_result(record)
        elif isinstance(record, QueueView):
            self._full = {(tenant, model): cap for tenant, model, cap in record.full}
            self._room = {(tenant, model): (left, cap) for tenant, model, left, cap in record.room}
            self._overloaded = {
                (model, tier): (message, retry) for model, tier, message, retry in record.overloaded
            }
        elif isinstance(record, Settings):
            queues = record.config.get("queues")
            if isinstance(queues, dict) and "stalled_shell_s" in queues:
                self.stall_s = float(queues["stalled_shell_s"])
            self.on_settings(record)
        elif isinstance(record, FlushTally):
            self.flush_tally()
            super().send(Flushed(record.id))
        elif isinstance(record, Draining):
            self.accepting = False
        elif isinstance(record, Stop):
            self.accepting = False
            self.on_stop()
        else:
            log.error("the core sent an unexpected %s", type(record).__name__)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        gone = Fault.of(Unavailable(_CORE_GONE))
        for call_id, inbox in list(self._inboxes.items()):
            inbox.answer(Answer(call_id, fault=gone))
        self._inboxes.clear()
        for fut in self._queries.values():
            if not fut.done():
                fut.set_exception(Unavailable(_CORE_GONE))
        self.on_lost()


_CORE_GONE = "the frontend's core process is gone"
CORE_GONE = _CORE_GONE
