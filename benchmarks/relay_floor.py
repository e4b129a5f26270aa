"""Bare relays of Triton's streams: the floor a stream relay in Python cannot go under.

Each passes Triton's bytes through and decodes nothing, so the CPU it spends per streamed
token is what the transport alone costs (the event loop, the HTTP/2 or HTTP/1.1 framing,
the syscalls), against which ``bench_relay`` puts the frontend's.

- ``grpc``: a grpc.aio server whose methods are registered as a generic handler without
  (de)serializers: for each incoming ``ModelStreamInfer`` stream it opens one to Triton
  and forwards every request message up and every response message down as raw bytes;
  every unary method (``ModelInfer``, and the metadata, config and health calls
  perf_analyzer makes first) is one call to Triton with the request's bytes, its answer's
  bytes sent back (``bench_throughput``'s relay floor: what a process that relays each
  unary call pays, without batching, admission or anything else).
- ``http``: an aiohttp server answering ``POST /v2/models/{model}/generate_stream`` by
  posting the body to Triton's own ``/generate_stream`` and writing the response's chunks
  (server-sent events) back as they arrive.

    .venv/bin/python -m benchmarks.relay_floor grpc|http --port P
        --triton-grpc 127.0.0.1:8001 --triton-http http://127.0.0.1:8000

Ready when it prints ``ready`` on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator

import uvloop

SERVICE = "inference.GRPCInferenceService"
METHOD = f"/{SERVICE}/ModelStreamInfer"
# The service's unary methods a KServe client calls (tritonclient, perf_analyzer).
UNARY = (
    "ServerLive",
    "ServerReady",
    "ModelReady",
    "ServerMetadata",
    "ModelMetadata",
    "ModelConfig",
    "ModelStatistics",
    "ModelInfer",
)
UNLIMITED = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


async def serve_grpc(port: int, triton: str) -> None:
    import grpc

    channel = grpc.aio.insecure_channel(triton, options=UNLIMITED)
    upstream = channel.stream_stream(METHOD, request_serializer=None, response_deserializer=None)

    async def stream(
        requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        call = upstream(requests)  # grpc.aio reads the incoming iterator itself
        try:
            async for response in call:
                yield response
        finally:
            call.cancel()  # the client went away first: end Triton's stream too

    def unary(name: str) -> grpc.RpcMethodHandler:
        call = channel.unary_unary(
            f"/{SERVICE}/{name}", request_serializer=None, response_deserializer=None
        )

        async def relay(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            try:
                return await call(request)
            except grpc.aio.AioRpcError as err:  # Triton's refusal, passed on as it is
                await context.abort(err.code(), err.details() or "")
                raise  # (abort raises)

        return grpc.unary_unary_rpc_method_handler(
            relay, request_deserializer=None, response_serializer=None
        )

    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(
                stream, request_deserializer=None, response_serializer=None
            ),
            **{name: unary(name) for name in UNARY},
        },
    )
    server = grpc.aio.server(options=UNLIMITED)
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    try:
        await server.wait_for_termination()
    finally:
        await server.stop(None)
        await channel.close()


async def serve_http(port: int, triton: str) -> None:
    import aiohttp
    from aiohttp import web

    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
    )

    async def generate_stream(request: web.Request) -> web.StreamResponse:
        model = request.match_info["model"]
        body = await request.read()
        url = f"{triton}/v2/models/{model}/generate_stream"
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        out = web.StreamResponse()
        async with session.post(url, data=body, headers=headers) as upstream:
            out.set_status(upstream.status)
            out.headers["content-type"] = upstream.headers.get("content-type", "text/event-stream")
            with contextlib.suppress(ConnectionResetError):  # the client left: end Triton's
                await out.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
        return out

    app = web.Application()
    app.router.add_post("/v2/models/{model}/generate_stream", generate_stream)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print("ready", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        await session.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("protocol", choices=["grpc", "http"])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--triton-grpc", default="127.0.0.1:8001")
    parser.add_argument("--triton-http", default="http://127.0.0.1:8000")
    args = parser.parse_args()
    # uvloop, as the frontend's processes run (fair_frontend.cli, shell.process).
    with contextlib.suppress(KeyboardInterrupt):
        if args.protocol == "grpc":
            uvloop.run(serve_grpc(args.port, args.triton_grpc))
        else:
            uvloop.run(serve_http(args.port, args.triton_http.rstrip("/")))


if __name__ == "__main__":
    main()
