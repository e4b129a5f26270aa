"""A granted stream, relayed by its shell: Triton's responses to the client as they come.

The core grants a decoupled model's call a slot (``records.Grant``); the shell that holds
the call sends it to the Triton the grant names and relays the responses (one hop),
counting the output tokens they carry for the core (``Inbox.produced``, per tick). Where
Triton's own bytes serve the client they are passed on: generate_stream's events read
and passed as they came (several at once when they came together), ModelStreamInfer's
messages parsed but not decoded.
"""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import TYPE_CHECKING, Literal, Protocol

import msgspec

from fair_frontend.backends.protocol import EventStream, Stream
from fair_frontend.batching import pack
from fair_frontend.config import Config, Endpoint
from fair_frontend.endpoint import EndpointPlan
from fair_frontend.errors import FrontendError, Unavailable
from fair_frontend.grpc_codec import drop_output, output_tokens_said
from fair_frontend.observability.tracing import carried, failed, wall_ns
from fair_frontend.protocol import FINAL_RESPONSE, Batch, InferResponse, ParamValue
from fair_frontend.shell.generate_codec import encode_generate_request
from fair_frontend.shell.link import Inbox
from fair_frontend.shell.rows import Upstreams
from fair_frontend.tokens import ask_token_counts, counted_tokens, output_tokens, without_output
from fair_frontend.usage import Usage
from fair_frontend.wire.records import Call, Grant

if TYPE_CHECKING:
    from opentelemetry.trace import Span


Wire = Literal["", "sse", "grpc", "events"]
"""How a stream's client reads it, where Triton's own bytes may serve it (``stream_infer``):
"" decoded responses; "sse" generate_stream's events; "grpc" ModelStreamInfer's messages;
"events" the same events, for a reader in this shell (the OpenAI routes)."""


class Relaying(Upstreams, Protocol):
    """What a relay reads of its gateway: its upstreams and the running config."""

    @property
    def config(self) -> Config: ...


class StreamRelay:
    """A shell's granted streams (the module's doc); its Tritons, traces and config are
    the gateway's, read through it (a reload changes the config)."""

    def __init__(self, gateway: Relaying) -> None:
        self.gateway = gateway

    async def relay(
        self,
        call: Call,
        plan: EndpointPlan,
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
        (``on_revoke``), a client that stops reading (``Stream``), or one that went
        away (this generator closed). A Triton that is gone before the client had any
        response (not reached, or lost before its first) gives the call back to the core
        instead (``Inbox.again``: it ends with nothing yielded and the inbox not done),
        to be granted to another Triton, unless ``give_back`` is false (its last grant:
        ``STREAM_GRANTS``). ``span``: the request's, where it is traced:
        the call to Triton gets its own under it, whose context Triton gets. ``wire``:
        the client's protocol (``stream_infer``): where Triton's own bytes serve it, they
        are read and passed on, generate_stream's events (``_events``) or
        ModelStreamInfer's messages, parsed but not decoded (``raw``)."""
        req = call.request
        info, endpoint = plan.info, plan.endpoint
        # Its tokens counted from what each response says it carries, where the model
        # says (``token_count_output``); the client sees that output only if it asked.
        sent, count, hide = ask_token_counts(req, info, endpoint)
        if sent is not req:
            call = msgspec.structs.replace(call, request=sent)
        packed = pack([call], plan)
        want_final = streaming and req.empty_final_response
        triton = self.gateway.tritons[grant.backend]
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
            assert self.gateway.traces is not None
            traced = self.gateway.traces.stream(span, req.model, time.monotonic())
            traced.set_attribute("server.address", triton.url)
        traceparent = carried(traced)[0] if traced is not None else ""
        stalled_s = self.gateway.config.queues.stalled_stream_s
        version = req.version or info.latest_version
        tally = _Tally(inbox, call.arrived, traced, usage)
        stream: Stream | EventStream
        if body is not None:
            assert triton.events is not None and count is not None
            upstream = stream = triton.events.stream(
                req.model, req.version, body, stalled_s=stalled_s, traceparent=traceparent
            )
            hide = hide and wire == "sse"  # (the other reader never looks at the count)
            replies = self._events(
                call, grant, inbox, upstream, count, hide, version, tally, give_back
            )
        else:
            # Triton's messages pass on to a gRPC client as they came, but for the count
            # the client did not ask for; the shell parses them, and decodes only that
            # count.
            raw = wire == "grpc" and count is not None and not report_usage
            messages = stream = triton.stream(
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
            replies = self._messages(
                call, grant, inbox, messages, endpoint, version, tally,
                raw=raw, count=count, hide=hide, want_final=want_final, usage=usage,
                report_usage=report_usage, give_back=give_back,
            )  # fmt: skip
        # The stream and its slot, tied; one way out, whichever reader reads it.
        _watched(stream, inbox)
        try:
            async with aclosing(replies):
                async for resp in replies:
                    yield resp
        except FrontendError as err:
            if traced is not None:
                failed(traced, err)
            raise
        finally:
            inbox.end(cancelled=True)  # no-op once ended
            await stream.aclose()
            tally.close()

    async def _messages(
        self,
        call: Call,
        grant: Grant,
        inbox: Inbox,
        stream: Stream,
        endpoint: Endpoint,
        version: str,
        tally: _Tally,
        *,
        raw: bool,
        count: str | None,
        hide: bool,
        want_final: bool,
        usage: Usage | None,
        report_usage: bool,
        give_back: bool,
    ) -> AsyncGenerator[InferResponse, None]:
        """``relay`` over Triton's gRPC stream: each response decoded (``raw``: parsed,
        and passed on as it came but for the count the client did not ask for), its
        tokens told to the core, the client's responses made of it."""
        req = call.request
        name = endpoint.token_output
        answered = False  # anything yielded to the client: the stream cannot be replayed
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

    async def _events(
        self,
        call: Call,
        grant: Grant,
        inbox: Inbox,
        stream: EventStream,
        count: str,
        hide: bool,
        version: str,
        tally: _Tally,
        give_back: bool,
    ) -> AsyncGenerator[InferResponse, None]:
        """``relay`` for a client of generate_stream (or a reader in this shell that takes
        the text of each event: the OpenAI routes, ``wire="events"``): Triton's own
        events, passed on as they came (several at once when they came together). The
        shell reads only what it counts: each event's tokens (the ``count`` output, taken
        out where the client did not ask for it; an event without it: one token), an
        error event (Triton's last), the model version once, the end of the body (the
        final response: generate_stream ends with it)."""
        req = call.request
        tokens_in = _EventCounts.of(count)
        answered = False
        async for got in stream:
            if got.error is not None:
                _stream_failed(got.error, stream.stopped, tally, grant, version,
                               give_back=give_back and not answered)  # fmt: skip
                return  # given back
            data = got.data
            if data:
                if not answered and (found := _VERSION.search(data)) is not None:
                    version = found[1].decode()
                n, data = tokens_in(data, hide)
                if n > 0:
                    tally.add(n)
                answered = True
                yield InferResponse(req.model, version, req.id, [], {}, grant.quota, data)
            if got.model_error is not None:
                _stream_failed(got.model_error, None, tally, grant, version, give_back=False)
        inbox.end(version)


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


def _watched(stream: Stream | EventStream, inbox: Inbox) -> None:
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


# What the shell reads of Triton's events (``StreamRelay._events``). Keys are not
# found inside a string: a quote there is escaped.
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


def _triton_gone(err: FrontendError, stopped: FrontendError | None) -> bool:
    """Did a stream end because its Triton is gone (not reached, or the connection lost:
    ``Unavailable``), rather than by the model's error, Triton's answer about the model,
    the watchdog or the core taking the slot back (``stopped``)?"""
    return isinstance(err, Unavailable) and err is not stopped
