"""Request traces: OpenTelemetry spans per request, off unless an OTLP endpoint is named.

A traced request's spans, by the process that records them:

* its shell: the request itself (``infer <model>``, ``chat <model>``...; kind SERVER, the
  child of the client's W3C ``traceparent`` where it sent one, else a trace's root), from
  its arrival to its answer, with its tenant, priority, usage and outcome; an OpenAI or
  rerank call made of several parts has one span over them all (``operation``); a
  stream's ``triton stream`` span (kind CLIENT), its call to Triton, whose context goes to
  Triton in the call's ``traceparent`` metadata, with a ``first_token`` event;
* the core, once the request is answered, from the times it kept: ``fair.admission``
  (arrival to admission: decoding, the crossing, rate limits and the throttle),
  ``fair.queue`` (admission to dispatch: the fair queue) and ``fair.batch`` (dispatch to
  answer; for a stream, the engine slot it held), linked to its batch's span;
* the core, per batch: ``triton infer <model>`` (kind CLIENT), the one call to Triton that
  carried every request of the batch: the child of the first traced request of it and
  linked to the others (a batch mixes tenants and traces), its context sent to Triton in
  the call's ``traceparent`` header, so that Triton's own spans (``--trace-config
  mode=opentelemetry``) join the trace.

Only a sampled request's context crosses from its shell to the core (``Call.traceparent``);
an untraced request costs a string comparison there. Sampling is parent-based: a
client's ``traceparent`` decides for its request, ``tracing.sample_ratio`` for the rest.
Spans leave in batches from a thread of the SDK's (``BatchSpanProcessor``), never on the
event loop. Each process (the core, each shell process) has its own provider, one per
``tracing`` config (frontends of one process share it).

The times are the frontend's own (``time.monotonic()``, one clock for every process of a
host), turned into the wall-clock nanoseconds spans carry by one offset per process.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from fair_frontend.errors import FrontendError

if TYPE_CHECKING:
    from fair_frontend.config import Config
    from fair_frontend.config import Tracing as TracingConfig
    from fair_frontend.outcomes import Outcome
    from fair_frontend.wire.records import Call

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

# time.time() - time.monotonic(), once per process: a span's start and end are the
# frontend's monotonic times moved onto the wall clock together (their difference exact).
_WALL_OFFSET = time.time() - time.monotonic()

_PROPAGATOR = TraceContextTextMapPropagator()


def wall_ns(monotonic: float) -> int:
    """A ``time.monotonic()`` instant as the wall-clock nanoseconds spans carry."""
    return int((monotonic + _WALL_OFFSET) * 1e9)


def carried(span: Span) -> tuple[str, str]:
    """(traceparent, tracestate) of a sampled span, as W3C headers carry them; ("", "")
    for one not sampled (nothing to join)."""
    ctx = span.get_span_context()
    if not ctx.is_valid or not ctx.trace_flags.sampled:
        return "", ""
    parent = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"
    return parent, ctx.trace_state.to_header() if ctx.trace_state else ""


def parent_context(traceparent: str, tracestate: str = "") -> otel_context.Context:
    """The context whose span is the one these headers name (a remote parent)."""
    carrier = {TRACEPARENT: traceparent}
    if tracestate:
        carrier[TRACESTATE] = tracestate
    return _PROPAGATOR.extract(carrier)


_SHARED: dict[str, Traces] = {}  # this process's, by their config (``Traces.of``)
_LOCK = threading.Lock()


def span_context(traceparent: str) -> SpanContext:
    """The span a W3C ``traceparent`` names (a part's call to Triton, made by a shell)."""
    return trace.get_current_span(parent_context(traceparent)).get_span_context()


class Traces:
    """One process's tracer for one ``tracing`` config (``Traces.of``)."""

    def __init__(self, config: TracingConfig) -> None:
        assert config.otlp_endpoint is not None
        self.config = config
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": config.service_name}),
            sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
        )
        self.provider.add_span_processor(
            BatchSpanProcessor(
                OTLPSpanExporter(endpoint=config.otlp_endpoint),
                schedule_delay_millis=config.export_delay_s * 1000,
            )
        )
        self.tracer = self.provider.get_tracer("fair_frontend")

    @classmethod
    def of(cls, config: Config) -> Traces | None:
        """This process's ``Traces`` for ``config.tracing``; None when tracing is off."""
        tracing = config.tracing
        if tracing.otlp_endpoint is None:
            return None
        key = tracing.model_dump_json()
        with _LOCK:
            traces = _SHARED.get(key)
            if traces is None:
                traces = _SHARED[key] = cls(tracing)
            return traces

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Send the finished spans now (a shutdown's last act)."""
        return self.provider.force_flush(int(timeout_s * 1000))

    # ---- the shell's spans --------------------------------------------------------------

    def request(
        self,
        name: str,
        headers: Mapping[str, str],
        arrived: float,
        attributes: Mapping[str, Any],
    ) -> Span:
        """A request's span in its shell, from ``arrived`` (``time.monotonic()``): the
        child of the operation the shell is in (``operation``), else of the client's
        ``traceparent``, else a new trace's root."""
        if trace.get_current_span().get_span_context().is_valid:
            parent, kind = None, SpanKind.INTERNAL  # the current span's: an operation's part
        else:
            parent = _PROPAGATOR.extract(headers) if TRACEPARENT in headers else None
            kind = SpanKind.SERVER
        return self.tracer.start_span(
            name,
            context=parent,
            kind=kind,
            start_time=wall_ns(arrived),
            attributes=attributes,
        )

    @contextlib.contextmanager
    def operation(
        self, name: str, headers: Mapping[str, str], started: float, attributes: Mapping[str, Any]
    ) -> Iterator[Span]:
        """An API call's span (``embeddings <model>``, ``rerank <model>``), from
        ``started`` and current while it runs: the requests it makes are its parts."""
        parent = _PROPAGATOR.extract(headers) if TRACEPARENT in headers else None
        span = self.tracer.start_span(
            name,
            context=parent,
            kind=SpanKind.SERVER,
            start_time=wall_ns(started),
            attributes=attributes,
        )
        with trace.use_span(span, end_on_exit=True, record_exception=False):
            try:
                yield span
            except FrontendError as err:
                failed(span, err)
                raise

    def stream(self, parent: Span, model: str, started: float) -> Span:
        """A granted stream's call to Triton, made by its shell."""
        return self.tracer.start_span(
            f"triton stream {model}",
            context=trace.set_span_in_context(parent),
            kind=SpanKind.CLIENT,
            start_time=wall_ns(started),
            attributes={"gen_ai.request.model": model},
        )

    # ---- the core's spans ---------------------------------------------------------------

    def batch(self, model: str, calls: Sequence[Call], backend: str, started: float) -> Span | None:
        """A batch's call to Triton: the child of its first traced request, linked to
        the others; None when none of them is traced."""
        traced = [c for c in calls if c.traceparent]
        if not traced:
            return None
        first = parent_context(traced[0].traceparent, traced[0].tracestate)
        links = [
            Link(
                trace.get_current_span(
                    parent_context(c.traceparent, c.tracestate)
                ).get_span_context()
            )
            for c in traced[1:]
        ]
        return self.tracer.start_span(
            f"triton infer {model}",
            context=first,
            kind=SpanKind.CLIENT,
            start_time=wall_ns(started),
            links=links,
            attributes={
                "gen_ai.request.model": model,
                "fair.batch.requests": len(calls),
                "fair.batch.rows": sum(c.rows for c in calls),
                "fair.batch.tenants": len({c.tenant for c in calls}),
                "server.address": backend,
            },
        )

    def finished(
        self,
        call: Call,
        outcome: Outcome,
        err: FrontendError | None,
        queued_s: float,
        service_s: float | None,
        now: float,
        batch: SpanContext | None = None,
    ) -> None:
        """A traced request's time in the core, as spans under its shell's span: its
        admission, its wait in the queue, its batch (or engine slot), by the times the
        core kept of it (``now``: its answer)."""
        parent = parent_context(call.traceparent, call.tracestate)
        dispatched = now - service_s if service_s is not None else None
        admitted = dispatched - queued_s if dispatched is not None and queued_s >= 0 else None
        tracer = self.tracer
        attributes = {"fair.tenant": call.tenant, "fair.outcome": outcome.value}
        admission = tracer.start_span(
            "fair.admission",
            context=parent,
            start_time=wall_ns(call.arrived),
            attributes=attributes,
        )
        if admitted is None and err is not None:
            admission.set_status(Status(StatusCode.ERROR, err.message))
        admission.end(wall_ns(admitted if admitted is not None else now))
        if admitted is None or dispatched is None:
            return
        tracer.start_span(
            "fair.queue",
            context=parent,
            start_time=wall_ns(admitted),
            attributes={"fair.priority": call.priority},
        ).end(wall_ns(dispatched))
        served = tracer.start_span(
            "fair.batch" if not call.stream or batch is not None else "fair.engine_slot",
            context=parent,
            start_time=wall_ns(dispatched),
            links=[Link(batch)] if batch is not None else None,
            attributes={"fair.outcome": outcome.value},
        )
        if err is not None:
            served.set_status(Status(StatusCode.ERROR, err.message))
        served.end(wall_ns(now))


def failed(span: Span, err: BaseException) -> None:
    """Mark ``span`` failed by ``err`` (a ``FrontendError``'s message and status)."""
    message = getattr(err, "message", None) or type(err).__name__
    span.set_status(Status(StatusCode.ERROR, message))
    span.set_attribute("error.type", type(err).__name__)
    status = getattr(err, "http_status", None)
    if status is not None:
        span.set_attribute("http.response.status_code", status)
