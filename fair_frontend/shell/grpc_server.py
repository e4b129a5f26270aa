"""KServe v2 over gRPC (grpc.aio): the thin shell around ``Gateway``.

The servicer is tritonclient's generated ``GRPCInferenceServiceServicer``. Errors end
the call with the status of ``fair_frontend.errors``; rate-limit and overload errors
carry the retry hint in trailing metadata ``retry-after`` (seconds).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from fair_frontend import grpc_codec
from fair_frontend.auth import grpc_peer_address, identity_headers
from fair_frontend.errors import FrontendError, Internal
from fair_frontend.shell.gateway import Gateway

log = logging.getLogger(__name__)

T = TypeVar("T")
MAX_PENDING_CALLS = 1 << 20


async def abort(context: grpc.aio.ServicerContext, err: FrontendError) -> NoReturn:
    if err.retry_after_header is not None:
        context.set_trailing_metadata((("retry-after", err.retry_after_header),))
    await context.abort(err.grpc_code, err.message)
    raise AssertionError("unreachable: abort raises")  # pragma: no cover


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


class GrpcShell(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    # Health and server metadata are open; the model doors need the tenant's key (the
    # side doors of ``Gateway``).

    async def ServerLive(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerLiveResponse(live=await self.gateway.live())

    async def ServerReady(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerReadyResponse(ready=await self.gateway.ready())

    async def ModelReady(self, request: Any, context: Any) -> Any:
        async def ready() -> Any:
            answer = await self.gateway.model_ready(
                request.name, request.version, _headers(context)
            )
            return service_pb2.ModelReadyResponse(ready=answer)

        return await _guard(context, ready)

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        doc = await self.gateway.server_metadata()
        return service_pb2.ServerMetadataResponse(**doc)

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        return await _guard(
            context,
            lambda: self.gateway.model_metadata(request.name, request.version, _headers(context)),
        )

    async def ModelConfig(self, request: Any, context: Any) -> Any:
        return await _guard(
            context,
            lambda: self.gateway.model_config(request.name, request.version, _headers(context)),
        )

    async def ModelStatistics(self, request: Any, context: Any) -> Any:
        return await _guard(
            context,
            lambda: self.gateway.statistics(request.name, request.version, _headers(context)),
        )

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        async def call() -> Any:
            headers = _headers(context)
            started = time.monotonic()
            try:
                req = grpc_codec.decode_infer(request)
            except FrontendError as err:
                # Answered before Gateway.infer: still one counted, logged outcome.
                self.gateway.rejected(request.model_name, headers, err, time.monotonic() - started)
                raise
            resp = await self.gateway.infer(req, headers)
            return grpc_codec.encode_infer(resp)

        return await _guard(context, call)

    async def ModelStreamInfer(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        """Bidirectional streaming: every request on the stream is scheduled like any
        other; responses (several for a decoupled model) go back as they come, each
        request's in order. An error answers that request in-stream, as Triton does."""
        headers = _headers(context)
        replies: asyncio.Queue[Any] = asyncio.Queue()
        handlers: set[asyncio.Task[None]] = set()

        async def handle(msg: Any) -> None:
            started = time.monotonic()
            try:
                try:
                    req = grpc_codec.decode_infer(msg)
                except FrontendError as err:
                    self.gateway.rejected(msg.model_name, headers, err, time.monotonic() - started)
                    raise
                async for resp in self.gateway.stream_infer(req, headers):
                    reply = service_pb2.ModelStreamInferResponse()
                    reply.infer_response.CopyFrom(grpc_codec.encode_infer(resp))
                    replies.put_nowait(reply)
            except FrontendError as err:
                replies.put_nowait(service_pb2.ModelStreamInferResponse(error_message=err.message))
            except Exception as err:
                log.exception("internal error on a stream")
                replies.put_nowait(
                    service_pb2.ModelStreamInferResponse(
                        error_message=f"internal error: {type(err).__name__}"
                    )
                )

        async def read() -> None:
            async for msg in request_iterator:
                task = asyncio.get_running_loop().create_task(handle(msg))
                handlers.add(task)
                task.add_done_callback(handlers.discard)
            while handlers:
                await asyncio.gather(*list(handlers), return_exceptions=True)
            replies.put_nowait(None)

        reader = asyncio.get_running_loop().create_task(read())
        try:
            while (reply := await replies.get()) is not None:
                yield reply
        finally:
            reader.cancel()
            for task in list(handlers):
                task.cancel()


def make_server(gateway: Gateway) -> grpc.aio.Server:
    server = grpc.aio.server(
        options=[
            # Like Triton (INT32_MAX): the per-endpoint max_request_bytes is the real limit,
            # answered INVALID_ARGUMENT; gRPC's own would be RESOURCE_EXHAUSTED, which
            # PROTOCOL.md keeps for a tenant's rate limit.
            ("grpc.max_receive_message_length", 2**31 - 1),
            ("grpc.max_send_message_length", 2**31 - 1),
            # gRPC core cancels calls beyond ~1000 not yet picked up by the (single-threaded)
            # asyncio server: a burst of thousands must queue here, where it is scheduled
            # fairly, not be cancelled at the door. Queue caps bound it instead.
            ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
            ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
        ]
    )
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(GrpcShell(gateway), server)
    return server
