"""KServe v2 over gRPC (grpc.aio): the thin shell around ``Gateway``.

The servicer is tritonclient's generated ``GRPCInferenceServiceServicer``. Errors end
the call with the status of ``fair_frontend.errors``; rate-limit and overload errors
carry the retry hint in trailing metadata ``retry-after`` (seconds).

Rate-limit state (``fair_frontend.quota``): OpenAI's ``x-ratelimit-*`` headers as
metadata. ModelInfer sends them as initial metadata, with its response or its error (a
429 included). A ModelStreamInfer stream carries many requests, and metadata once at
each end: its initial metadata has the latest state known when its first reply goes out
(that request's, or one answered since), its trailing metadata the latest state when it
ends (each request's own state is in neither where several overlap).

Identity before bytes (issue 17). gRPC's asyncio server reads a unary method's request
message whole before it calls the method's handler (``_handle_unary_unary_rpc`` in
grpc's ``aio/server.pyx.pxi`` awaits ``_receive_message`` first; an interceptor runs
before that, but can only choose the handler). A stream-request handler is called with
the message still unread (``_handle_stream_unary_rpc``), and a message nobody reads
waits in the transport, within its stream's HTTP/2 flow-control window. So every method
here takes its request as a stream (``GrpcShell.handlers``) and passes its door first,
from the call's metadata alone: the shell's bound on calls at once, then the key for a
method that needs one; only then is the message read. A method whose answer does not
depend on its request (health, server metadata, what the frontend does not implement)
never reads it. The window is HTTP/2's 64 KiB with gRPC's bandwidth probing off
(``server.grpc_bdp_probe``): what a refused call has sent beyond it never left the client.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from functools import partial
from typing import Any, NoReturn, TypeVar, cast

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from fair_frontend import __version__, grpc_codec
from fair_frontend.auth import Identity, grpc_peer_address, identity_headers
from fair_frontend.config import Config
from fair_frontend.errors import FrontendError, Internal, InvalidArgument, QueueFull
from fair_frontend.protocol import InferRequest, ParamValue
from fair_frontend.quota import Quota, quota_headers
from fair_frontend.shell.gateway import Gateway
from fair_frontend.shell.side_doors import FRONTEND_HEADER

log = logging.getLogger(__name__)

T = TypeVar("T")
GRPC_DEFAULT_PENDING_CALLS = 1000  # gRPC core's own max_pending_requests
# Replies of one stream written ahead of a client that does not read them.
REPLY_BUFFER = 64
# Side doors that answer only a tenant with a key: their message is read once the key in
# the call's metadata is known good. Every other method but inference (ModelInfer and
# ModelStreamInfer, whose requests arrive as bytes: parsed only after the key and size are
# checked) answers without reading its message.
KEYED_METHODS = frozenset({"ModelReady", "ModelMetadata", "ModelConfig", "ModelStatistics"})


async def abort(context: grpc.aio.ServicerContext, err: FrontendError) -> NoReturn:
    await send_quota(context, err.quota)
    if err.retry_after_header is not None:
        context.set_trailing_metadata((("retry-after", err.retry_after_header),))
    await context.abort(err.grpc_code, err.message)
    raise AssertionError("unreachable: abort raises")  # pragma: no cover


async def send_quota(context: grpc.aio.ServicerContext, quota: Quota | None) -> None:
    """The rate-limit headers of ``quota`` (``quota_headers``) as the call's initial
    metadata; nothing for None. Only on a call whose initial metadata has not gone yet
    (ModelInfer: with its response or error)."""
    if quota is not None:
        await context.send_initial_metadata(tuple(quota_headers(quota).items()))


class LatestQuota:
    """The latest rate-limit state a stream's requests were answered with (None: none
    yet, or no limits): ModelStreamInfer's metadata (the module docstring)."""

    __slots__ = ("quota",)

    def __init__(self) -> None:
        self.quota: Quota | None = None

    def saw(self, quota: Quota | None) -> None:
        if quota is not None:
            self.quota = quota


def _headers(context: grpc.aio.ServicerContext) -> dict[str, str]:
    """Metadata as lower-cased headers, every copy of a repeated key seen
    (``identity_headers``), and the connection's peer address (``context.peer()``)."""
    pairs = [
        (key, value)
        for key, value in context.invocation_metadata() or ()
        if not isinstance(value, bytes)  # binary ("-bin") metadata carries no identity
    ]
    return identity_headers(pairs, grpc_peer_address(context.peer()))


async def _guard(context: grpc.aio.ServicerContext, call: Callable[[], Awaitable[T]]) -> T:
    try:
        return await call()
    except FrontendError as err:
        await abort(context, err)
    except Exception as err:
        log.exception("internal error")
        await abort(context, Internal(f"internal error: {type(err).__name__}"))


async def _only_message(context: Any) -> bytes:
    """The one message of a unary call, read now (a unary client sends exactly one).
    ``context.read()``, not the request iterator: no async generator per call (measured,
    ``bench_door``: the iterator cost a tenth more than gRPC's own unary path, this not)."""
    raw = await context.read()
    if raw is grpc.aio.EOF:
        raise InvalidArgument("the call ended before its request message")
    return cast(bytes, raw)  # registered without a deserializer: the message's bytes


class GrpcShell(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.calls = 0  # in progress in this shell, bounded by grpc_max_concurrent_calls

    # ---- the door: what every call passes before its message is read -------------------

    def handlers(self) -> tuple[str, dict[str, grpc.RpcMethodHandler]]:
        """The service's name and its method handlers, each taking its request as a
        stream behind the door (the module's docstring says why)."""
        service, generated = _method_handlers(self)
        return service, {name: self._door(name, h) for name, h in generated.items()}

    def _door(self, name: str, generated: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        if generated.request_streaming:  # ModelStreamInfer: already reads when it chooses
            serialize = generated.response_serializer
            return generated._replace(
                request_deserializer=None, response_serializer=partial(_passed_on, serialize)
            )
        behaviour: Callable[[Any, Any], Awaitable[Any]]
        if name == "ModelInfer":
            behaviour = self._infer_door
        else:
            behaviour = self._side_door(name, getattr(self, name), generated.request_deserializer)
        return grpc.stream_unary_rpc_method_handler(
            behaviour,
            request_deserializer=None,
            response_serializer=generated.response_serializer,
        )

    def _side_door(
        self,
        name: str,
        method: Callable[[Any, Any], Awaitable[Any]],
        deserialize: Callable[[bytes], Any],
    ) -> Callable[[Any, Any], Awaitable[Any]]:
        """Any method but inference: a keyed one reads its message once the key is good;
        refused by its key, it is answered as the method answers these headers with an
        empty request (worded and counted as ever), unread. An open one's answer does not
        depend on its request: never read."""
        keyed = name in KEYED_METHODS

        async def door(requests: Any, context: Any) -> Any:
            headers = _headers(context)
            await self._enter(headers, context)
            try:
                if not keyed:
                    return await method(deserialize(b""), context)
                try:
                    self.gateway.auth.identify(headers, None)
                except FrontendError:
                    return await method(deserialize(b""), context)
                return await method(deserialize(await _only_message(context)), context)
            finally:
                self.calls -= 1

        return door

    async def _infer_door(self, requests: Any, context: Any) -> Any:
        """ModelInfer: the key and a full global queue from the call's metadata (the model
        is in the message), then the message."""
        headers = _headers(context)
        await self._enter(headers, context)
        try:
            known = await self._identify(headers, context, shed=True)
            raw = await _guard(context, lambda: _only_message(context))
            return await self._infer(raw, headers, known, context)
        finally:
            self.calls -= 1

    async def _enter(self, headers: dict[str, str], context: Any) -> None:
        """Count a call in (``calls``: the caller counts it out), or end it here, over
        the shell's bound on calls at once (counted and logged as a refusal)."""
        bound = self.gateway.config.grpc_max_concurrent_calls()
        if self.calls >= bound:
            err = QueueFull(
                f"{bound} gRPC calls in progress in this shell (server.grpc_max_concurrent_calls)"
            )
            self.gateway.rejected("", headers, err, 0.0)
            await abort(context, err)
        self.calls += 1

    async def _identify(
        self, headers: dict[str, str], context: Any, *, shed: bool
    ) -> Identity | None:
        """The tenant, as far as the call's metadata tells (None: a trusted gateway names
        it in the message), or end the call here: no valid key, or (``shed``) the global
        queue full. Counted and logged as every request the shell refuses."""
        started = time.monotonic()
        try:
            if shed:
                return self.gateway.admit_early("", headers)  # the model is in the message
            auth = self.gateway.auth
            tenant = auth.identify_by_headers(headers)
            return None if tenant is None else Identity(tenant, auth)
        except FrontendError as err:
            self.gateway.rejected("", headers, err, time.monotonic() - started)
            await abort(context, err)

    # Health and server metadata are open; the model doors need the tenant's key (the
    # side doors of ``Gateway``).

    async def ServerLive(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerLiveResponse(live=await self.gateway.side.live())

    async def ServerReady(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerReadyResponse(ready=await self.gateway.side.ready())

    async def ModelReady(self, request: Any, context: Any) -> Any:
        async def ready() -> Any:
            answer = await self.gateway.side.model_ready(
                request.name, request.version, _headers(context)
            )
            return service_pb2.ModelReadyResponse(ready=answer)

        return await _guard(context, ready)

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        async def answer() -> Any:
            doc = await self.gateway.side.server_metadata()
            # The response names the Triton behind; the frontend names itself here.
            await context.send_initial_metadata(((FRONTEND_HEADER, __version__),))
            return service_pb2.ServerMetadataResponse(**doc)

        return await _guard(context, answer)

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        return await _guard(
            context,
            lambda: self.gateway.side.model_metadata(
                request.name, request.version, _headers(context)
            ),
        )

    async def ModelConfig(self, request: Any, context: Any) -> Any:
        return await _guard(
            context,
            lambda: self.gateway.side.model_config(
                request.name, request.version, _headers(context)
            ),
        )

    async def ModelStatistics(self, request: Any, context: Any) -> Any:
        return await _guard(
            context,
            lambda: self.gateway.side.statistics(request.name, request.version, _headers(context)),
        )

    async def _infer(
        self, raw: bytes, headers: dict[str, str], known: Identity | None, context: Any
    ) -> Any:
        """ModelInfer's request, as bytes, of a call past the door (``_infer_door``): its
        queue and size are checked before it is parsed (``_decode``)."""

        async def call() -> Any:
            tenant = known.tenant if known is not None else None
            await self.gateway.turns.take(tenant)  # decoded in turn with other tenants'
            req = self._decode(raw, headers, tenant)
            resp = await self.gateway.infer(req, headers, known)
            await send_quota(context, resp.quota)
            return grpc_codec.encode_infer(resp)

        return await _guard(context, call)

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[bytes], context: Any
    ) -> AsyncIterator[Any]:
        """Bidirectional streaming: every request on the stream is scheduled like any
        other; responses (several for a decoupled model) go back as they come, each
        request's in order. An error answers that request in-stream, as Triton does.

        The key is checked once, from the stream's metadata, before any message is read
        (``_enter``): without a valid one the stream ends UNAUTHENTICATED
        (PERMISSION_DENIED for a key naming another tenant) and nothing it sent is read.
        Reading is bounded by ``StreamInfer`` (backpressure on a client that does not read
        its replies)."""
        headers = _headers(context)
        await self._enter(headers, context)
        try:
            # A full queue is answered per request, in-stream; the key, for the stream.
            known = await self._identify(headers, context, shed=False)
            latest = LatestQuota()
            stream = StreamInfer(
                lambda raw: self._stream_call(raw, headers, known, latest),
                self.gateway.config.server.grpc_stream_max_inflight,
            )
            first = True
            async for reply in stream.replies(request_iterator):
                if first:
                    first = False
                    await send_quota(context, latest.quota)
                yield reply
            if latest.quota is not None:
                context.set_trailing_metadata(tuple(quota_headers(latest.quota).items()))
        finally:
            self.calls -= 1

    def _stream_call(
        self, raw: bytes, headers: dict[str, str], known: Identity | None, latest: LatestQuota
    ) -> StreamCall:
        """One message of a stream, decoded by the stream's reader (in the order sent):
        its sequence, if it belongs to one, and how to run it. A refusal is its reply."""
        try:
            req = self._decode(raw, headers, known.tenant if known is not None else None)
        except FrontendError as err:
            return StreamCall(None, partial(_refusal, _error_reply(err)), _always_in_order)
        except Exception as err:  # not the client's doing: answered, the stream goes on
            log.exception("internal error on a stream")
            return StreamCall(None, partial(_refusal, _internal_reply(err)), _always_in_order)
        sequence_id = req.sequence.get("sequence_id")
        # Ids 0 and "" are no sequence to Triton (as to ``core.sequences``).
        key = (req.model, req.version, sequence_id) if sequence_id not in (None, 0, "") else None
        return StreamCall(
            key,
            lambda: self._stream_request(req, headers, known, latest),
            lambda: self._in_order(req.model),
        )

    async def _in_order(self, model: str) -> bool:
        """Whether a request's replies keep its place on the stream: Triton's, unless the
        model is decoupled (``stream_infer_handler.cc`` queues a state for its response,
        ``EnqueueForResponse``, only for a model that is not). A model Triton does not
        know is not decoupled there either."""
        try:
            return not (await self.gateway.model_info(model)).decoupled
        except FrontendError:
            return True

    async def _stream_request(
        self,
        req: InferRequest,
        headers: dict[str, str],
        known: Identity | None,
        latest: LatestQuota,
    ) -> AsyncGenerator[Any, None]:
        """One request of a stream: its replies, an error as an in-stream reply; the
        rate-limit state each came with goes to ``latest`` before it is put."""
        try:
            # Closed when this generator is (its stream ends): the request is cancelled
            # in the core at once, not when the generator is collected.
            answers = self.gateway.stream_infer(req, headers, known, wire="grpc")
            async with aclosing(answers):
                async for resp in answers:
                    latest.saw(resp.quota)
                    if resp.wire:  # Triton's own message, passed on (``_passed_on``)
                        yield resp.wire
                        continue
                    reply = service_pb2.ModelStreamInferResponse()
                    reply.infer_response.CopyFrom(grpc_codec.encode_infer(resp))
                    yield reply
        except FrontendError as err:
            latest.saw(err.quota)
            yield _error_reply(err)
        except Exception as err:
            log.exception("internal error on a stream")
            yield _internal_reply(err)

    def _decode(self, raw: bytes, headers: dict[str, str], tenant: str | None) -> InferRequest:
        """A request's bytes, of ``tenant`` (the door checked the key), checked in order
        of cost: its model's queue, the size against the model's bound, then the parse and
        decode. A refusal here is still one counted, logged outcome."""
        started = time.monotonic()
        peeked, rid = grpc_codec.peek_header(raw)
        model = peeked or ""
        try:
            self.gateway.shed(tenant, model)
            self._check_size(model, len(raw))
            msg = grpc_codec.parse_infer_request(raw)
            if msg.model_name != model:  # it was not among the first fields: check again
                model = msg.model_name
                self.gateway.shed(tenant, model)  # its length, the tenant's access, its queue
                self._check_size(model, len(raw))
            return grpc_codec.decode_infer(msg, precheck=self.gateway.precheck(model))
        except FrontendError as err:
            self.gateway.rejected(model, headers, err, time.monotonic() - started, request_id=rid)
            raise

    def _check_size(self, model: str, size: int) -> None:
        bound = self.gateway.kept_wire_bound(model)
        if size > bound:
            raise InvalidArgument(
                f"request too large: the message is {size} bytes, model '{model}' accepts "
                f"at most {bound} (what its inputs can hold on the wire, and the framing)"
            )


def _passed_on(serialize: Callable[[Any], bytes], reply: Any) -> bytes:
    """A stream's reply on the wire: Triton's own message as it came (bytes: the shell
    read it but changed nothing, ``StreamRelay.relay``), else the message made here."""
    return reply if isinstance(reply, bytes) else serialize(reply)


def max_message_bytes(config: Config) -> int:
    """gRPC's own receive limit: the largest endpoint's bound. A message above it is
    refused by gRPC before any of it is buffered whole (RESOURCE_EXHAUSTED, gRPC's own
    status, like Triton's at its INT32_MAX limit); below it, the endpoint's own bound
    answers INVALID_ARGUMENT (``GrpcShell._check_size``). Endpoints are fixed at start."""
    return min(config.max_wire_bytes(), 2**31 - 1)


def max_pending_calls(config: Config) -> int:
    """Calls gRPC core may hold before the (single-threaded) asyncio server picks them up.

    A burst of thousands must queue here, where it is scheduled fairly, not be cancelled
    at the door, so this is not gRPC's default (1000). But a call beyond the global queue
    cap would be refused anyway: more pending calls than that only cost memory (each holds
    its connection's buffers), so the cap bounds it, never below gRPC's default."""
    return max(config.queues.max_queued, GRPC_DEFAULT_PENDING_CALLS)


SequenceKey = tuple[str, str, ParamValue]  # model, version, the client's sequence id


@dataclass(frozen=True, slots=True)
class StreamCall:
    """One message of a stream, as its reader decoded it.

    ``sequence``: the sequence it belongs to (None for none); ``replies`` runs it;
    ``in_order``: whether its replies keep its place among the stream's replies."""

    sequence: SequenceKey | None
    replies: Callable[[], AsyncGenerator[Any, None]]
    in_order: Callable[[], Awaitable[bool]]


async def _always_in_order() -> bool:
    return True


async def _refusal(reply: Any) -> AsyncGenerator[Any, None]:
    yield reply


def _error_reply(err: FrontendError) -> Any:
    """An error answers its request in-stream, as Triton's does (the stream goes on)."""
    return service_pb2.ModelStreamInferResponse(error_message=err.message)


def _internal_reply(err: Exception) -> Any:
    return service_pb2.ModelStreamInferResponse(
        error_message=f"internal error: {type(err).__name__}"
    )


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _settle_after(before: asyncio.Future[None], future: asyncio.Future[None]) -> None:
    """Settle ``future`` once ``before`` is (at once if it is)."""
    if before.done():
        _settle(future)
    else:
        before.add_done_callback(lambda _: _settle(future))


class _ReplyBuffer:
    """A stream's replies waiting for the client to read them: at most ``bound``, one
    reader (the stream's writer) and many writers (its requests), each woken by a future
    of its own (one event loop: nothing to lock; a reply put while the reader waits costs
    one future's result, not a condition's lock and notify)."""

    __slots__ = ("_bound", "_items", "_reader", "_writers")

    def __init__(self, bound: int) -> None:
        self._bound = bound
        self._items: deque[Any] = deque()
        self._reader: asyncio.Future[None] | None = None
        self._writers: list[asyncio.Future[None]] = []  # waiting for room

    async def room(self) -> None:
        """Until there is room for one more reply."""
        while len(self._items) >= self._bound:
            waiter = asyncio.get_running_loop().create_future()
            self._writers.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._writers:  # cancelled while waiting
                    self._writers.remove(waiter)

    async def put(self, reply: Any) -> None:
        """``reply`` after the others, once there is room for it."""
        if len(self._items) >= self._bound:
            await self.room()
        self._items.append(reply)
        self.wake()

    def wake(self) -> None:
        """The reader looks again: a reply came, or the stream may have ended."""
        reader = self._reader
        if reader is not None and not reader.done():
            reader.set_result(None)

    async def take(self, finished: Callable[[], bool]) -> Any:
        """The oldest reply, waiting for one; None once empty and ``finished()``."""
        items = self._items
        while not items:
            if finished():
                return None
            self._reader = reader = asyncio.get_running_loop().create_future()
            try:
                await reader
            finally:
                self._reader = None
        reply = items.popleft()
        if self._writers:  # each looks again; one of them takes the room
            writers, self._writers = self._writers, []
            for waiter in writers:
                if not waiter.done():
                    waiter.set_result(None)
        return reply


class StreamInfer:
    """One ModelStreamInfer stream: its reader, its requests in flight, its replies.

    Order, as Triton keeps it (``src/grpc/stream_infer_handler.cc``): Triton reads a
    stream's messages one after another and issues each into the model's scheduler in that
    order, and writes the response of a request to a model that is not decoupled only
    after those of the earlier such requests (a decoupled model's go out as they come).
    Here every request is a task of its own, and the core schedules (and with several
    shells, receives) them in an order of its choosing; so:
    - the reader decodes each message in the order sent (``StreamCall``);
    - a request of a sequence (same model, version and ``sequence_id``) starts only once
      the previous request of that sequence on the stream has its answers: a stateful
      model computes on the sequence as sent, and the core's sequence map sees its start
      first and its end last. Requests of other sequences, and those of none, still run
      side by side, as in Triton;
    - a request that is not decoupled puts its reply only after every earlier such request
      of the stream has put its own (one chain of futures, in reading order; a decoupled
      request passes its place on at once).

    Bounded so that a client that sends and never reads costs a bounded amount:
    - at most ``max_inflight`` requests handled at once (one task each; a request waiting
      for its turn holds its slot);
    - at most ``REPLY_BUFFER`` replies waiting for the client to read them: a request
      whose reply does not fit waits, holding its slot;
    - the next message is read only when a slot is free and the buffer is not full; until
      then gRPC's flow control holds the client back, and nothing new starts.

    When the client half-closes, the requests in flight finish and the stream ends after
    their replies. If reading fails (the client reset the stream) or the stream is
    cancelled, the requests in flight are cancelled: each then ends in the core as
    cancelled, once.
    """

    def __init__(self, open_call: Callable[[bytes], StreamCall], max_inflight: int) -> None:
        self._open = open_call
        self._slots = asyncio.Semaphore(max_inflight)
        self._buffer = _ReplyBuffer(REPLY_BUFFER)
        self._tasks: set[asyncio.Task[None]] = set()
        self._reading = True
        # Settled once every request read so far that keeps its place has put its replies.
        self._placed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._placed.set_result(None)
        # Per open sequence: settled once its latest request read has its answers.
        self._sequences: dict[SequenceKey, asyncio.Future[None]] = {}

    async def replies(self, requests: AsyncIterator[bytes]) -> AsyncIterator[Any]:
        """The stream's replies, in Triton's order, until every request is answered."""
        reader = asyncio.get_running_loop().create_task(self._read(requests))
        try:
            while (reply := await self._next_reply()) is not None:
                yield reply
        finally:
            reader.cancel()
            for task in list(self._tasks):
                task.cancel()

    async def _next_reply(self) -> Any:
        """The oldest reply; None once reading ended and every request is answered."""
        return await self._buffer.take(self._finished)

    def _finished(self) -> bool:
        return not self._reading and not self._tasks

    async def _read(self, requests: AsyncIterator[bytes]) -> None:
        loop = asyncio.get_running_loop()
        iterator = aiter(requests)
        try:
            while True:
                await self._slots.acquire()
                await self._buffer.room()
                try:
                    raw = await anext(iterator)
                except StopAsyncIteration:
                    self._slots.release()
                    break
                # Everything that fixes the request's place happens here, in reading order.
                call = self._open(raw)
                before, placed = self._placed, loop.create_future()
                self._placed = placed
                previous = answered = None
                if call.sequence is not None:
                    previous = self._sequences.get(call.sequence)
                    answered = self._sequences[call.sequence] = loop.create_future()
                task = loop.create_task(self._run(call, before, placed, previous, answered))
                self._tasks.add(task)
                task.add_done_callback(self._forget)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # the client reset the stream: nobody to answer
            log.info("stream read failed (%s): cancelling its requests", type(err).__name__)
            for task in list(self._tasks):
                task.cancel()
        finally:
            self._reading = False
            self._buffer.wake()

    async def _run(
        self,
        call: StreamCall,
        before: asyncio.Future[None],
        placed: asyncio.Future[None],
        previous: asyncio.Future[None] | None,
        answered: asyncio.Future[None] | None,
    ) -> None:
        """One request: after its sequence's previous one, replies in its place.

        ``before``/``placed``: the reply chain (settled once every earlier request that
        keeps its place has put its replies / once this one has too); ``previous``/
        ``answered``: its sequence's chain (the previous request has its answers / this
        one has). Both are settled on every way out, a cancellation included, so that
        no later request waits for one that is gone."""
        in_order = True
        try:
            if previous is not None:
                await asyncio.shield(previous)
            in_order = await call.in_order()
            if not in_order:
                _settle_after(before, placed)  # a decoupled request has no place to keep
            async with aclosing(call.replies()) as replies:
                if in_order:
                    # Triton's one response per request: taken whole, then put in turn.
                    answers = [reply async for reply in replies]
                    if answered is not None:
                        _settle(answered)
                    await asyncio.shield(before)
                    for reply in answers:
                        await self._buffer.put(reply)
                else:
                    async for reply in replies:
                        await self._buffer.put(reply)
        finally:
            if answered is not None:
                _settle(answered)
                if self._sequences.get(call.sequence) is answered:  # type: ignore[arg-type]
                    del self._sequences[call.sequence]  # type: ignore[arg-type]
            _settle_after(before, placed)
            self._slots.release()

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("stream request failed", exc_info=task.exception())
        self._buffer.wake()  # the stream may have ended


def server_options(config: Config) -> list[tuple[str, int]]:
    """gRPC's own bounds: message size, pending calls, and per connection its streams,
    window, idle time, age and handshake (``server`` in the config). Fixed at start.

    Pings: gRPC's defaults already refuse a ping flood (a client pinging more often than
    every 5 minutes without data gets GOAWAY after two strikes,
    ``grpc.http2.min_ping_interval_without_data_ms`` and ``max_ping_strikes``)."""
    server = config.server
    pending = max_pending_calls(config)
    options = [
        ("grpc.max_receive_message_length", max_message_bytes(config)),
        # Responses are Triton's, passed on: as large as Triton sends them.
        ("grpc.max_send_message_length", 2**31 - 1),
        ("grpc.server.max_pending_requests", pending),
        ("grpc.server.max_pending_requests_hard_limit", pending),
        ("grpc.max_allowed_incoming_connections", server.grpc_max_connections),
        ("grpc.max_concurrent_streams", server.grpc_max_streams_per_connection),
        ("grpc.server_handshake_timeout_ms", _ms(server.header_timeout_s)),
        ("grpc.http2.bdp_probe", int(server.grpc_bdp_probe)),
    ]
    if server.grpc_max_connection_idle_s is not None:
        options.append(("grpc.max_connection_idle_ms", _ms(server.grpc_max_connection_idle_s)))
    if server.grpc_max_connection_age_s is not None:
        options.append(("grpc.max_connection_age_ms", _ms(server.grpc_max_connection_age_s)))
    if server.grpc_max_connection_age_grace_s is not None:
        grace = _ms(server.grpc_max_connection_age_grace_s)
        options.append(("grpc.max_connection_age_grace_ms", grace))
    return options


def _ms(seconds: float) -> int:
    return max(1, min(round(seconds * 1000), 2**31 - 1))


def make_server(gateway: Gateway, *, shared_port: bool = False) -> grpc.aio.Server:
    """The gRPC server: tritonclient's service, every method behind the door (the module's
    docstring), ModelInfer and ModelStreamInfer taking their requests as bytes (identity
    and size come before parsing), and gRPC's own bounds (``server_options``).

    ``shared_port``: the shell processes of one frontend bind the same port
    (SO_REUSEPORT, the kernel spreading connections over them; the pool made sure the
    port was free first). Otherwise the port is this server's alone: gRPC's default
    (SO_REUSEPORT on) would let a second server of the same user bind a port already
    serving, silently taking part of its connections, where Triton refuses to start."""
    options = [*server_options(gateway.config), ("grpc.so_reuseport", int(shared_port))]
    server = grpc.aio.server(options=options)
    service, handlers = GrpcShell(gateway).handlers()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)
    return server


class _HandlerCapture:
    """Stands in for a server to take the handlers tritonclient's generated code makes."""

    def __init__(self) -> None:
        self.service = ""
        self.handlers: dict[str, Any] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self.service, self.handlers = service, dict(handlers)


def _method_handlers(shell: GrpcShell) -> tuple[str, dict[str, Any]]:
    """The service name and its method handlers, as the generated code registers them."""
    capture = _HandlerCapture()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(shell, capture)
    if not capture.handlers:
        raise RuntimeError("tritonclient's service_pb2_grpc registers no method handlers")
    return capture.service, capture.handlers
