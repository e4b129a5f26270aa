"""The shell's side of the service: what both transports call, in every shell.

One inference request: identity (API key) -> the model's name (its length, then whether
the tenant may call it: ``ModelAccess``) -> the model's description (from the core,
kept) -> validation against it -> a ``Call`` to the core -> its answer. What is refused
here (no key, a model the tenant may not call, bad input, an unknown model) never
reaches the core: the shell answers it, logs it, and tallies it for the core's metrics
and statistics. What reaches the core is counted and logged there, once, whatever its
outcome.

Model names are the client's choice: a refusal is tallied under its model's name only
where that model is known to exist (configured, or looked up here) and open to the
tenant; every other refusal under ``UNLABELLED_MODEL``, so that no name a client makes up
becomes a metric label or a statistics entry.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import re
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractContextManager, aclosing, nullcontext
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import msgspec
from tritonclient.grpc import service_pb2

from fair_frontend.auth import Authenticator, Identity, KeyRing, ModelAccess
from fair_frontend.backends.triton.forwarder import TritonForwarder, TritonStream
from fair_frontend.backends.triton.sse import SseStream
from fair_frontend.backends.triton.upstream import upstream_message_error
from fair_frontend.batching import pack, unpack, wire_key
from fair_frontend.config import Config, Endpoint, SideDoors
from fair_frontend.endpoint import EndpointPlan
from fair_frontend.endpoint import plan as endpoint_plan
from fair_frontend.errors import (
    FrontendError,
    Internal,
    InvalidArgument,
    QueueFull,
    Unavailable,
    UnknownModel,
    Unsupported,
)
from fair_frontend.grpc_codec import drop_output, output_tokens_said
from fair_frontend.logs import RequestLog
from fair_frontend.models import (
    Checked,
    ModelInfo,
    RefusedByModel,
    check_declared,
    prompt_texts,
    validate,
)
from fair_frontend.outcomes import Outcome
from fair_frontend.protocol import (
    FINAL_RESPONSE,
    MAX_NAME_BYTES,
    Batch,
    InferRequest,
    InferResponse,
    ParamValue,
    Precheck,
    check_name,
    clipped,
    take_program,
    take_slo_class,
)
from fair_frontend.shell.generate_codec import encode_generate_request
from fair_frontend.shell.link import CoreLink, Inbox
from fair_frontend.shell.lookup_cache import Key, LookupCache
from fair_frontend.shell.turns import Turns
from fair_frontend.tokens import (
    TokenCounter,
    ask_token_counts,
    at_least_tokens,
    counted_tokens,
    output_tokens,
    utf8_size,
    without_output,
)
from fair_frontend.tracing import Traces, carried, failed, wall_ns
from fair_frontend.usage import INCLUDE_USAGE, Usage
from fair_frontend.wire.records import (
    SIDE_DOOR_LOOKUP,
    Answer,
    Call,
    Fault,
    Grant,
    Rows,
    RowsDone,
    TallyEntry,
)

if TYPE_CHECKING:
    from opentelemetry.trace import Span

T = TypeVar("T")

log = logging.getLogger(__name__)

# Server metadata extensions the frontend implements (a subset of Triton's: no shared
# memory, which cannot cross hosts; no repository control or tracing, which stay with
# the operator of Triton itself). It lists those the Triton behind it has too.
EXTENSIONS = (
    "classification",
    "statistics",
    "sequence",
    "schedule_policy",
    "model_configuration",
    "binary_tensor_data",
    "parameters",
)
# What the tenant ports list with ``server.statistics: operator``: statistics
# then live on the operator's listener only, and perf_analyzer, reading this list, does
# not ask for them.
EXTENSIONS_WITHOUT_STATISTICS = tuple(e for e in EXTENSIONS if e != "statistics")
# Where the frontend names itself: an HTTP response header and a gRPC initial metadata
# entry beside the server metadata, which answers with the name and version of the Triton
# behind it, as clients expect (Triton's simple_*_health_metadata.py examples check for
# the name "triton").
FRONTEND_HEADER = "x-fair-frontend"
# The parts of one call a shell checks before its loop runs anything else (a call of
# many parts, checked part by part, lets other requests through between these).
PARTS_PER_ITERATION = 256
# The model a refusal is tallied under when its own name may not be a label (the metrics
# count it as ``endpoint="other"``; the statistics not at all).
UNLABELLED_MODEL = ""
# Grants one stream may have: one whose Triton is gone before it answered anything is
# given back to the core for another (``Gateway._relay``), but not for ever (a Triton
# that fails every stream at once while its probe says ready would take it back each time).
STREAM_GRANTS = 3


Wire = Literal["", "sse", "grpc", "events"]
"""How a stream's client reads it, where Triton's own bytes may serve it (``stream_infer``):
"" decoded responses; "sse" generate_stream's events; "grpc" ModelStreamInfer's messages;
"events" the same events, for a reader in this shell (the OpenAI routes)."""


class Gateway:
    """Decoded requests in, answers out: identity, validation, the call to the core."""

    # The side doors' cache and the config it was made for (``_lookups``).
    _cache: LookupCache | None = None
    _cache_config: Config | None = None
    # Each model's plan, and the config they were made for (``plan``).
    _plans_config: Config | None = None

    def __init__(
        self,
        config: Config,
        keyring: KeyRing,
        link: CoreLink,
        triton: TritonForwarder | Sequence[TritonForwarder],
    ) -> None:
        self.link = link
        # Each Triton of the pool, in the order of ``Settings.triton_urls`` (a ``Grant``
        # names one by its index); the first one alone where there is one.
        self.tritons: list[TritonForwarder] = (
            list(triton) if isinstance(triton, (list, tuple)) else [triton]  # type: ignore[list-item]
        )
        # Metadata, config and readiness come from Triton itself: the first that answers
        # (the pool's Tritons serve the same models).
        self.triton = self.tritons[0]
        self.log = RequestLog()
        self._infos: dict[str, ModelInfo] = {}
        self._plans: dict[str, EndpointPlan] = {}
        self.tokens = TokenCounter()  # text prompts are tokenised off the event loop
        self.turns = Turns()  # requests' decodes, round robin per tenant under a burst
        # Request traces: ``tracing.*`` takes a restart (a reload keeps the first config's).
        self.traces = Traces.of(config)
        # A link that takes grants of rows (a shell process's): unary calls to a one-hop
        # endpoint keep their tensors here and go as their facts (``records``).
        rows_link: Any = link if getattr(link, "takes_rows", False) else None
        if rows_link is not None:
            rows_link.on_rows = self.send_rows
        self._rows_link = rows_link
        # Calls whose granted rows are in Triton now: set when their send is over.
        self._sending: dict[int, asyncio.Event] = {}
        self._parts: set[asyncio.Task[None]] = set()
        self.configure(config, keyring)

    def configure(self, config: Config, keyring: KeyRing) -> None:
        """Apply a (re)loaded config: keys, tenants, who may call which model, endpoints'
        policies."""
        self.config = config
        self.auth = Authenticator.from_config(config, keyring)
        self.access = ModelAccess.from_config(config)

    # ---- inference ----------------------------------------------------------------------

    async def infer(
        self,
        req: InferRequest,
        headers: Mapping[str, str],
        known: Identity | None = None,
        *,
        usage: Usage | None = None,
        requests: int = 1,
        operation: str = "infer",
    ) -> InferResponse:
        """One request, one response (ModelInfer, HTTP infer). ``known``: its tenant as
        the transport found it from the headers (``admit_early``), if it did. ``usage``:
        filled in with what the request used, as it goes. ``requests``: what it counts
        against its tenant's request limits (0 for every part of an API call made of
        several, but its first: ``Call.requests``). ``operation``: its trace span's name
        (``fair_frontend.tracing``), before the model's."""
        replies = self._replies(
            req, headers, known, False, usage=usage, requests=requests, operation=operation
        )
        try:
            return await anext(replies)
        finally:
            await replies.aclose()

    async def infer_group(
        self,
        reqs: Sequence[InferRequest],
        headers: Mapping[str, str],
        known: Identity | None = None,
        *,
        usages: Sequence[Usage],
        paid: Precharge | None = None,
        operation: str = "infer",
    ) -> list[InferResponse]:
        """The parts of one API call (an embeddings' inputs, a rerank's documents: a row
        each), each a request of its own, admitted or refused as a whole before any of
        them queues (``records.Group``, ``Core.submit_group``): the call counts one
        request against its tenant's request limits and every part's tokens against its
        token limits, in one check, and no part queues if the call cannot be admitted
        whole (its limits, the queue caps, the throttle). Once admitted each part is
        scheduled on its own (the fair batches take the call row by row beside other
        tenants' calls). Their answers, in order; the first failure cancels the others
        and is raised (the call has one answer). ``usages[i]``: filled in with what part
        ``i`` used. ``paid``: what a precharge counted for the call before its texts were
        tokenised (``precharge``): the call counts only the rest. ``operation``: each
        part's trace span's name, before the model's."""
        arrived = time.monotonic()
        arrived_wall = time.time()
        head = reqs[0]
        model = head.model
        tenant: str | None = None
        info: ModelInfo | None = None
        current = head
        checked: list[tuple[Checked, int]] = []
        try:
            tenant = self.auth.confirm(known, headers, head.tenant_claim)
            program = take_program(head, headers)
            slo_class = take_slo_class(head, headers, self.config.slo_classes)
            self._admit_model(tenant, model)
            self._shed(tenant, model, sum(r.nbytes for r in reqs))
            plan = await self.plan(model)
            info, endpoint = plan.info, plan.endpoint
            if info.decoupled:
                raise Unsupported(f"model '{model}' streams its answers: it takes no call of parts")
            for i, req in enumerate(reqs):
                if i and not i % PARTS_PER_ITERATION:
                    await asyncio.sleep(0)  # a call of 10,000 parts: other requests between
                current = req
                if req.model != model:
                    raise Internal("the parts of one call are for one model")
                texts = prompt_texts(req, info, endpoint)
                counts = None
                if texts is not None and plan.tokenizer is not None:
                    counts = await self.tokens.count(tenant, plan.tokenizer, texts)
                ok = validate(req, info, endpoint, text_tokens=counts)
                checked.append((ok, self._priority(req.priority, tenant, model)))
        except FrontendError as err:
            self._refused(tenant, current, err, arrived, info)
            raise
        except asyncio.CancelledError:
            self._refused(tenant, current, None, arrived, info)
            raise
        calls: list[Call] = []
        spans: list[Span] = []
        for i, (req, (ok, priority)) in enumerate(zip(reqs, checked, strict=True)):
            call = Call(
                self.link.new_id(),
                tenant,
                priority,
                arrived,
                arrived_wall,
                ok.rows,
                ok.tokens,
                req.nbytes,
                ok.lengths,
                req,
                False,
                ok.max_tokens,
                0 if i else 1,  # the call's request, once (OpenAI's limits count calls)
                program=program,
                slo_class=slo_class,
            )
            if self.traces is not None:
                span = self.traces.request(
                    f"{operation} {model}",
                    headers,
                    arrived,
                    {"gen_ai.operation.name": operation, "gen_ai.request.model": model},
                )
                span.set_attributes({"fair.tenant": tenant, "fair.priority": priority})
                call.traceparent, call.tracestate = carried(span)
                spans.append(span)
            usages[i].prompt_tokens = ok.tokens - ok.max_tokens
            calls.append(call)
        if paid is not None:
            paid.settled_by(calls[0])
        # From here on the core counts and logs each part, whatever its outcome.
        if self._keeps_rows(plan):
            inboxes = self.link.submit_group([_facts(c, plan) for c in calls])
            for inbox, call in zip(inboxes, calls, strict=True):
                inbox.held = (call, plan)
        else:
            inboxes = self.link.submit_group(calls)
        failure: FrontendError | None = None
        try:
            answers = await _answers(inboxes)
            out = []
            for req, answer, usage in zip(reqs, answers, usages, strict=True):
                if plan.token_output is not None:
                    usage.completion_tokens = output_tokens(
                        answer.outputs, plan.token_output, plan.tokenizer, req
                    )
                out.append(
                    InferResponse(
                        req.model, answer.version, req.id, answer.outputs, {}, answer.quota
                    )
                )
            return out
        except FrontendError as err:
            failure = err
            raise
        finally:
            for inbox in inboxes:
                inbox.cancel()  # no-op once answered
            for span, usage in zip(spans, usages, strict=False):
                if failure is not None:
                    failed(span, failure)
                span.set_attribute("gen_ai.usage.input_tokens", usage.prompt_tokens)
                span.set_attribute("gen_ai.usage.output_tokens", usage.completion_tokens)
                span.end()

    async def precharge(self, tenant: str | None, model: str, tokens: int) -> Precharge | None:
        """Count a request's cost against its tenant's limits on ``model`` before its text
        is tokenised (``records.Precharge``): the request itself and ``tokens``, what its
        text has at least (``tokens.at_least_tokens``), so that tokenising is paid for
        even where the request is refused after it. Raises the 429 where that does not
        fit (nothing is tokenised then). None: nothing was counted (a tenant without
        limits on the model, or not known yet; a rate-limit storage that did not answer):
        the request counts in full at its admission. Its ``Call`` carries what was
        counted (``Precharge.settled_by``)."""
        if tenant is None or tenant not in self.config.tenants:
            return None
        if not self.config.limits_for(tenant, model).items():
            return None  # nothing to count: no round trip
        at = await self.link.precharge(tenant, model, 1, tokens)
        return None if at is None else Precharge(tokens, at)

    def stream_infer(
        self,
        req: InferRequest,
        headers: Mapping[str, str],
        known: Identity | None = None,
        *,
        usage: Usage | None = None,
        operation: str = "stream_infer",
        wire: Wire = "",
    ) -> AsyncGenerator[InferResponse, None]:
        """One request on a stream (ModelStreamInfer, generate): its responses; several
        for a decoupled model, exactly one otherwise. ``aclose()`` cancels it. ``known``,
        ``usage`` and ``operation``: as for ``infer`` (a stream's, found once for all its
        messages). ``wire``: how the client reads it, where a granted stream may come as
        Triton's own bytes, passed on (``InferResponse.wire``): ``sse``, generate_stream's
        events (``_relay_events``); ``grpc``, ModelStreamInfer's messages (``_relay``);
        ``events``, the same events for a caller that reads them itself (the OpenAI routes,
        which take the text of each and ignore the rest)."""
        return self._replies(req, headers, known, True, usage=usage, operation=operation, wire=wire)

    def operation(
        self, name: str, model: str, headers: Mapping[str, str], started: float
    ) -> AbstractContextManager[Span | None]:
        """An API call of several requests (an embeddings' inputs, a rerank's documents):
        its trace span, their parent (``Traces.operation``); nothing with tracing off."""
        if self.traces is None:
            return nullcontext()
        attributes = {"gen_ai.operation.name": name, "gen_ai.request.model": model}
        return self.traces.operation(f"{name} {model}", headers, started, attributes)

    def _replies(
        self,
        req: InferRequest,
        headers: Mapping[str, str],
        known: Identity | None,
        streaming: bool,
        *,
        usage: Usage | None,
        operation: str,
        requests: int = 1,
        wire: Wire = "",
    ) -> AsyncGenerator[InferResponse, None]:
        if self.traces is None:  # tracing off: the request's own generator, nothing more
            return self._handle(
                req, headers, known, streaming=streaming, usage=usage, requests=requests,
                wire=wire,
            )  # fmt: skip
        return self._traced(req, headers, known, streaming, usage, operation, requests, wire)

    async def _traced(
        self,
        req: InferRequest,
        headers: Mapping[str, str],
        known: Identity | None,
        streaming: bool,
        usage: Usage | None,
        operation: str,
        requests: int,
        wire: Wire,
    ) -> AsyncGenerator[InferResponse, None]:
        """``_handle`` inside the request's span (``Traces.request``): its tenant,
        priority and usage on it, and how it ended."""
        assert self.traces is not None
        usage = usage or Usage()  # counted for the span whether the client asked or not
        # The name's length is checked at the door where the headers name the tenant, in
        # ``_handle`` where the request does (a trusted gateway's claim): clipped here.
        model = clipped(req.model, MAX_NAME_BYTES)
        span = self.traces.request(
            f"{operation} {model}",
            headers,
            time.monotonic(),
            {"gen_ai.operation.name": operation, "gen_ai.request.model": model},
        )
        replies = self._handle(
            req, headers, known, streaming=streaming, usage=usage, requests=requests, span=span,
            wire=wire,
        )  # fmt: skip
        try:
            async with aclosing(replies):
                async for resp in replies:
                    yield resp
        except FrontendError as err:
            failed(span, err)
            raise
        finally:
            span.set_attribute("gen_ai.usage.input_tokens", usage.prompt_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", usage.completion_tokens)
            span.end()

    async def _handle(
        self,
        req: InferRequest,
        headers: Mapping[str, str],
        known: Identity | None,
        *,
        streaming: bool,
        usage: Usage | None = None,
        requests: int = 1,
        span: Span | None = None,
        wire: Wire = "",
    ) -> AsyncGenerator[InferResponse, None]:
        arrived = time.monotonic()
        arrived_wall = time.time()
        tenant: str | None = None
        info: ModelInfo | None = None
        report_usage = False
        paid: Precharge | None = None
        try:
            tenant = self.auth.confirm(known, headers, req.tenant_claim)
            program = take_program(req, headers)
            slo_class = take_slo_class(req, headers, self.config.slo_classes)
            if _wants_usage(req):  # the client asked for USAGE_PARAMETERS
                usage = usage or Usage()
                report_usage = True
            self._admit_model(tenant, req.model)
            self._shed(tenant, req.model, req.nbytes)
            plan = await self.plan(req.model)
            info, endpoint = plan.info, plan.endpoint
            if info.decoupled and not streaming:
                raise Unsupported(
                    "ModelInfer RPC doesn't support models with decoupled transaction policy"
                )
            texts = prompt_texts(req, info, endpoint)  # refuses what its bytes prove too long
            counts = None
            if texts is not None and plan.tokenizer is not None:
                if sum(len(t) for t in texts) > self.tokens.inline_bytes:
                    widest = plan.bounds.max_token_bytes
                    least = sum(at_least_tokens(utf8_size(t), widest) for t in texts)
                    paid = await self.precharge(tenant, req.model, least)
                counts = await self.tokens.count(tenant, plan.tokenizer, texts)
            checked = validate(req, info, endpoint, text_tokens=counts)
            priority = self._priority(req.priority, tenant, req.model)
        except FrontendError as err:
            self._refused(tenant, req, err, arrived, info)
            raise
        except asyncio.CancelledError:
            self._refused(tenant, req, None, arrived, info)
            raise
        call = Call(
            self.link.new_id(),
            tenant,
            priority,
            arrived,
            arrived_wall,
            checked.rows,
            checked.tokens,
            req.nbytes,
            checked.lengths,
            req,
            streaming,
            checked.max_tokens,
            requests,
            program=program,
            slo_class=slo_class,
        )
        if paid is not None:
            paid.settled_by(call)
        if span is not None:
            span.set_attributes({"fair.tenant": tenant, "fair.priority": priority})
            call.traceparent, call.tracestate = carried(span)
        if usage is not None:
            usage.prompt_tokens = checked.tokens - checked.max_tokens
        # From here on the core counts the request, whatever its outcome, and logs it
        # unless it takes one hop: then this shell answers it, and logs it (``_logged``)
        # where the config says the shells do (``observability.request_log``).
        logged = False
        if self._keeps_rows(plan):
            logged = self.config.observability.request_log == "shell"
            inbox = self.link.submit(_facts(call, plan, logged=logged))
            inbox.held = (call, plan)
        elif plan.info.decoupled:
            # Its stream goes from here to Triton when the core grants it a slot (one
            # hop): the core decides on its facts, never its tensors; where this shell is
            # a process of its own it writes the stream's line at its end, as it does
            # for a unary call it answers (the core writes one line fewer per request).
            logged = self._rows_link is not None and (
                self.config.observability.request_log == "shell"
            )
            inbox = self.link.submit(_facts(call, plan, key=False, logged=logged))
            if logged:
                inbox.on_end = partial(self._stream_logged, call, inbox)
        else:
            inbox = self.link.submit(call)
        try:
            answer = await self._answer_of(call, inbox, logged)
            grants = 0
            while isinstance(answer, Grant):
                grants += 1
                replies = self._relay(
                    call, info, endpoint, answer, inbox, streaming, usage, report_usage, span,
                    give_back=grants < STREAM_GRANTS, wire=wire,
                )  # fmt: skip
                async with aclosing(replies):
                    async for resp in replies:
                        yield resp
                if inbox.done:
                    return
                # Given back (its Triton was gone before it answered anything): the
                # core's next grant, to another Triton, or its answer.
                answer = await self._answer_of(call, inbox, logged)
            if answer.fault is not None:
                raise answer.fault.error()  # with its quota (``FrontendError.quota``)
            final: dict[str, ParamValue] = (
                {FINAL_RESPONSE: True} if streaming and req.empty_final_response else {}
            )
            if usage is not None:
                if plan.token_output is not None:
                    usage.completion_tokens = output_tokens(
                        answer.outputs, plan.token_output, plan.tokenizer, req
                    )
                if report_usage:
                    final.update(usage.as_parameters())
            yield InferResponse(
                req.model, answer.version, req.id, answer.outputs, final, answer.quota
            )
        finally:
            inbox.cancel()  # no-op once answered or ended

    # ---- granted rows: a batch's part, sent from here (``core.granted``) -----------------

    def _keeps_rows(self, plan: EndpointPlan) -> bool:
        """Whether a unary call keeps its tensors here (its facts go to the core)."""
        return self._rows_link is not None and plan.one_hop

    def send_rows(self, rows: Rows, inboxes: list[Inbox | None]) -> None:
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
        link = self._rows_link
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
            version, outs, traceparent = await self._infer_rows(
                rows, calls, plan.info, plan.endpoint, started
            )
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
        self, rows: Rows, calls: list[Call], info: ModelInfo, endpoint: Endpoint, started: float
    ) -> tuple[str, list[list[Any]], str]:
        """The part's one Triton request: (the version that ran, each call's outputs, the
        traceparent of its span where traced)."""
        packed = pack(calls, info, endpoint)
        forwarder = self.tritons[rows.backend]
        first = calls[0].request
        span = None
        traceparent = ""
        if self.traces is not None:
            span = self.traces.batch(rows.model, calls, forwarder.url, started)
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
        return version, unpack(outputs, calls, info, endpoint, packed.stripped), traceparent

    async def _relay(
        self,
        call: Call,
        info: ModelInfo,
        endpoint: Endpoint,
        grant: Grant,
        inbox: Inbox,
        streaming: bool,
        usage: Usage | None = None,
        report_usage: bool = False,
        span: Span | None = None,
        *,
        give_back: bool = True,
        wire: Wire = "",
    ) -> AsyncGenerator[InferResponse, None]:
        """A granted call: its shell (this one) sends it to Triton and relays the
        responses to the client as they come, one hop (``records``, the module
        docstring), counting the output tokens they carry for the core. The slot goes
        back once, however it ends: served, Triton's error, the core taking it back
        (``on_revoke``), a client that stops reading (``TritonStream``), or one that went
        away (this generator closed). A Triton that is gone before the client had any
        response (not reached, or lost before its first) gives the call back to the core
        instead (``Inbox.again``: it ends with nothing yielded and the inbox not done),
        to be granted to another Triton, unless ``give_back`` is false (its last grant:
        ``STREAM_GRANTS``). ``span``: the request's, where it is traced:
        the call to Triton gets its own under it, whose context Triton gets. ``wire``:
        the client's protocol (``stream_infer``): where Triton's own bytes serve it, they
        are read and passed on, generate_stream's events (``_relay_events``) or
        ModelStreamInfer's messages, parsed but not decoded (``raw``)."""
        req = call.request
        # Its tokens counted from what each response says it carries, where the model
        # says (``token_count_output``); the client sees that output only if it asked.
        sent, count, hide = ask_token_counts(req, info, endpoint)
        if sent is not req:
            call = msgspec.structs.replace(call, request=sent)
        packed = pack([call], info, endpoint)
        want_final = streaming and req.empty_final_response
        triton = self.tritons[grant.backend]
        body = None
        # Triton's own events serve the client where the shell has nothing to add to them
        # (usage, an empty final) and counts their tokens from an output of the model; a
        # reader of its own (``events``) picks the outputs it reads from them.
        readable = wire in ("sse", "events") and triton.events is not None and count is not None
        named = wire == "sse" and bool(packed.outputs)  # generate cannot name outputs
        if readable and not (report_usage or want_final or grant.sequence or named):
            body = encode_generate_request(packed.inputs, packed.parameters, req.id)
        traced = None
        if span is not None and call.traceparent:
            assert self.traces is not None
            traced = self.traces.stream(span, req.model, time.monotonic())
            traced.set_attribute("server.address", triton.url)
        traceparent = carried(traced)[0] if traced is not None else ""
        stalled_s = self.config.queues.stalled_stream_s
        version = req.version or info.latest_version
        tally = _Tally(inbox, call.arrived, traced, usage)
        if body is not None:
            assert triton.events is not None and count is not None
            upstream = triton.events.stream(
                req.model, req.version, body, stalled_s=stalled_s, traceparent=traceparent
            )
            hide = hide and wire == "sse"  # (the other reader never looks at the count)
            replies = self._relay_events(
                call, grant, inbox, upstream, count, hide, version, tally, give_back
            )
            async with aclosing(replies):
                async for resp in replies:
                    yield resp
            return
        # Triton's messages pass on to a gRPC client as they came, but for the count the
        # client did not ask for; the shell parses them, and decodes only that count.
        raw = wire == "grpc" and count is not None and not report_usage
        stream = triton.stream(
            Batch(
                req.model,
                req.version,
                packed.inputs,
                packed.outputs,
                packed.parameters,
                request_id=req.id,
                sequence=grant.sequence,
                traceparent=traceparent,
            ),
            stalled_s=stalled_s,
            raw=raw,
        )
        _watched(stream, inbox)
        name = endpoint.token_output
        answered = False  # anything yielded to the client: the stream cannot be replayed
        try:
            async for reply in stream:
                if reply.error is not None:
                    _stream_failed(reply.error, stream.stopped, tally, grant, version,
                                   give_back=give_back and not answered)  # fmt: skip
                    return  # given back
                version = reply.version or version
                if raw:
                    assert count is not None
                    msg = reply.message.infer_response
                    said = output_tokens_said(msg, count)
                    n = int(any(o.name == name for o in msg.outputs)) if said is None else said
                    if n > 0:
                        tally.add(n)
                    if reply.final:
                        inbox.end(version)
                    data = reply.raw
                    if hide:
                        drop_output(msg, count)
                        data = reply.message.SerializeToString()
                    if not msg.outputs and not (reply.final and want_final):
                        continue  # Triton's empty final: only for clients that asked
                    answered = True
                    yield InferResponse(req.model, version, req.id, [], {}, grant.quota, data)
                    continue
                if name is not None and any(t.name == name and t.data.size for t in reply.outputs):
                    # An engine streams one response per decode step; a whole answer in
                    # one response (its final and first: not streamed) counts in tokens.
                    n = 1
                    said = counted_tokens(reply.outputs, count) if count is not None else None
                    if said is not None:
                        n = said
                    elif reply.final and not tally.produced:
                        n = output_tokens(reply.outputs, name, endpoint.tokenizer, req)
                    if n > 0:  # (a response may say it carries no token)
                        tally.add(n)
                if reply.final:
                    inbox.end(version)  # the core hears of it before the client does
                if hide:
                    assert count is not None
                    reply.outputs = without_output(reply.outputs, count)
                if not reply.outputs and not (reply.final and want_final):
                    continue  # Triton's empty final: only for clients that asked
                params: dict[str, ParamValue] = {FINAL_RESPONSE: reply.final} if want_final else {}
                if reply.final and report_usage:
                    assert usage is not None
                    params.update(usage.as_parameters())
                answered = True
                yield InferResponse(req.model, version, req.id, reply.outputs, params, grant.quota)
            inbox.end(version)
        except FrontendError as err:
            if traced is not None:
                failed(traced, err)
            raise
        finally:
            inbox.end(cancelled=True)  # no-op once ended
            await stream.aclose()
            tally.close()

    async def _relay_events(
        self,
        call: Call,
        grant: Grant,
        inbox: Inbox,
        stream: SseStream,
        count: str,
        hide: bool,
        version: str,
        tally: _Tally,
        give_back: bool,
    ) -> AsyncGenerator[InferResponse, None]:
        """``_relay`` for a client of generate_stream (or a reader in this shell that takes
        the text of each event: the OpenAI routes, ``wire="events"``): Triton's own
        events, passed on as they came (several at once when they came together). The
        shell reads only what it counts: each event's tokens (the ``count`` output, taken
        out where the client did not ask for it; an event without it: one token), an
        error event (Triton's last), the model version once, the end of the body (the
        final response: generate_stream ends with it)."""
        req = call.request
        tokens_in = _EventCounts.of(count)
        _watched(stream, inbox)
        answered = False
        try:
            async for got in stream:
                if got.error is not None:
                    _stream_failed(got.error, stream.stopped, tally, grant, version,
                                   give_back=give_back and not answered)  # fmt: skip
                    return  # given back
                data = got.data
                error = None
                cut = data.find(_ERROR_EVENT)
                if cut >= 0:  # the model's error: Triton's last event
                    error = upstream_message_error(_event_error(data[cut:]))
                    data = data[:cut]
                if data:
                    if not answered and (found := _VERSION.search(data)) is not None:
                        version = found[1].decode()
                    n, data = tokens_in(data, hide)
                    if n > 0:
                        tally.add(n)
                    answered = True
                    yield InferResponse(req.model, version, req.id, [], {}, grant.quota, data)
                if error is not None:
                    _stream_failed(error, None, tally, grant, version, give_back=False)
            inbox.end(version)
        except FrontendError as err:
            if tally.traced is not None:
                failed(tally.traced, err)
            raise
        finally:
            inbox.end(cancelled=True)  # no-op once ended
            await stream.aclose()
            tally.close()

    def admit_early(self, model: str, headers: Mapping[str, str]) -> Identity | None:
        """Refuse what the headers (and the model's name) alone decide, before a body is
        read: no key or an unknown one (401/403), a model name too long (400) or one the
        tenant may not call (403), a tier the throttle closed on the model or a queue
        that is full (503). A flood of any of them
        then costs no body read, decompression or decoding. ``model`` "": not known yet
        (a gRPC message that does not name it first); ``infer`` checks it after decoding.
        Returns the tenant, as far as the headers tell
        (``Authenticator.identify_by_headers``), for ``infer`` not to read them again."""
        auth = self.auth
        tenant = auth.identify_by_headers(headers)
        self.shed(tenant, model)
        return None if tenant is None else Identity(tenant, auth)

    def shed(self, tenant: str | None, model: str) -> None:
        """Refuse a request of ``tenant`` (as ``admit_early`` found it; None: not known
        yet) for ``model`` ("": not known yet) that the tenant may not call (400/403), or
        whose tier the throttle closed on it or whose queue is full (503)."""
        if tenant is not None:
            if model:
                self._admit_model(tenant, model)
            self._shed(tenant, model)

    def _admit_model(self, tenant: str, model: str) -> None:
        """The model's name is short enough to echo (400), and the tenant may call it
        (403): asked before any lookup, so the answer is the same whether or not Triton
        has the model."""
        check_name("model name", model)
        self.access.check(tenant, model)

    def _label(self, tenant: str | None, model: str) -> str:
        """The model a refusal is tallied under: its own name only where it is known to
        exist (configured, or looked up by this shell) and, for a known tenant, open to
        it; else ``UNLABELLED_MODEL`` (see the module docstring)."""
        if model not in self.config.endpoints and model not in self._infos:
            return UNLABELLED_MODEL
        if tenant is not None and not self.access.allows(tenant, model):
            return UNLABELLED_MODEL
        return model

    def _shed(self, tenant: str, model: str, nbytes: int = 0) -> None:
        """Refuse what the core would: a tier its throttle closed on ``model`` (503 with
        the core's message and Retry-After; checked first, as the core throttles before it
        queues), a full queue."""
        if model:
            terms = self.config.tenants.get(tenant)
            if terms is not None:
                overloaded = self.link.overloaded(terms.tier, model)
                if overloaded is not None:
                    raise overloaded
        cap = self.link.queue_full(tenant, model, nbytes)
        if cap is not None:
            raise QueueFull(cap)

    def rejected(
        self,
        model: str,
        headers: Mapping[str, str],
        err: FrontendError,
        latency_s: float,
        *,
        request_id: str = "",
    ) -> None:
        """A request the transport refused before ``infer`` (by its headers or size, or
        it could not be decoded); ``request_id`` as far as the transport could tell. One
        the model's checks refused before its tensors were converted counts as a failure
        in the model's statistics, as it would in ``infer``."""
        try:
            tenant: str | None = self.auth.identify(headers, None)
        except FrontendError:
            tenant = None
        self.log.request_finished(
            tenant=tenant, model=model, outcome=err.outcome, queued_s=None,
            request_id=request_id, latency_s=latency_s, error=err.message,
        )  # fmt: skip
        failed = err.version if tenant is not None and isinstance(err, RefusedByModel) else None
        self.link.tally(
            TallyEntry(
                tenant,
                self._label(tenant, model),
                err.outcome.value,
                1,
                failed,
                latency_s if failed else 0.0,
            )
        )

    async def _answer_of(self, call: Call, inbox: Inbox, logged: bool) -> Answer | Grant:
        """The core's word on ``call`` (its answer, or a grant); where this shell writes
        the call's request-log line (``logged``), an answer's is written now (a grant's at
        its stream's end: ``_stream_logged``), as is a client's that went away first."""
        try:
            answer = await inbox.get()
        except asyncio.CancelledError:
            if logged:  # its client went away before its answer
                self._logged(call, None, inbox)
            raise
        if logged:
            self._logged(call, answer, inbox)
        return answer

    def _stream_logged(
        self, call: Call, inbox: Inbox, version: str, fault: FrontendError | None, cancelled: bool
    ) -> None:
        """The request-log line of a granted stream this shell relayed, at its end (told
        to the core, which writes none: ``Call.logged``): served, failed with ``fault``
        or ``cancelled``, with the core's queue time, its time since the grant and the
        output tokens it relayed, as the core would write it."""
        grant = inbox.answered
        queued_s = grant.queued_s if isinstance(grant, Grant) and grant.queued_s >= 0 else None
        if cancelled:
            outcome, error = Outcome.CANCELLED, None
        elif fault is not None:
            outcome, error = fault.outcome, fault.message
        else:
            outcome, error = Outcome.DISPATCHED, None
        now = time.monotonic()
        self.log.request_finished(
            tenant=call.tenant, model=call.request.model, outcome=outcome, queued_s=queued_s,
            request_id=call.request.id, latency_s=now - call.arrived, error=error,
            usage=Usage(call.tokens - call.max_tokens, inbox.tokens),
            service_s=now - inbox.granted_at,
        )  # fmt: skip

    def _logged(self, call: Call, answer: Answer | Grant | None, inbox: Inbox) -> None:
        """The request-log line of a call this shell answers itself (one hop), as the core
        would write it: ``answer`` the core's word (its rows served here: ``Inbox.served``;
        or its refusal or failure), None where its client went away first."""
        req = call.request
        usage = Usage(call.tokens - call.max_tokens, 0)
        queued_s: float | None = None
        service_s: float | None = None
        error: str | None = None
        if answer is None:
            outcome = Outcome.CANCELLED
        elif isinstance(answer, Grant):  # its stream's line comes at its end
            return
        else:
            queued_s = answer.queued_s if answer.queued_s >= 0 else None
            if answer.fault is None:
                outcome = Outcome.DISPATCHED
                if inbox.served is not None:
                    service_s, usage.completion_tokens = inbox.served
            else:
                outcome = Outcome(answer.fault.outcome)
                error = answer.fault.message
        self.log.request_finished(
            tenant=call.tenant, model=req.model, outcome=outcome, queued_s=queued_s,
            request_id=req.id, latency_s=time.monotonic() - call.arrived, error=error,
            usage=usage, service_s=service_s,
        )  # fmt: skip

    def _refused(
        self,
        tenant: str | None,
        req: InferRequest,
        err: FrontendError | None,
        arrived: float,
        info: ModelInfo | None,
    ) -> None:
        """Count and log a request this shell answered itself (``err`` None: cancelled)."""
        outcome = err.outcome if err is not None else Outcome.CANCELLED
        latency_s = time.monotonic() - arrived
        self.log.request_finished(
            tenant=tenant, model=req.model, outcome=outcome, queued_s=None,
            request_id=req.id, latency_s=latency_s,
            error=err.message if err is not None else None,
        )  # fmt: skip
        failed: str | None = None
        if tenant is not None and err is not None and not isinstance(err, UnknownModel):
            failed = ModelInfo.version_for(req.version, info)
        model = self._label(tenant, req.model)
        self.link.tally(
            TallyEntry(tenant, model, outcome.value, 1, failed, latency_s if failed else 0.0)
        )

    async def model_info(self, model: str) -> ModelInfo:
        """The model's description (kept once looked up); raises ``UnknownModel``."""
        return await self._model_info(model)

    # ---- what a request may take (``models.RequestBounds``): read before its bytes ------

    async def wire_bound(self, model: str) -> int:
        """The largest request (HTTP body, gRPC message) read for ``model``: its own
        bound, from its description (looked up first; ``UnknownModel`` if Triton has no
        such model)."""
        plan = await self.plan(model)
        return plan.bounds.wire_bytes

    def kept_wire_bound(self, model: str) -> int:
        """``wire_bound`` without waiting: the model's bound once this shell has its
        description, the endpoint's configured one until then."""
        plan = self._kept_plan(model)
        if plan is None:
            return self.config.endpoint(model).max_wire_bytes
        return plan.bounds.wire_bytes

    def precheck(self, model: str) -> Precheck | None:
        """The model's checks on a request's inputs as declared, for a codec to make
        before it converts them (``models.check_declared``); None while this shell does
        not have the model's description (``validate`` then checks it all after)."""
        plan = self._kept_plan(model)
        if plan is None:
            return None
        return partial(check_declared, plan.info, plan.endpoint)

    async def plan(self, model: str) -> EndpointPlan:
        """The model's plan under this shell's config (``fair_frontend.endpoint``), made
        once its description is found (``_model_info``) and kept until the config or the
        description changes; raises ``UnknownModel``."""
        plan = self._kept_plan(model)
        if plan is None:
            await self._model_info(model)
            plan = self._kept_plan(model)
            assert plan is not None  # its description is kept now
        return plan

    def _kept_plan(self, model: str) -> EndpointPlan | None:
        """``plan`` without waiting: None while this shell does not have the model's
        description."""
        if self._plans_config is not self.config:
            self._plans = {}
            self._plans_config = self.config
        kept = self._plans.get(model)
        info = self._infos.get(model)
        if kept is None or kept.info is not info:
            if info is None:
                return None
            kept = self._plans[model] = endpoint_plan(self.config, model, info)
        return kept

    async def _model_info(self, model: str) -> ModelInfo:
        """Kept once found; concurrent first lookups share one (a caller that goes away
        does not fail the others), and "no such model" is kept briefly: model names are
        client input, and a flood of unknown ones must not reach the core one by one."""
        info = self._infos.get(model)
        if info is None:
            key = ("model_info", model, "")
            info = await self._lookups.get(key, 0.0, lambda: self.link.model_info(model))
            self._infos[model] = info
        return info

    def _priority(self, requested: int, tenant: str, model: str) -> int:
        levels = self.config.priority_levels
        if requested > levels:
            raise InvalidArgument(
                f"priority {requested} is out of range: 1 (highest) to {levels}, or 0 for "
                "the default level"
            )
        level = requested or self.config.default_priority(tenant, model)
        return max(level, self.config.top_priority(tenant))  # clamped to the tier's top

    # ---- health and metadata: the side doors -------------------------------------------
    #
    # Who may ask. Health (live, ready) stays open: Kubernetes probes and load balancers
    # carry no key. Server metadata stays open too: the frontend's name, version and
    # extensions, the same for every caller, answered here without Triton, and read
    # without a key by Triton's own examples (simple_*_health_metadata.py) beside health.
    # Model metadata, config, readiness and statistics need the tenant's key, under the
    # identity rules of inference (401 without one, 403 when it names another tenant),
    # and a model the tenant may call (403 naming it otherwise, before any lookup: the
    # same answer whether or not Triton has the model). They tell which models sit behind
    # the frontend, and each would reach Triton or the core. Statistics are the model's
    # over every tenant, as Triton's are (and perf_analyzer reads them so): keyed, not
    # split per tenant; the frontend does not keep them per tenant. Statistics of every
    # model (no name) list only the models the tenant may call. Not rate-limited: the
    # limiter lives in the core, and with the cache below a flood costs a shell's CPU,
    # not Triton's.
    #
    # What reaches Triton. Its static answers (metadata, config) are kept per model and
    # version for side_doors.metadata_ttl_s, readiness for ready_ttl_s, "no such model or
    # version" for negative_ttl_s, at most max_entries of them (``LookupCache``);
    # concurrent identical calls share one lookup. Every call is counted by door and
    # answer (fair_side_door_calls), every lookup sent to Triton too (fair_side_door_lookups).

    async def live(self) -> bool:
        self._count_door("live", None, "ok")
        return True

    async def ready(self) -> bool:
        """Ready while the core admits and Triton is ready (kept ready_ttl_s: probes
        need no key, so a flood of them must not reach Triton one call each)."""
        triton_ready = await self._from_triton(
            "ready",
            ("server_ready", "", ""),
            self._side_doors.ready_ttl_s,
            self._any_ready,
        )
        self._count_door("ready", None, "ok")
        return self.link.accepting and triton_ready

    async def model_ready(self, model: str, version: str, headers: Mapping[str, str]) -> bool:
        async def answer(tenant: str) -> bool:
            try:
                return bool(
                    await self._from_triton(
                        "model_ready",
                        ("model_ready", model, version),
                        self._side_doors.ready_ttl_s,
                        lambda: self._ask(
                            "is_model_ready", model_name=model, model_version=version
                        ),
                    )
                )
            except FrontendError:
                return False  # Triton cannot tell (or has no such model): not ready

        return await self._keyed("model_ready", model, headers, answer)

    async def server_metadata(self) -> dict[str, Any]:
        """Triton's name and version (a drop-in answers as the server it stands for), and
        the extensions both it and the frontend offer, in Triton's order. Triton's answer
        is static: kept metadata_ttl_s like the models' metadata, so unkeyed callers cost
        Triton one call per period. Triton unreachable and nothing kept: its error (503)."""
        try:
            triton = await self._from_triton(
                "server_metadata",
                ("server_metadata", "", ""),
                self._side_doors.metadata_ttl_s,
                lambda: self._ask("get_server_metadata"),
            )
        except FrontendError as err:
            self._count_door("server_metadata", None, err.grpc_code.name.lower())
            raise
        self._count_door("server_metadata", None, "ok")
        offered = (
            EXTENSIONS
            if self.config.server.statistics == "keyed"
            else EXTENSIONS_WITHOUT_STATISTICS
        )
        return {
            "name": triton.name,
            "version": triton.version,
            "extensions": [e for e in triton.extensions if e in offered],
        }

    async def model_metadata(self, model: str, version: str, headers: Mapping[str, str]) -> Any:
        return await self._keyed(
            "model_metadata",
            model,
            headers,
            lambda _: self._static("model_metadata", "get_model_metadata", model, version),
        )

    async def model_config(self, model: str, version: str, headers: Mapping[str, str]) -> Any:
        return await self._keyed(
            "model_config",
            model,
            headers,
            lambda _: self._static("model_config", "get_model_config", model, version),
        )

    async def statistics(self, model: str, version: str, headers: Mapping[str, str]) -> Any:
        """From the core, never kept (they change); "no such model" is kept briefly.
        ``model`` "": every model the tenant may call. With ``server.statistics: operator``
        not here at all: 501 / UNIMPLEMENTED, as a server without the extension (the
        operator's listener serves them)."""
        if self.config.server.statistics != "keyed":
            err = Unsupported("the statistics extension is not offered on this port")
            self._count_door("statistics", None, err.grpc_code.name.lower())
            raise err

        async def answer(tenant: str) -> Any:
            stats = await self._lookups.get(
                ("statistics", model, version), 0.0, lambda: self.link.statistics(model, version)
            )
            if model:
                return stats
            visible = service_pb2.ModelStatisticsResponse()
            visible.model_stats.extend(
                s for s in stats.model_stats if self.access.allows(tenant, s.name)
            )
            return visible

        return await self._keyed("statistics", model, headers, answer)

    async def _keyed(
        self,
        door: str,
        model: str,
        headers: Mapping[str, str],
        answer: Callable[[str], Awaitable[T]],
    ) -> T:
        """``answer(tenant)`` for the tenant the headers prove, about a model it may call
        (``model`` "": about none in particular), counted by how it ended."""
        tenant: str | None = None
        try:
            tenant = self.auth.identify(headers, None)
            if model:
                self._admit_model(tenant, model)
            result = await answer(tenant)
        except FrontendError as err:
            self._count_door(door, tenant, err.grpc_code.name.lower())
            raise
        self._count_door(door, tenant, "ok")
        return result

    async def _static(self, door: str, method: str, model: str, version: str) -> Any:
        return await self._from_triton(
            door,
            (door, model, version),
            self._side_doors.metadata_ttl_s,
            lambda: self._ask(method, model_name=model, model_version=version),
        )

    async def _ask(self, method: str, **kwargs: Any) -> Any:
        """Triton's answer (``TritonForwarder.call``): the first Triton's, or where one is
        unreachable the next one's."""
        for i, triton in enumerate(self.tritons):
            try:
                return await triton.call(method, **kwargs)
            except Unavailable:
                if i + 1 == len(self.tritons):
                    raise
        raise AssertionError("a gateway has at least one Triton")

    async def _any_ready(self) -> bool:
        """Is any Triton of the pool ready? (The endpoints are served while one is.)"""
        if len(self.tritons) == 1:
            return await self.triton.server_ready()
        answers = await asyncio.gather(*(t.server_ready() for t in self.tritons))
        return any(answers)

    async def _from_triton(
        self, door: str, key: Key, ttl_s: float, ask: Callable[[], Awaitable[T]]
    ) -> T:
        """Triton's answer to ``key``, kept ``ttl_s``; each real call counted."""

        async def lookup() -> T:
            self._count_door(door, None, SIDE_DOOR_LOOKUP)
            return await ask()

        return await self._lookups.get(key, ttl_s, lookup)

    def _count_door(self, door: str, tenant: str | None, outcome: str) -> None:
        self.link.tally(TallyEntry(tenant, "", outcome, 1, door=door))

    @property
    def _side_doors(self) -> SideDoors:
        return self.config.side_doors

    @property
    def _lookups(self) -> LookupCache:
        """The side doors' cache, made anew for each (re)loaded config: a reload (of
        Triton's models too, as operators do it) empties it."""
        if self._cache is None or self._cache_config is not self.config:
            self._cache = LookupCache(
                max_entries=self._side_doors.max_entries,
                negative_ttl_s=self._side_doors.negative_ttl_s,
            )
            self._cache_config = self.config
        return self._cache


def _facts(call: Call, plan: EndpointPlan, *, key: bool = True, logged: bool = False) -> Call:
    """What the core is told of a call whose tensors stay here: all but its request's
    inputs, outputs and parameters, and (``key``: a unary call, granted rows of a batch)
    the batch key they make (``Call.key``); ``logged``: this shell writes its
    request-log line (``Call.logged``). A stream granted a slot (``key`` False) is one
    request per batch: it has no key."""
    req = call.request
    bare = dataclasses.replace(req, inputs=[], outputs=[], parameters={})
    wire = wire_key(req, plan) if key else b""
    return msgspec.structs.replace(call, request=bare, key=wire, logged=logged)


def _wants_usage(req: InferRequest) -> bool:
    """Whether the client asked for ``USAGE_PARAMETERS`` (``INCLUDE_USAGE``, taken out of
    the request's parameters: the model never sees it)."""
    asked = req.parameters.pop(INCLUDE_USAGE, None)
    if asked is None:
        return False
    if not isinstance(asked, bool):
        raise InvalidArgument(
            f"parameter '{INCLUDE_USAGE}' must be a bool, not {type(asked).__name__}"
        )
    return asked


class Precharge:
    """What a precharge counted of a request before its text was tokenised
    (``Gateway.precharge``): ``tokens``, and the request itself, at wall time ``at``."""

    __slots__ = ("at", "tokens")

    def __init__(self, tokens: int, at: float) -> None:
        self.tokens = tokens
        self.at = at

    def settled_by(self, call: Call) -> None:
        """``call`` (a request's, or the first part's of a call of several) counts what is
        left: not its request (counted), and its tokens beyond these."""
        call.requests = 0
        call.precharged = self.tokens
        call.precharged_at = self.at


class _Tally:
    """A granted stream's tokens as they come: each response's told to the core
    (``Inbox.produced``: the first one's time to first token, a later one's tokens share
    the gap since the one before), the first one's span event, the client's usage."""

    __slots__ = ("arrived", "inbox", "last", "produced", "traced", "usage")

    def __init__(
        self, inbox: Inbox, arrived: float, traced: Span | None, usage: Usage | None
    ) -> None:
        self.inbox = inbox
        self.arrived = arrived  # time.monotonic() of the call's arrival (one clock per host)
        self.traced = traced  # the call to Triton's span, where traced
        self.usage = usage
        self.produced = 0
        self.last = 0.0  # time.monotonic() of its latest token

    def add(self, n: int) -> None:
        now = time.monotonic()
        if self.produced:
            self.inbox.produced(n, -1.0, now - self.last)  # its n tokens share the gap
        else:
            self.inbox.produced(n, now - self.arrived, -1.0)
            if self.traced is not None:
                self.traced.add_event("first_token", timestamp=wall_ns(now))
        self.produced += n
        self.last = now
        if self.usage is not None:
            self.usage.completion_tokens = self.produced

    def close(self) -> None:
        if self.traced is not None:
            self.traced.set_attribute("gen_ai.usage.output_tokens", self.produced)
            self.traced.end()


def _watched(stream: TritonStream | SseStream, inbox: Inbox) -> None:
    """A granted stream and its slot, tied: a stop from either side ends both at once
    (the watchdog's or the core's revoke)."""
    stream.on_stop = lambda err: inbox.end(fault=err)  # its slot back at once
    inbox.on_revoke = stream.stop


def _stream_failed(
    err: FrontendError,
    stopped: FrontendError | None,
    tally: _Tally,
    grant: Grant,
    version: str,
    *,
    give_back: bool,
) -> None:
    """A granted stream's error: the call given back to the core where its Triton is gone
    and ``give_back`` (its client has had nothing, and it has grants left): returns; else
    the call ends with it, raised (with its grant's quota unless the error has its own)."""
    if give_back and _triton_gone(err, stopped):
        tally.inbox.again(err)
        if tally.traced is not None:
            failed(tally.traced, err)
        return
    tally.inbox.end(version, err)
    if err.quota is None:  # this stream's own error: its grant's
        err.quota = grant.quota
    raise err


# What the shell reads of Triton's events (``Gateway._relay_events``). Keys are not
# found inside a string: a quote there is escaped.
_ERROR_EVENT = b'data: {"error":'
_VERSION = re.compile(rb'"model_version":"([^"\\]*)"')


class _EventCounts:
    """The tokens of whole events (``data: {...}\\n\\n``, one or more) by the ``name``
    output's count in each (an event without it: one token), and the events with that
    output taken out where the client did not ask for it. An engine that streams a token
    per response writes a count of 1 before its text in every event: that case is read
    in two scans of the bytes (``bytes.count``) and taken out in one (``bytes.replace``),
    the rest goes through the patterns (``general``)."""

    __slots__ = ("counts", "ones", "strip")

    def __init__(self, name: str) -> None:
        key = json.dumps(name).encode() + b":"
        value = rb"(?:\[[^\]]*\]|-?\d+)"
        # The count (one element: Triton writes it bare, or as a one-element list).
        self.counts = re.compile(re.escape(key) + rb"\[?(-?\d+)")
        # The whole key to take out (with its comma).
        self.strip = re.compile(
            rb"," + re.escape(key) + value + rb"|" + re.escape(key) + value + rb",?"
        )
        self.ones = key + b"1,"  # a count of one, a key after it

    @staticmethod
    @functools.cache
    def of(name: str) -> _EventCounts:
        return _EventCounts(name)

    def __call__(self, data: bytes, hide: bool) -> tuple[int, bytes]:
        events = data.count(b"\n\n")
        # An event holds the key once at most (an object's keys are unique; inside a
        # string its quotes are escaped): as many counts of one as events, one each.
        if data.count(self.ones) == events:
            return events, data.replace(self.ones, b"") if hide else data
        return self.general(data, hide)

    def general(self, data: bytes, hide: bool) -> tuple[int, bytes]:
        said = self.counts.findall(data)
        n = sum(max(0, int(x)) for x in said) + data.count(b"\n\n") - len(said)
        return n, self.strip.sub(b"", data) if hide else data


def _event_error(data: bytes) -> str:
    """The message of Triton's error event (``data: {"error": ...}``)."""
    payload = data[len(b"data: ") :].split(b"\n\n", 1)[0]
    try:
        return str(json.loads(payload)["error"])
    except (ValueError, KeyError, TypeError):
        return payload.decode("utf-8", "replace")


def _triton_gone(err: FrontendError, stopped: FrontendError | None) -> bool:
    """Did a stream end because its Triton is gone (not reached, or the connection lost:
    ``Unavailable``), rather than by the model's error, Triton's answer about the model,
    the watchdog or the core taking the slot back (``stopped``)?"""
    return isinstance(err, Unavailable) and err is not stopped


async def _answers(inboxes: Sequence[Inbox]) -> list[Answer]:
    """Each inbox's answer, in order, once all have come; the first failure (in order,
    of those answered when one failed) is raised at once."""
    settled = asyncio.get_running_loop().create_future()
    left = len(inboxes)

    def heard(answer: Answer | Grant) -> None:
        nonlocal left
        left -= 1
        failed = isinstance(answer, Grant) or answer.fault is not None
        if (failed or not left) and not settled.done():
            settled.set_result(None)

    for inbox in inboxes:
        came = inbox.answered
        if came is None:
            inbox.on_answer = heard
        else:  # answered already (a link that answers at once: its core is gone)
            heard(came)
    await settled
    answers: list[Answer] = []
    for inbox in inboxes:
        if not inbox.answered:
            continue
        answer = await inbox.get()  # there: at once
        if isinstance(answer, Grant):
            raise Internal("a part of a call was granted a stream")
        if answer.fault is not None:
            raise answer.fault.error()  # with its quota (``FrontendError.quota``)
        answers.append(answer)
    if len(answers) < len(inboxes):
        raise Internal("a call's parts settled unanswered")
    return answers
