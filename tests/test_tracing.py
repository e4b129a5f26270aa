"""Request traces on the real stack: the frontend's spans, and Triton's joining them.

A collector of the test's own (an OTLP/HTTP endpoint on a free loopback port, decoding
the protobuf requests with OpenTelemetry's own messages) receives the spans of a
frontend with tracing on and of a Triton started for this module with
``--trace-config mode=opentelemetry`` pointing at the same collector: a trace is complete
when the client's span id is the parent of the frontend's request span and the
frontend's batch span is the parent of Triton's. Each frontend names its own
``service.name``, so tests read only their spans.
"""

from __future__ import annotations

import base64
import gzip
import json
import threading
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import tritonclient.grpc.aio as grpcaio
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from fair_frontend.backends.triton.embedded import EmbeddedTriton, default_model_repository
from fair_frontend.config import parse_config
from fair_frontend.kit.testing import aeventually, ascrape
from fair_frontend.observability.tracing import Traces
from tests.support import KEYS, RunningFrontend, config_dict, llm_inputs, running_frontend

_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))
TENANT = "acme"
# A deadline for what the processes export: met in well under a second when idle.
SETTLE_S = 60.0

# ---- the collector --------------------------------------------------------------------------


@dataclass
class SpanSeen:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent: str
    kind: int
    start: int
    end: int
    attributes: dict[str, Any]
    links: list[str]  # the linked spans' ids
    events: dict[str, int]  # each event's time, by name
    error: str | None


_ID_KEYS = frozenset({"traceId", "spanId", "parentSpanId"})


def _ids_as_bytes(doc: Any) -> Any:
    """OTLP/JSON writes trace and span ids in hex, where protobuf's JSON form of bytes is
    base64: the ids re-encoded, for ``json_format``."""
    if isinstance(doc, list):
        return [_ids_as_bytes(d) for d in doc]
    if not isinstance(doc, dict):
        return doc
    return {
        k: base64.b64encode(bytes.fromhex(v)).decode()
        if k in _ID_KEYS and isinstance(v, str)
        else _ids_as_bytes(v)
        for k, v in doc.items()
    }


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


@dataclass
class Collector:
    """Every span any process exported to it."""

    spans: list[SpanSeen] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def receive(self, body: bytes, content_type: str, encoding: str) -> None:
        """One export: protobuf (Python's SDK) or its JSON form (Triton's), maybe gzipped."""
        if encoding == "gzip":
            body = gzip.decompress(body)
        msg = trace_service_pb2.ExportTraceServiceRequest()
        if "json" in content_type:
            json_format.ParseDict(_ids_as_bytes(json.loads(body)), msg)
        else:
            msg.ParseFromString(body)
        seen = []
        for resource_spans in msg.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    seen.append(
                        SpanSeen(
                            service=str(resource.get("service.name", "")),
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent=s.parent_span_id.hex(),
                            kind=s.kind,
                            start=s.start_time_unix_nano,
                            end=s.end_time_unix_nano,
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            links=[link.span_id.hex() for link in s.links],
                            events={e.name: e.time_unix_nano for e in s.events},
                            error=s.status.message if s.status.code == 2 else None,
                        )
                    )
        with self.lock:
            self.spans.extend(seen)

    def of_trace(self, trace_id: str) -> list[SpanSeen]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def of_service(self, service: str) -> list[SpanSeen]:
        with self.lock:
            return [s for s in self.spans if s.service == service]


@pytest.fixture(scope="module")
def collector() -> Iterator[tuple[Collector, str]]:
    seen = Collector()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            seen.receive(
                body,
                self.headers.get("Content-Type", ""),
                self.headers.get("Content-Encoding", ""),
            )
            answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield seen, f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def traced_triton(collector: tuple[Collector, str]) -> Iterator[EmbeddedTriton]:
    """A Triton of this module's that traces every request (OpenTelemetry mode, to the
    collector), serving the embedding and LLM models."""
    _, url = collector
    server = EmbeddedTriton(
        default_model_repository(),
        extra_args=[
            "--model-control-mode=explicit",
            "--load-model=embed",
            "--load-model=llm",
            "--trace-config=mode=opentelemetry",
            f"--trace-config=opentelemetry,url={url.removeprefix('http://')}",
            "--trace-config=opentelemetry,resource=service.name=triton",
            "--trace-config=opentelemetry,bsp_schedule_delay=50",
            "--trace-config=rate=1",
            "--trace-config=level=TIMESTAMPS",
        ],
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


def traced_frontend(
    collector: tuple[Collector, str], triton: EmbeddedTriton, workers: int = 1, **tracing: Any
) -> tuple[Any, str]:
    """A frontend tracing to the collector, and its service name (its spans')."""
    service = f"fair-{uuid.uuid4().hex[:8]}"
    settings = {"otlp_endpoint": collector[1], "service_name": service, "export_delay_s": 0.05}
    config = parse_config(config_dict(tracing={**settings, **tracing}))
    return running_frontend(config, triton, workers=workers), service


def new_ids() -> tuple[str, str]:
    return uuid.uuid4().hex, uuid.uuid4().hex[:16]


def http_post(running: RunningFrontend, path: str, doc: Any, headers: dict[str, str]) -> Any:
    request = urllib.request.Request(
        f"http://{running.http_url}{path}",
        data=json.dumps(doc).encode(),
        headers={"x-api-key": KEYS[TENANT], "Content-Type": "application/json", **headers},
    )
    with _HTTP.open(request, timeout=30) as answer:
        return json.loads(answer.read())


def embed_doc(tokens: int) -> dict[str, Any]:
    ids = [[(7 * t) % 4096 for t in range(tokens)]]
    return {
        "inputs": [{"name": "INPUT_IDS", "shape": [1, tokens], "datatype": "INT32", "data": ids}]
    }


def embed(running: RunningFrontend, tokens: int, headers: dict[str, str]) -> Any:
    """A KServe infer of ``tokens`` token ids on ``embed``; its JSON answer."""
    return http_post(running, "/v2/models/embed/infer", embed_doc(tokens), headers)


def one(spans: list[SpanSeen], name: str) -> SpanSeen:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, f"{name}: {len(found)} spans among {[s.name for s in spans]}"
    return found[0]


# ---- a request, from its client to Triton ------------------------------------------------------


async def test_a_request_is_traced_from_its_client_through_the_queue_to_triton(
    collector: tuple[Collector, str], traced_triton: EmbeddedTriton, workers: int
) -> None:
    seen, _ = collector
    trace_id, client_span = new_ids()
    frontend, service = traced_frontend(collector, traced_triton, workers)
    with frontend as running:
        embed(running, 12, {"traceparent": f"00-{trace_id}-{client_span}-01"})

        def complete() -> list[SpanSeen] | None:
            spans = seen.of_trace(trace_id)
            names = {s.name for s in spans}
            want = {
                "infer embed",
                "fair.admission",
                "fair.queue",
                "fair.batch",
                "triton infer embed",
            }
            return spans if want <= names and _joined(spans, "triton infer embed") else None

        spans = await aeventually(
            complete, SETTLE_S, what="the request's spans, Triton's among them"
        )
    ours = [s for s in spans if s.service == service]
    request = one(ours, "infer embed")
    assert request.parent == client_span  # the client's span is its parent
    assert request.kind == 2  # SERVER
    assert request.attributes["fair.tenant"] == TENANT
    assert request.attributes["gen_ai.request.model"] == "embed"
    assert request.attributes["gen_ai.usage.input_tokens"] == 12
    admission, queue, batch = (one(ours, n) for n in ("fair.admission", "fair.queue", "fair.batch"))
    for span in (admission, queue, batch):
        assert span.parent == request.span_id
    # One request's time in the core, end to end, in order and without a gap.
    assert request.start <= admission.start <= admission.end == queue.start
    assert queue.end == batch.start <= batch.end
    call = one(ours, "triton infer embed")
    assert call.parent == request.span_id and call.kind == 3  # CLIENT
    if workers == 1:  # the core answers: its time ends before the request's
        assert batch.end <= request.end
    else:  # one hop: the shell calls Triton within the batch's slot, reports, answers
        assert batch.start <= call.start and call.end <= batch.end
    assert batch.links == [call.span_id]
    assert call.attributes["fair.batch.requests"] >= 1
    # Triton's own spans hang under the batch's call to it (its traceparent header).
    triton = [s for s in spans if s.service == "triton"]
    assert any(s.parent == call.span_id for s in triton), [(s.name, s.parent) for s in triton]
    assert not any(s.error for s in ours)


def _joined(spans: list[SpanSeen], name: str) -> bool:
    """Whether Triton's request span is among ``spans``, the child of our span ``name``."""
    ours = {s.span_id for s in spans if s.name == name and s.service != "triton"}
    return any(s.service == "triton" and s.parent in ours for s in spans)


async def test_a_stream_is_traced_with_its_first_token_and_its_engine_slot(
    collector: tuple[Collector, str], traced_triton: EmbeddedTriton, workers: int
) -> None:
    seen, _ = collector
    trace_id, client_span = new_ids()
    frontend, service = traced_frontend(collector, traced_triton, workers)
    with frontend as running:
        client = grpcaio.InferenceServerClient(running.grpc_url)
        headers = {"x-api-key": KEYS[TENANT], "traceparent": f"00-{trace_id}-{client_span}-01"}

        async def requests() -> AsyncIterator[dict[str, Any]]:
            yield {"model_name": "llm", "inputs": llm_inputs("a traced prompt", 5)}

        tokens = 0
        try:  # read to the stream's end: its spans end with it
            async for result, error in client.stream_infer(requests(), headers=headers):
                assert error is None, error
                text = result.as_numpy("text_output")
                if text is not None and text.size:
                    tokens += 1
        finally:
            await client.close()
        assert tokens == 5

        def complete() -> list[SpanSeen] | None:
            spans = [s for s in seen.of_trace(trace_id) if s.service == service]
            names = {s.name for s in spans}
            want = {"stream_infer llm", "triton stream llm", "fair.queue", "fair.engine_slot"}
            return spans if want <= names else None

        spans = await aeventually(complete, SETTLE_S, what="the stream's spans")
    request = one(spans, "stream_infer llm")
    assert request.parent == client_span
    stream = one(spans, "triton stream llm")
    assert stream.parent == request.span_id
    assert "first_token" in stream.events
    assert stream.attributes["gen_ai.usage.output_tokens"] == 5
    assert request.attributes["gen_ai.usage.output_tokens"] == 5
    slot = one(spans, "fair.engine_slot")
    queue = one(spans, "fair.queue")
    assert queue.end == slot.start and slot.parent == request.span_id
    # Triton's spans join the stream's trace under the stream's call (its gRPC traceparent
    # metadata) where Triton exports them: Triton 2.51 exports a request's root span only
    # when it releases the request's trace, which under load it sometimes had not within
    # a minute (a fresh clone's run: a "compute" span whose parents never came), and on
    # a quiet machine 2 of 24 streams had none at all while the shell cancelled each call
    # after its last response (it no longer does: 42 of 42 then). So what is checked is
    # what the frontend controls: none of Triton's spans hangs under any other span of
    # ours than the stream's call (the unary test above requires Triton's join of a
    # batch's call).
    ours = {s.span_id for s in spans}
    triton = [s for s in seen.of_trace(trace_id) if s.service == "triton"]
    assert all(t.parent == stream.span_id for t in triton if t.parent in ours), [
        (t.name, t.parent) for t in triton
    ]
    # The engine slot is held while the stream runs: granted before its call, freed after
    # its tokens came (the core hears of the end before the client has it; the span ends
    # once the client has, so its end is no bound on the slot's).
    assert slot.start <= stream.start <= stream.events["first_token"] <= slot.end


# ---- batches, API calls, sampling -----------------------------------------------------------


async def test_a_batch_of_several_traced_requests_is_one_span_linked_to_each(
    collector: tuple[Collector, str], traced_triton: EmbeddedTriton
) -> None:
    seen, _ = collector
    frontend, service = traced_frontend(collector, traced_triton)
    traces = [new_ids() for _ in range(12)]
    with frontend as running:
        threads = [
            threading.Thread(target=embed, args=(running, 8, {"traceparent": f"00-{t}-{s}-01"}))
            for t, s in traces
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

        def complete() -> list[SpanSeen] | None:
            spans = seen.of_service(service)
            batches = [s for s in spans if s.name == "fair.batch"]
            return spans if len(batches) == len(traces) else None

        spans = await aeventually(complete, SETTLE_S, what="every request's batch span")
    calls = {s.span_id: s for s in spans if s.name == "triton infer embed"}
    linked: dict[str, int] = {}
    for batch in (s for s in spans if s.name == "fair.batch"):
        (call_id,) = batch.links
        linked[call_id] = linked.get(call_id, 0) + 1
    # Every request's batch span names a call to Triton that carried it, and each call
    # was the child of one of its requests and links the others: one span per batch.
    assert set(linked) == set(calls)
    for call_id, requests in linked.items():
        call = calls[call_id]
        assert call.attributes["fair.batch.requests"] == requests
        assert len(call.links) == requests - 1


async def test_an_embeddings_call_is_one_span_over_its_inputs(
    collector: tuple[Collector, str], traced_triton: EmbeddedTriton
) -> None:
    seen, _ = collector
    trace_id, client_span = new_ids()
    frontend, service = traced_frontend(collector, traced_triton)
    with frontend as running:
        body = http_post(
            running,
            "/v1/embeddings",
            {"model": "embed", "input": [[1, 2, 3], [4, 5, 6, 7], [8, 9]]},
            {"traceparent": f"00-{trace_id}-{client_span}-01"},
        )
        assert len(body["data"]) == 3

        def complete() -> list[SpanSeen] | None:
            spans = [s for s in seen.of_trace(trace_id) if s.service == service]
            parts = [s for s in spans if s.name == "infer embed"]
            done = any(s.name == "embeddings embed" for s in spans)
            return spans if done and len(parts) == 3 else None

        spans = await aeventually(complete, SETTLE_S, what="the call's span and its parts'")
    operation = one(spans, "embeddings embed")
    assert operation.parent == client_span and operation.kind == 2
    assert operation.attributes["gen_ai.usage.input_tokens"] == 9
    parts = [s for s in spans if s.name == "infer embed"]
    assert all(p.parent == operation.span_id and p.kind == 1 for p in parts)  # INTERNAL
    assert sorted(p.attributes["gen_ai.usage.input_tokens"] for p in parts) == [2, 3, 4]


async def test_sampling_follows_the_client_and_the_ratio(
    collector: tuple[Collector, str], traced_triton: EmbeddedTriton
) -> None:
    """With ``sample_ratio: 0`` only a client's sampled traceparent is traced; its
    unsampled one and requests without one are not (not a span of theirs is sent)."""
    seen, _ = collector
    sampled, unsampled = new_ids(), new_ids()
    frontend, service = traced_frontend(collector, traced_triton, sample_ratio=0.0)
    with frontend as running:
        embed(running, 4, {})
        embed(running, 4, {"traceparent": f"00-{unsampled[0]}-{unsampled[1]}-00"})
        embed(running, 4, {"traceparent": f"00-{sampled[0]}-{sampled[1]}-01"})

        def complete() -> list[SpanSeen] | None:
            spans = seen.of_service(service)
            return spans if {s.name for s in spans} >= {"infer embed", "fair.batch"} else None

        await aeventually(complete, SETTLE_S, what="the sampled request's spans")
        await running.acall(_flush(running))
    spans = seen.of_service(service)
    assert {s.trace_id for s in spans} == {sampled[0]}
    assert not seen.of_trace(unsampled[0])


async def _flush(running: RunningFrontend) -> None:
    traces = running.frontend.traces
    assert traces is not None
    traces.flush()


@pytest.mark.parametrize(
    "traceparent",
    [
        "00-zz-not-hex-01",
        "00-" + "0" * 32 + "-" + "0" * 16 + "-01",  # all-zero ids: invalid
        "ff-" + "1" * 32 + "-" + "2" * 16 + "-01",  # version ff: forbidden
        "00-" + "a" * 32 + "-" + "b" * 16 + "-01-" + "x" * 4000,  # long, trailing junk
    ],
    ids=["not-hex", "zero-ids", "version-ff", "long"],
)
async def test_a_malformed_traceparent_starts_a_trace_of_its_own(
    collector: tuple[Collector, str], traced_triton: EmbeddedTriton, traceparent: str
) -> None:
    """A client's traceparent is input like any other: one W3C trace context does not
    accept is ignored (the request is served, and traced as a new trace's root)."""
    seen, _ = collector
    frontend, service = traced_frontend(collector, traced_triton)
    with frontend as running:
        body = embed(running, 4, {"traceparent": traceparent})
        assert body["outputs"]

        def request_span() -> SpanSeen | None:
            spans = [s for s in seen.of_service(service) if s.name == "infer embed"]
            return spans[0] if spans else None

        span = await aeventually(request_span, SETTLE_S, what="the request's span")
    assert span.parent == ""  # a root: nothing of the malformed header was taken
    assert span.trace_id not in traceparent


def test_tracing_is_off_by_default() -> None:
    config = parse_config(config_dict())
    assert config.tracing.otlp_endpoint is None
    assert Traces.of(config) is None


# ---- GenAI metrics -----------------------------------------------------------------------------


async def test_genai_metrics_count_beside_the_fair_ones(
    collector: tuple[Collector, str], traced_triton: EmbeddedTriton
) -> None:
    frontend, _ = traced_frontend(collector, traced_triton)
    with frontend as running:
        client = grpcaio.InferenceServerClient(running.grpc_url)

        async def requests() -> AsyncIterator[dict[str, Any]]:
            yield {"model_name": "llm", "inputs": llm_inputs("count me", 4)}

        try:
            async for _, error in client.stream_infer(
                requests(), headers={"x-api-key": KEYS[TENANT]}
            ):
                assert error is None
        finally:
            await client.close()
        embed(running, 4, {})

        async def counted() -> Any:
            samples = await ascrape(running.metrics_url)
            duration = samples.sum(
                "gen_ai_server_request_duration_seconds_count", gen_ai_request_model="embed"
            )
            first = samples.sum(
                "gen_ai_server_time_to_first_token_seconds_count", gen_ai_request_model="llm"
            )
            per_token = samples.sum(
                "gen_ai_server_time_per_output_token_seconds_count", gen_ai_request_model="llm"
            )
            return (duration, first, per_token) if duration and first and per_token else None

        duration, first, per_token = await aeventually(counted, SETTLE_S, what="GenAI metrics")
    assert duration == 1 and first == 1
    assert per_token == 3  # 4 tokens: 3 gaps after the first
