"""Granted rows: a batch's part, sent to Triton from the shell that holds its tensors.

A unary call to a one-hop endpoint keeps its tensors in its shell, which sends the core
its facts (``Gateway._facts``); the core forms each batch and grants each shell its rows
of it (``records.Rows``, ``core.granted``). ``RowsSender`` sends them: packed into one
Triton request, sent to the Triton the grant names, reported to the core in one
``RowsDone``, then answered. A part that failed is reported and not answered: its calls
wait for the core's word (another grant, or an answer with the error).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

from fair_frontend.backends.protocol import BackendServer
from fair_frontend.batching import pack, unpack
from fair_frontend.endpoint import EndpointPlan
from fair_frontend.errors import FrontendError, Internal
from fair_frontend.observability.tracing import Traces, carried, failed
from fair_frontend.shell.link import Inbox
from fair_frontend.tokens import output_tokens
from fair_frontend.wire.records import Answer, Call, Fault, Rows, RowsDone

log = logging.getLogger(__name__)


class Upstreams(Protocol):
    """What a shell's granted work reads of its gateway: the Tritons of the pool (a grant
    names one by its index) and the request traces."""

    @property
    def tritons(self) -> list[BackendServer]: ...

    @property
    def traces(self) -> Traces | None: ...


class RowsSender:
    """A shell's granted parts of batches, sent and reported (the module's doc)."""

    def __init__(self, gateway: Upstreams, link: Any) -> None:
        self.gateway = gateway  # its Tritons and traces
        self.link = link  # the link that takes grants of rows, and their reports
        # Calls whose granted rows are in Triton now: set when their send is over.
        self._sending: dict[int, asyncio.Event] = {}
        self._parts: set[asyncio.Task[None]] = set()

    def send(self, rows: Rows, inboxes: list[Inbox | None]) -> None:
        """The core granted these calls rows of a batch: send them to Triton as one
        request (``_send_rows``)."""
        task = asyncio.get_running_loop().create_task(self._send_rows(rows, inboxes))
        self._parts.add(task)
        task.add_done_callback(self._parts.discard)

    async def _send_rows(self, rows: Rows, inboxes: list[Inbox | None]) -> None:
        """One part of a batch: packed, sent to the Triton the grant names, reported to
        the core, then answered. A part that failed is reported and not answered: its
        calls wait for the core's word (another grant, or an answer with the error).
        Calls gone meanwhile (their client left) are reported gone. A call still in
        Triton by the grant of a core since lost (a failover sent it again) is waited
        for: answered by then, it is reported gone; failed, it goes with this part."""
        link = self.link
        earlier = [self._sending[i].wait() for i in rows.calls if i in self._sending]
        if earlier:
            await asyncio.gather(*earlier)
        live: list[tuple[Inbox, Call, float, Any]] = []
        gone: list[int] = []
        for call_id, inbox, queued_s, quota in zip(
            rows.calls, inboxes, rows.queued_s, rows.quotas, strict=True
        ):
            if (
                inbox is None
                or inbox.held is None
                or inbox.done
                or inbox.answered is not None
                or call_id in self._sending
            ):
                gone.append(call_id)
            else:
                live.append((inbox, inbox.held[0], queued_s, quota))
        if not live:
            link.rows_done(RowsDone(rows.model, rows.batch, [], gone))
            return
        plan: EndpointPlan = live[0][0].held[1]
        calls = [call for _, call, _, _ in live]
        ids = [call.id for call in calls]
        sent = asyncio.Event()
        for call_id in ids:
            self._sending[call_id] = sent
        started = time.monotonic()
        fault: Fault | None = None
        traceparent = ""
        try:
            version, outs, traceparent = await self._infer_rows(rows, calls, plan, started)
        except FrontendError as err:
            fault = Fault.of(err)
        except Exception as err:  # never lose a part: the core judges it
            log.exception("a granted part of %s failed unexpectedly", rows.model)
            fault = Fault.of(Internal(f"internal error: {type(err).__name__}"))
        finally:
            for call_id in ids:
                self._sending.pop(call_id, None)
            sent.set()
        exec_s = time.monotonic() - started
        if fault is not None:
            served = [(call_id, 0) for call_id in ids]
            link.rows_done(RowsDone(rows.model, rows.batch, served, gone, fault, "", exec_s))
            return
        name = plan.token_output
        served = [
            (
                call.id,
                output_tokens(out, name, plan.tokenizer, call.request)
                if name is not None and out
                else 0,
            )
            for call, out in zip(calls, outs, strict=True)
        ]
        # The core hears of it before the clients do (as of a stream's end).
        link.rows_done(
            RowsDone(rows.model, rows.batch, served, gone, None, version, exec_s, traceparent)
        )
        for (inbox, call, queued_s, quota), out, (_, tokens) in zip(
            live, outs, served, strict=True
        ):
            inbox.served = (exec_s, tokens)
            inbox.answer(Answer(call.id, version, out, queued_s=queued_s, quota=quota))

    async def _infer_rows(
        self, rows: Rows, calls: list[Call], plan: EndpointPlan, started: float
    ) -> tuple[str, list[list[Any]], str]:
        """The part's one Triton request: (the version that ran, each call's outputs, the
        traceparent of its span where traced)."""
        packed = pack(calls, plan)
        forwarder = self.gateway.tritons[rows.backend]
        first = calls[0].request
        span = None
        traceparent = ""
        if self.gateway.traces is not None:
            span = self.gateway.traces.batch(rows.model, calls, forwarder.url, started)
            if span is not None:
                traceparent = carried(span)[0]
        try:
            version, outputs = await forwarder.infer(
                packed.batch(rows.model, first, len(calls), traceparent)
            )
        except FrontendError as err:
            if span is not None:
                failed(span, err)
            raise
        finally:
            if span is not None:
                span.end()
        return version, unpack(outputs, calls, plan, packed.stripped), traceparent
