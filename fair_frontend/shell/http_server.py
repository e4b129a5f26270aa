"""KServe v2 over HTTP (aiohttp): the thin shell around ``Gateway``.

Bodies may be gzip/deflate-encoded (the shell inflates them, size-capped); responses are
compressed when the client's ``Accept-Encoding`` allows, as Triton does. Errors are
``{"error": "<message>"}`` with the status of ``fair_frontend.errors``.

The door (issue 11: a hostile client must not cost more than its headers entitle it to):
a request is refused from its headers alone where they decide (no key, an unknown one, an
unknown tenant from the trusted gateway, a full queue, a declared Content-Length over its
model's limit) before any of its body is read, and ``Expect: 100-continue`` is granted only
then. A body is read against its own model's bound (``Endpoint.max_wire_bytes``: chunked
bodies cut off at it, inflated ones too) and within ``server.http_body_timeout_s`` (then
408); a body abandoned midway gets ``Connection: close``. Large bodies are decoded on a
worker thread, so the event loop keeps serving other clients meanwhile. Every POST route,
these and the API's (``api_http``), goes through the same prologue: ``shell.door``.

Connections (issue 17): each shell holds at most ``server.http_max_connections`` open, and
at most ``server.http_max_connections_per_peer`` from one address; one over either is
closed at once, unread. A new connection must deliver its first request's headers within
``server.header_timeout_s``, and a request's headers must arrive within that time of their
first byte (aiohttp has no such timeout: a client that sends nothing, or its headers a byte
at a time, would hold its connection until the keep-alive timeout, an hour). Bodies read
and decoded at once in a shell hold at most ``server.http_max_reading_bytes`` over all its
connections; a body that does not fit is refused 503 from its headers. Each closed
connection is counted (``fair_connections_refused_total``), each refused body as a
request. ``Listener`` wires this into aiohttp's protocol (``GuardedProtocol``).
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import AsyncGenerator, Mapping
from typing import Any, TypeVar

from aiohttp import web
from aiohttp.http_exceptions import LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from google.protobuf import json_format

from fair_frontend import __version__
from fair_frontend.auth import identity_headers
from fair_frontend.errors import (
    FrontendError,
    InvalidArgument,
    UnknownModel,
    Unsupported,
)
from fair_frontend.models import ModelInfo
from fair_frontend.outcomes import Outcome
from fair_frontend.protocol import InferRequest, InferResponse, Precheck
from fair_frontend.quota import Quota, quota_headers
from fair_frontend.shell.api_http import ApiRoutes, EventStream
from fair_frontend.shell.door import (
    Door,
    close_abandoned,
    expect_after_checks,
    too_large,
)
from fair_frontend.shell.gateway import Gateway
from fair_frontend.shell.generate_codec import (
    MSG_NOT_ONE_RESPONSE,
    SSE_CONTENT_TYPE,
    ModelNotFound,
    check_encoding,
    check_model,
    decode_generate,
    encode_generate,
    sse_event,
)
from fair_frontend.shell.generate_codec import encode_error as generate_error
from fair_frontend.shell.http_codec import (
    HEADER_CONTENT_LENGTH,
    decode_infer,
    decode_raw_infer,
    encode_error,
    encode_infer,
    is_raw_binary,
    parse_header_length,
)
from fair_frontend.shell.relay import Wire
from fair_frontend.shell.side_doors import FRONTEND_HEADER
from fair_frontend.wire.records import CONNECTION_DOOR, TallyEntry

log = logging.getLogger(__name__)

GATEWAY_KEY: web.AppKey[Gateway] = web.AppKey("gateway", Gateway)
# zlib window bits per Content-Encoding: gzip; deflate as zlib-wrapped (RFC 9110), or raw
# as some clients send it.
_WBITS = {
    "gzip": (16 + zlib.MAX_WBITS,),
    "x-gzip": (16 + zlib.MAX_WBITS,),
    "deflate": (zlib.MAX_WBITS, -zlib.MAX_WBITS),
}


_R = TypeVar("_R", bound=web.StreamResponse)


def error_response(err: FrontendError) -> web.Response:
    headers = {}
    if err.retry_after_header is not None:
        headers["Retry-After"] = err.retry_after_header
    response = web.Response(
        status=err.http_status,
        body=encode_error(err.message),
        content_type="application/json",
        headers=headers,
    )
    return with_quota(response, err.quota)


def with_quota(response: _R, quota: Quota | None) -> _R:
    """``response`` with OpenAI's rate-limit headers (``x-ratelimit-*``,
    ``fair_frontend.quota.quota_headers``) for ``quota``: the tenant's limits after this
    request's check, on an answer (``InferResponse.quota``) and on an error
    (``FrontendError.quota``). None (no limits, or never checked): no headers. Before the
    response is prepared (a stream's headers go with its first bytes)."""
    if quota is not None:
        response.headers.update(quota_headers(quota))
    return response


def _headers(request: web.Request) -> dict[str, str]:
    """Lower-cased headers, every copy of a repeated one seen (``identity_headers``), and
    the connection's peer address (for ``auth.trusted_gateway_peers``)."""
    return identity_headers(request.headers.items(), request.remote)


def _model_version(request: web.Request) -> tuple[str, str]:
    return request.match_info["model"], request.match_info.get("version", "")


def _json(doc: Any, status: int = 200) -> web.Response:
    return web.json_response(doc, status=status)


def proto_to_json(msg: Any) -> dict[str, Any]:
    """Triton's JSON rendering of a protobuf message: proto field names, every field,
    64-bit integers as numbers (protobuf's own JSON would quote them)."""
    doc: dict[str, Any] = json_format.MessageToDict(
        msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return _unquote_int64(msg, doc)


_INT64_TYPES = {3, 4, 6, 16, 18}  # FieldDescriptor TYPE_INT64/UINT64/FIXED64/SFIXED64/SINT64


def _repeated(fd: Any) -> bool:
    # protobuf >= 6 has is_repeated; older releases only the (now deprecated) label.
    if hasattr(fd, "is_repeated"):
        return bool(fd.is_repeated)
    return bool(fd.label == fd.LABEL_REPEATED)


def _unquote_int64(msg: Any, doc: Any) -> Any:
    if not isinstance(doc, dict):
        return doc
    for fd in msg.DESCRIPTOR.fields:
        if fd.name not in doc:
            continue
        value = getattr(msg, fd.name)
        if fd.message_type is not None:
            if fd.message_type.GetOptions().map_entry:
                vfd = fd.message_type.fields_by_name["value"]
                for k, v in value.items():
                    if vfd.message_type is not None:
                        doc[fd.name][str(k)] = _unquote_int64(v, doc[fd.name][str(k)])
                    elif vfd.type in _INT64_TYPES:
                        doc[fd.name][str(k)] = int(v)
            elif _repeated(fd):
                doc[fd.name] = [
                    _unquote_int64(v, d) for v, d in zip(value, doc[fd.name], strict=True)
                ]
            else:
                doc[fd.name] = _unquote_int64(value, doc[fd.name])
        elif fd.type in _INT64_TYPES:
            if _repeated(fd):
                doc[fd.name] = [int(v) for v in value]
            else:
                doc[fd.name] = int(value)
    return doc


class HttpShell:
    def __init__(self, gateway: Gateway, *, max_body_bytes: int) -> None:
        self.gateway = gateway
        self.max_body_bytes = max_body_bytes
        self.connections = Connections(gateway)
        self.door = Door(gateway)  # every POST route's prologue

    def runner(self) -> web.AppRunner:
        """The shell's app, served behind the door's connection bounds (``Listener``).
        Bodies are inflated by the shell itself (size-capped, Triton's errors for the
        encodings it does not know), not by aiohttp."""
        return Listener(
            self.app(),
            self.connections,
            handler_cancellation=True,
            access_log=None,
            auto_decompress=False,
        )

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.max_body_bytes,
            middlewares=[close_abandoned, self._errors_middleware],
        )
        app[GATEWAY_KEY] = self.gateway
        r = app.router
        r.add_get("/v2/health/live", self.live)
        r.add_get("/v2/health/ready", self.ready)
        r.add_get("/v2", self.server_metadata)
        r.add_get("/v2/models/stats", self.statistics)
        for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            r.add_get(prefix, self.model_metadata)
            r.add_get(prefix + "/ready", self.model_ready)
            r.add_get(prefix + "/config", self.model_config)
            r.add_get(prefix + "/stats", self.statistics)
            for door, handler in (
                ("/infer", self.infer),
                ("/generate", self.generate),
                ("/generate_stream", self.generate_stream),
            ):
                r.add_post(prefix + door, handler, expect_handler=expect_after_checks)
        ApiRoutes(self).add(r, expect_after_checks)
        return app

    @web.middleware
    async def _errors_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            response: web.StreamResponse = await handler(request)
            return response
        except FrontendError as err:
            return error_response(err)
        except web.HTTPRequestEntityTooLarge:
            return error_response(
                InvalidArgument(f"request too large: the body exceeds {self.max_body_bytes} bytes")
            )
        except web.HTTPException as exc:
            if exc.status >= 400:
                return web.Response(
                    status=exc.status,
                    body=encode_error(exc.reason or "error"),
                    content_type="application/json",
                )
            raise

    async def live(self, request: web.Request) -> web.Response:
        # Open, as ready and server metadata are: see Gateway's side doors.
        return web.Response(status=200 if await self.gateway.side.live() else 400)

    async def ready(self, request: web.Request) -> web.Response:
        # Triton answers 400 when not ready; Kubernetes probes treat it as failing.
        return web.Response(status=200 if await self.gateway.side.ready() else 400)

    async def server_metadata(self, request: web.Request) -> web.Response:
        response = _json(await self.gateway.side.server_metadata())
        # The body names the Triton behind; the frontend names itself here.
        response.headers[FRONTEND_HEADER] = __version__
        return response

    async def model_metadata(self, request: web.Request) -> web.Response:
        model, version = _model_version(request)
        response = await self.gateway.side.model_metadata(model, version, _headers(request))
        return _json(proto_to_json(response))

    async def model_ready(self, request: web.Request) -> web.Response:
        model, version = _model_version(request)
        if await self.gateway.side.model_ready(model, version, _headers(request)):
            return web.Response(status=200)
        return error_response(InvalidArgument("Model version not ready"))

    async def model_config(self, request: web.Request) -> web.Response:
        model, version = _model_version(request)
        response = await self.gateway.side.model_config(model, version, _headers(request))
        return _json(proto_to_json(response.config))

    @staticmethod
    def _decompress(raw: bytes, encoding: str | None, limit: int, model: str) -> bytes:
        """The request body, inflated as its Content-Encoding says (gzip, deflate), to at
        most ``limit`` bytes (the model's ``Endpoint.max_wire_bytes``: a small bomb inflates
        no further)."""
        name = (encoding or "identity").strip().lower()
        if name == "identity":
            return raw
        if name not in _WBITS:
            raise Unsupported(
                f"Unsupported compression type '{name}' (Content-Encoding; gzip and deflate "
                "are supported)"
            )
        for wbits in _WBITS[name]:
            inflater = zlib.decompressobj(wbits)
            try:
                body = inflater.decompress(raw, limit + 1)
            except zlib.error:
                continue
            if len(body) > limit or inflater.unconsumed_tail:
                raise too_large(model, limit, f"the body decoded from Content-Encoding '{name}'")
            if not inflater.eof:
                raise InvalidArgument(
                    f"the request body is truncated for its Content-Encoding '{name}'"
                )
            return body
        raise InvalidArgument(f"failed to decode the request body as Content-Encoding '{name}'")

    async def statistics(self, request: web.Request) -> web.Response:
        model = request.match_info.get("model", "")
        version = request.match_info.get("version", "")
        response = await self.gateway.side.statistics(model, version, _headers(request))
        return _json(proto_to_json(response))

    async def infer(self, request: web.Request) -> web.StreamResponse:
        model, version = _model_version(request)
        gateway = self.gateway
        async with self.door.path(request, model) as p:
            limit = await gateway.wire_bound(model)
            precheck = gateway.precheck(model)
            decoded = await p.decode(self._decode_infer, model, version, p.headers, limit, precheck)
            if isinstance(decoded, InferRequest):
                req = decoded
            else:
                # A raw binary body: its one input is deduced from the model's description.
                info = await gateway.model_info(model)
                req = decode_raw_infer(model, version, decoded, info)
        resp = await gateway.infer(req, p.headers, p.known)
        payload, json_length = encode_infer(resp, req)
        out = web.Response(body=payload)
        if json_length is None:
            out.content_type = "application/json"
        else:
            out.content_type = "application/octet-stream"
            out.headers[HEADER_CONTENT_LENGTH] = str(json_length)
        if request.headers.get("Accept-Encoding"):
            out.enable_compression()
        return with_quota(out, resp.quota)

    def _decode_infer(
        self,
        raw: bytes,
        model: str,
        version: str,
        headers: Mapping[str, str],
        limit: int,
        precheck: Precheck | None = None,
    ) -> InferRequest | bytes:
        """An infer body, inflated and decoded (on a worker thread when large); a raw binary
        body (``is_raw_binary``) comes back inflated only, for ``decode_raw_infer``, which
        needs the model's description."""
        body = self._decompress(raw, headers.get("content-encoding"), limit, model)
        header_length = parse_header_length(headers.get(HEADER_CONTENT_LENGTH.lower()), len(body))
        if is_raw_binary(header_length, len(body)):
            return body
        return decode_infer(model, version, body, header_length, precheck=precheck)

    # ---- Triton's generate extension (fair_frontend.shell.generate_codec) ----------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """One JSON object; a model that answers other than once gets Triton's error."""
        try:
            return await self._generate(request)
        except FrontendError as err:
            return _generate_failure(err)

    async def generate_stream(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events, one per response, each written as it arrives. Triton starts
        the stream with the first response: a request refused before any answer gets a
        plain JSON error; a model's own error as the first answer sets the status of the
        stream it starts; an error later is one more event, under the 200 already sent."""
        try:
            return await self._generate_stream(request)
        except FrontendError as err:
            return _generate_failure(err)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        replies = await self._generate_request(request)
        quota = None
        try:
            answers = []
            try:
                async for resp in replies:
                    answers.append(encode_generate(resp))
                    quota = resp.quota
            except FrontendError:
                if not answers:
                    raise  # the first answer failed: its status and message, as Triton
                answers.append(b"")  # a response, then an error: more than one
        finally:
            await replies.aclose()
        if len(answers) == 1:
            return with_quota(_generate_json(answers[0]), quota)
        # Triton has sent its 200 with the first response by then, and only learns at
        # the final flag that there was not exactly one (SendChunkResponse).
        return with_quota(_generate_json(generate_error(MSG_NOT_ONE_RESPONSE)), quota)

    async def _generate_stream(self, request: web.Request) -> web.StreamResponse:
        replies = await self._generate_request(request, wire="sse")
        out = EventStream()
        try:
            try:
                resp = await anext(replies)
                with_quota(out, resp.quota)
                first: bytes | None = resp.wire or sse_event(encode_generate(resp))
            except StopAsyncIteration:
                first = None
            except FrontendError as err:
                if err.outcome is not Outcome.FAILED:
                    raise  # refused before inference (queue, deadline, validation)
                # Triton or the model answered an error: Triton's first "response".
                out.set_status(err.http_status)
                with_quota(out, err.quota)
                first = sse_event(generate_error(err.message))
                await replies.aclose()
            out.content_type, out.charset = SSE_CONTENT_TYPE.split("; charset=")
            await out.prepare(request)
            if first is not None:
                await out.write(first)
            try:
                async for resp in replies:
                    await out.write(resp.wire or sse_event(encode_generate(resp)))
            except FrontendError as err:
                await out.write(sse_event(generate_error(err.message)))
            await out.write_eof()
            return out
        finally:
            # On a client's disconnect aiohttp cancels this handler (handler_cancellation):
            # closing the generator cancels the request in the core, which ends its stream
            # to Triton and frees the slot. A no-op once the last answer was read.
            await replies.aclose()

    async def _generate_request(
        self, request: web.Request, *, wire: Wire = ""
    ) -> AsyncGenerator[InferResponse, None]:
        model, version = _model_version(request)
        gateway = self.gateway

        async def ahead() -> None:  # what Triton checks before it reads the body
            try:
                info = await gateway.model_info(model)
            except UnknownModel:  # (from a shell process too: a fault keeps its class)
                raise ModelNotFound(model) from None
            check_model(info, version)
            check_encoding(request.headers.get("Content-Encoding"))

        async with self.door.path(request, model, ahead) as p:
            info = await gateway.model_info(model)
            req = await p.decode(_decode_generate, model, version, info)
        return gateway.stream_infer(req, p.headers, p.known, wire=wire)


def _decode_generate(body: bytes, model: str, version: str, info: ModelInfo) -> InferRequest:
    return decode_generate(model, version, body, info)


def _generate_failure(err: FrontendError) -> web.Response:
    """An error before any answer: Triton's compact ``{"error":...}``, the status (and
    retry hint) of ``fair_frontend.errors``."""
    out = _generate_json(generate_error(err.message), err.http_status)
    if err.retry_after_header is not None:
        out.headers["Retry-After"] = err.retry_after_header
    return with_quota(out, err.quota)


def _generate_json(body: bytes, status: int = 200) -> web.Response:
    # Triton does not compress generate's answers (its "[FIXME] compression").
    return web.Response(status=status, body=body, content_type="application/json")


# ---- connections: the door's caps and the header deadline ---------------------------------


class Connections:
    """A shell's open HTTP connections, in all and per peer address, against the caps of
    ``server`` (read at each connection: a reload applies to the next ones)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.open = 0
        self.per_peer: dict[str, int] = {}  # only addresses with a connection open

    @property
    def header_timeout_s(self) -> float:
        return self.gateway.config.server.header_timeout_s

    def admit(self, peer: str | None) -> str | None:
        """Count a new connection in; or, when it is over a cap, the reason (a
        ``fair_connections_refused_total`` label), and it is not counted."""
        server = self.gateway.config.server
        if self.open >= server.http_max_connections:
            return "max_connections"
        per_peer = server.http_max_connections_per_peer
        if peer is not None:
            held = self.per_peer.get(peer, 0)
            if per_peer is not None and held >= per_peer:
                return "max_connections_per_peer"
            self.per_peer[peer] = held + 1
        self.open += 1
        return None

    def release(self, peer: str | None) -> None:
        self.open -= 1
        if peer is not None:
            held = self.per_peer.pop(peer) - 1
            if held:
                self.per_peer[peer] = held

    def refused(self, reason: str) -> None:
        """A connection this shell closed itself, counted in the core's metrics."""
        self.gateway.link.tally(TallyEntry(None, "http", reason, 1, door=CONNECTION_DOOR))


class GuardedProtocol(RequestHandler):
    """aiohttp's protocol for one connection, behind the door: counted against the shell's
    caps (closed at once, unread, over one), and closed when a request's headers are not
    in within ``server.header_timeout_s``: of the connection's start for its first
    request, of the first byte of its headers for a later one (between requests a
    connection may idle, up to aiohttp's keep-alive timeout).

    A request's headers are in when aiohttp's parser has made a request of them (its
    ``_request_count`` grows); a byte that arrives while the connection waits for its
    next request (aiohttp's ``_waiter`` set: no request is being handled, whose body the
    byte could belong to) starts the next request's deadline. A pipelined request's
    partial headers, sent while an earlier one is handled and then never finished, wait
    for the keep-alive timeout instead."""

    def __init__(self, manager: web.Server, *, connections: Connections, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._connections = connections
        self._admitted = False
        self._peer: str | None = None
        self._head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        peername = transport.get_extra_info("peername")
        peer = str(peername[0]) if isinstance(peername, tuple) and peername else None
        refused = self._connections.admit(peer)
        if refused is not None:
            self._connections.refused(refused)
            self.force_close()
            return
        self._admitted, self._peer = True, peer
        self._await_head()

    def data_received(self, data: bytes) -> None:
        requests = self._request_count
        super().data_received(data)
        if self._request_count != requests:
            self._head_arrived()
        elif data and self._waiter is not None:
            self._await_head()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._head_arrived()
        if self._admitted:
            self._admitted = False
            self._connections.release(self._peer)
        super().connection_lost(exc)

    def _await_head(self) -> None:
        if self._head_deadline is None:
            self._head_deadline = self._loop.call_later(
                self._connections.header_timeout_s, self._head_late
            )

    def _head_arrived(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_late(self) -> None:
        self._head_deadline = None
        if self.transport is not None:
            self._connections.refused("header_timeout")
            self.force_close()

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's answer to what it could not parse, but never the client's bytes: a
        request line over its limit (a model name of a megabyte in the path) is not quoted
        back, even cut short."""
        if isinstance(exc, LineTooLong):
            message = f"the request line or a header is longer than {exc.args[1]} bytes"
        return super().handle_error(request, status, exc, message)


class _GuardedServer(web.Server):
    """aiohttp's server, making ``GuardedProtocol``s."""

    def __init__(self, *args: Any, connections: Connections, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._guard = connections

    def __call__(self) -> RequestHandler:
        return GuardedProtocol(self, loop=self._loop, connections=self._guard, **self._kwargs)


class Listener(web.AppRunner):
    """``web.AppRunner`` whose connections are ``GuardedProtocol``s (aiohttp's own
    server, with the arguments the app made it with)."""

    def __init__(self, app: web.Application, connections: Connections, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._connections = connections

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()
        return _GuardedServer(
            plain.request_handler,
            request_factory=plain.request_factory,
            handler_cancellation=plain.handler_cancellation,
            loop=plain._loop,
            connections=self._connections,
            **plain._kwargs,
        )
