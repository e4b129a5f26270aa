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
import logging
import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from contextlib import AbstractContextManager, aclosing, nullcontext
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from fair_frontend.auth import Authenticator, Identity, KeyRing, ModelAccess
from fair_frontend.backends.protocol import BackendServer
from fair_frontend.batching import wire_key
from fair_frontend.config import Config
from fair_frontend.endpoint import EndpointPlan
from fair_frontend.endpoint import plan as endpoint_plan
from fair_frontend.errors import (
    FrontendError,
    Internal,
    InvalidArgument,
    QueueFull,
    UnknownModel,
    Unsupported,
)
from fair_frontend.models import (
    Checked,
    ModelInfo,
    RefusedByModel,
    check_declared,
    prompt_texts,
    validate,
)
from fair_frontend.observability.logs import RequestLog
from fair_frontend.observability.tracing import Traces, carried, failed
from fair_frontend.outcomes import Outcome
from fair_frontend.protocol import (
    FINAL_RESPONSE,
    MAX_NAME_BYTES,
    InferRequest,
    InferResponse,
    ParamValue,
    Precheck,
    check_name,
    clipped,
    take_program,
    take_slo_class,
)
from fair_frontend.shell.link import CoreLink, Inbox
from fair_frontend.shell.relay import StreamRelay, Wire
from fair_frontend.shell.rows import RowsSender
from fair_frontend.shell.side_doors import SideDoorAnswers
from fair_frontend.shell.turns import Turns
from fair_frontend.tokens import (
    TokenCounter,
    at_least_tokens,
    output_tokens,
    utf8_size,
)
from fair_frontend.usage import INCLUDE_USAGE, Usage
from fair_frontend.wire.records import (
    Answer,
    Call,
    Grant,
    TallyEntry,
)

if TYPE_CHECKING:
    from opentelemetry.trace import Span

T = TypeVar("T")

log = logging.getLogger(__name__)

# The parts of one call a shell checks before its loop runs anything else (a call of
# many parts, checked part by part, lets other requests through between these).
PARTS_PER_ITERATION = 256
# The model a refusal is tallied under when its own name may not be a label (the metrics
# count it as ``endpoint="other"``; the statistics not at all).
UNLABELLED_MODEL = ""
# Grants one stream may have: one whose Triton is gone before it answered anything is
# given back to the core for another (``StreamRelay.relay``), but not for ever (a Triton
# that fails every stream at once while its probe says ready would take it back each time).
STREAM_GRANTS = 3


class Gateway:
    """Decoded requests in, answers out: identity, validation, the call to the core."""

    # Each model's plan, and the config they were made for (``plan``).
    _plans_config: Config | None = None

    def __init__(
        self,
        config: Config,
        keyring: KeyRing,
        link: CoreLink,
        triton: BackendServer | Sequence[BackendServer],
    ) -> None:
        self.link = link
        # Each Triton of the pool, in the order of ``Settings.triton_urls`` (a ``Grant``
        # names one by its index); the first one alone where there is one.
        self.tritons: list[BackendServer] = (
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
            rows_link.on_rows = RowsSender(self, rows_link).send
        self._rows_link = rows_link
        self.side = SideDoorAnswers(self)  # health, metadata, config, statistics
        self.relay = StreamRelay(self)  # granted streams, Triton to client
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
        (``fair_frontend.observability.tracing``), before the model's."""
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
            self.admit_model(tenant, model)
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
                ok = validate(req, plan, text_tokens=counts)
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
            call = self._call(
                req, tenant, priority, (arrived, arrived_wall), ok, False,
                0 if i else 1,  # the call's request, once (OpenAI's limits count calls)
                program, slo_class,
            )  # fmt: skip
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
        return await self._group_answers(reqs, inboxes, usages, spans, plan)

    async def _group_answers(
        self,
        reqs: Sequence[InferRequest],
        inboxes: list[Inbox],
        usages: Sequence[Usage],
        spans: list[Span],
        plan: EndpointPlan,
    ) -> list[InferResponse]:
        """The answers to a call's parts, in order (``infer_group``); the first failure
        cancels the others and is raised; each part's usage and span closed."""
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
        events; ``grpc``, ModelStreamInfer's messages (``StreamRelay``); ``events``, the
        same events for a caller that reads them itself (the OpenAI routes, which take the
        text of each and ignore the rest)."""
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
            self.admit_model(tenant, req.model)
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
            checked = validate(req, plan, text_tokens=counts)
            priority = self._priority(req.priority, tenant, req.model)
        except FrontendError as err:
            self._refused(tenant, req, err, arrived, info)
            raise
        except asyncio.CancelledError:
            self._refused(tenant, req, None, arrived, info)
            raise
        call = self._call(
            req, tenant, priority, (arrived, arrived_wall), checked, streaming, requests,
            program, slo_class,
        )  # fmt: skip
        if paid is not None:
            paid.settled_by(call)
        if span is not None:
            span.set_attributes({"fair.tenant": tenant, "fair.priority": priority})
            call.traceparent, call.tracestate = carried(span)
        if usage is not None:
            usage.prompt_tokens = checked.tokens - checked.max_tokens
        inbox, logged = self._submit(call, plan)
        try:
            answer = await self._answer_of(call, inbox, logged)
            grants = 0
            while isinstance(answer, Grant):
                grants += 1
                replies = self.relay.relay(
                    call, plan, answer, inbox, streaming, usage, report_usage, span,
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

    def _call(
        self,
        req: InferRequest,
        tenant: str,
        priority: int,
        arrived: tuple[float, float],
        checked: Checked,
        streaming: bool,
        requests: int,
        program: str,
        slo_class: str,
    ) -> Call:
        """The core's record of a checked request (``arrived``: its monotonic and wall
        times)."""
        return Call(
            self.link.new_id(),
            tenant,
            priority,
            arrived[0],
            arrived[1],
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

    def _submit(self, call: Call, plan: EndpointPlan) -> tuple[Inbox, bool]:
        """A checked call to the core: its inbox, and whether this shell writes its
        request-log line."""
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
        return inbox, logged

    # ---- granted rows: a batch's part, sent from here (``shell.rows``) -------------------

    def _keeps_rows(self, plan: EndpointPlan) -> bool:
        """Whether a unary call keeps its tensors here (its facts go to the core)."""
        return self._rows_link is not None and plan.one_hop

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
                self.admit_model(tenant, model)
            self._shed(tenant, model)

    def admit_model(self, tenant: str, model: str) -> None:
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
            info = await self.side.lookups.get(key, 0.0, lambda: self.link.model_info(model))
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
