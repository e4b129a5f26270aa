"""Batches to Triton over HTTP give what the same batches over gRPC give, errors included.

The core sends its batches over Triton's HTTP endpoint where it knows it (cheaper per call
in Python, ``fair_frontend.backends.triton.http``) and over gRPC otherwise. The same
``TritonForwarder.infer`` call goes both ways against the session's real Triton: the
outputs are equal, and an error is the same error (class, gRPC code, HTTP status,
message), so a client of the frontend cannot tell which way its batch went.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from fair_frontend.backends.triton.embedded import EmbeddedTriton, free_port
from fair_frontend.backends.triton.forwarder import TritonForwarder
from fair_frontend.backends.triton.forwarder import _finishing as forwarder_calls
from fair_frontend.errors import FrontendError, Unavailable
from fair_frontend.protocol import Batch, RequestedOutput, Tensor


@pytest.fixture
async def both(triton: EmbeddedTriton) -> AsyncIterator[tuple[TritonForwarder, TritonForwarder]]:
    over_grpc = TritonForwarder(triton.grpc_url)
    over_http = TritonForwarder(triton.grpc_url, http_url=triton.http_url)
    assert over_http.http is not None and over_grpc.http is None
    try:
        yield over_grpc, over_http
    finally:
        await over_grpc.close()
        await over_http.close()


def _rows(rows: int) -> str:
    return json.dumps({"tenant": ["t"] * rows, "priority": [1] * rows})


async def _both_ways(fwds: tuple[TritonForwarder, TritonForwarder], *args: Any, **kw: Any) -> Any:
    batch = Batch(*args, **kw)
    return await asyncio.gather(*(f.infer(batch) for f in fwds), return_exceptions=True)


def _same_outputs(a: Any, b: Any) -> None:
    assert not isinstance(a, BaseException) and not isinstance(b, BaseException), (a, b)
    (va, oa), (vb, ob) = a, b
    assert va == vb
    assert [(t.name, t.datatype, t.shape) for t in oa] == [
        (t.name, t.datatype, t.shape) for t in ob
    ]
    for x, y in zip(oa, ob, strict=True):
        if x.datatype == "BYTES":
            assert x.data.tolist() == y.data.tolist()
        else:
            np.testing.assert_allclose(x.data, y.data, rtol=1e-5, atol=1e-6)


def _same_error(a: Any, b: Any) -> None:
    assert isinstance(a, FrontendError) and isinstance(b, FrontendError), (a, b)
    assert (type(a), a.grpc_code, a.http_status, a.message) == (
        type(b),
        b.grpc_code,
        b.http_status,
        b.message,
    )


async def test_embeddings_are_the_same_both_ways(both: Any) -> None:
    ids = np.random.default_rng(0).integers(0, 4000, (3, 64), dtype=np.int32)
    inputs = [Tensor("INPUT_IDS", "INT32", ids.shape, ids)]
    a, b = await _both_ways(both, "embed", "", inputs, None, {"fair_rows": _rows(3)})
    _same_outputs(a, b)
    assert a[1][0].shape == (3, 128)


async def test_named_outputs_a_version_and_sequence_parameters(both: Any) -> None:
    x = np.arange(32, dtype=np.int32).reshape(2, 16)
    inputs = [Tensor("INPUT0", "INT32", x.shape, x), Tensor("INPUT1", "INT32", x.shape, x)]
    a, b = await _both_ways(
        both, "simple", "1", inputs, [RequestedOutput("OUTPUT1")], {"fair_rows": _rows(2)}
    )
    _same_outputs(a, b)
    assert [t.name for t in a[1]] == ["OUTPUT1"]


async def test_bytes_and_classification(both: Any) -> None:
    words = np.array([[b"ab", b"", "\u00e9".encode()]], dtype=object)
    inputs = [Tensor("INPUT0", "BYTES", words.shape, words)]
    a, b = await _both_ways(both, "simple_identity", "", inputs, None, {"fair_rows": _rows(1)})
    _same_outputs(a, b)
    assert a[1][0].data.tolist() == words.tolist()
    x = np.arange(32, dtype=np.int32).reshape(2, 16)
    inputs = [Tensor("INPUT0", "INT32", x.shape, x), Tensor("INPUT1", "INT32", x.shape, x)]
    top = [RequestedOutput("OUTPUT0", classification=3)]
    a, b = await _both_ways(both, "simple", "", inputs, top, {"fair_rows": _rows(2)})
    _same_outputs(a, b)
    assert a[1][0].datatype == "BYTES" and a[1][0].shape == (2, 3)


@pytest.mark.parametrize(
    ("model", "version", "datatype"),
    [
        ("raiser", "", "INT32"),  # the model raises on 13: INTERNAL / 500
        ("raiser", "", "INT64"),  # Triton's own check: INVALID_ARGUMENT / 400
        ("raiser", "7", "INT32"),  # a version that is not there
        ("no_such_model", "", "INT32"),  # the frontend's one answer: INVALID_ARGUMENT / 400
    ],
)
async def test_errors_are_the_same_both_ways(
    both: Any, model: str, version: str, datatype: str
) -> None:
    x = np.array([[13, 1]], dtype=np.int64 if datatype == "INT64" else np.int32)
    inputs = [Tensor("X", datatype, x.shape, x)]
    a, b = await _both_ways(both, model, version, inputs, None, {"fair_rows": _rows(1)})
    _same_error(a, b)


async def test_a_parameter_json_cannot_carry_goes_over_grpc(both: Any) -> None:
    """Triton's JSON reader stops at a NUL: such a request is not sent over HTTP."""
    x = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [Tensor("INPUT0", "INT32", x.shape, x), Tensor("INPUT1", "INT32", x.shape, x)]
    params = {"fair_rows": _rows(1), "odd\x00name": "value\x00"}
    a, b = await _both_ways(both, "simple", "", inputs, None, params)
    _same_outputs(a, b)


async def test_an_unreachable_triton_is_unavailable_and_never_sent() -> None:
    nowhere = f"127.0.0.1:{free_port()}"
    fwd = TritonForwarder(nowhere, http_url=f"http://{nowhere}", request_timeout_s=5)
    try:
        x = np.ones((1, 4), dtype=np.int32)
        with pytest.raises(Unavailable) as info:
            await fwd.infer(Batch("embed", "", [Tensor("INPUT_IDS", "INT32", x.shape, x)]))
        assert info.value.never_sent  # held for Triton's return, not failed
    finally:
        await fwd.close()


async def test_a_connection_lost_mid_call_is_unavailable_and_not_sent_again() -> None:
    """Sent, then the connection closes before an answer: it may have run, so it is
    answered UNAVAILABLE and never retried."""
    received: list[bytes] = []

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.append(await reader.read(65536))
        writer.close()

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    fwd = TritonForwarder(f"127.0.0.1:{port}", http_url=f"http://127.0.0.1:{port}")
    try:
        x = np.ones((1, 4), dtype=np.int32)
        with pytest.raises(Unavailable) as info:
            await fwd.infer(Batch("embed", "", [Tensor("INPUT_IDS", "INT32", x.shape, x)]))
        assert not info.value.never_sent
        assert len(received) == 1 and received[0].startswith(b"POST /v2/models/embed/infer")
    finally:
        await fwd.close()
        server.close()
        await server.wait_closed()


class _OneReply(service_pb2_grpc.GRPCInferenceServiceServicer):
    """A stand-in Triton that answers every streamed request with one final response."""

    async def ModelStreamInfer(self, requests: Any, context: Any) -> Any:
        async for request in requests:
            reply = service_pb2.ModelStreamInferResponse()
            reply.infer_response.model_name = request.model_name
            reply.infer_response.id = request.id
            reply.infer_response.parameters["triton_final_response"].bool_param = True
            yield reply


async def _replies(stream: Any) -> list[Any]:
    out = []
    async for reply in stream:
        out.append(reply)
    return out


async def test_a_stream_that_never_reached_triton_is_made_again_once_it_is_up() -> None:
    """The core grants a stream on a Triton it saw come back a moment ago, while this
    shell's channel to it still backs off: the call fails at once without reaching it,
    and is made again, waiting for the channel, rather than failing the client."""
    port = free_port()
    fwd = TritonForwarder(f"127.0.0.1:{port}")
    server = grpc.aio.server()
    try:
        stream = fwd.stream(Batch("repeat", "", []))
        with pytest.raises(grpc.aio.AioRpcError):  # the first try: nothing listens yet
            await stream._call.wait_for_connection()
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(_OneReply(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        replies = await asyncio.wait_for(_replies(stream), 10)
        assert [r.final for r in replies] == [True] and replies[0].error is None
    finally:
        await fwd.close()
        await server.stop(None)


async def test_a_stream_whose_triton_stays_down_fails_unavailable_never_sent() -> None:
    fwd = TritonForwarder(f"127.0.0.1:{free_port()}")
    try:
        replies = await asyncio.wait_for(_replies(fwd.stream(Batch("repeat", "", []))), 10)
        (reply,) = replies
        assert isinstance(reply.error, Unavailable) and reply.error.never_sent
    finally:
        await fwd.close()


class _Held(service_pb2_grpc.GRPCInferenceServiceServicer):
    """A stand-in Triton that sends one response (the last, where ``final``), then holds
    the call open until ``release`` is set, as Triton does while it finishes a request."""

    def __init__(self, final: bool) -> None:
        self.final = final
        self.release = asyncio.Event()

    async def ModelStreamInfer(self, requests: Any, context: Any) -> Any:
        async for request in requests:
            reply = service_pb2.ModelStreamInferResponse()
            reply.infer_response.model_name = request.model_name
            reply.infer_response.parameters["triton_final_response"].bool_param = self.final
            yield reply
        await self.release.wait()


@pytest.mark.parametrize("final", [True, False], ids=["finished", "unfinished"])
async def test_a_stream_is_cancelled_in_triton_only_before_its_last_response(final: bool) -> None:
    """Once its last response has come, a stream's call is left to end as Triton ends it:
    cancelled while Triton finishes the request, Triton 2.51 never releases its trace (the
    request's root span is never exported). One that has not finished is cancelled at once.
    A stand-in Triton, since the real one's window between the two is too short to hit."""
    port = free_port()
    held = _Held(final)
    server = grpc.aio.server()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(held, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    fwd = TritonForwarder(f"127.0.0.1:{port}")
    try:
        stream = fwd.stream(Batch("llm", "", []))
        reply = await asyncio.wait_for(anext(aiter(stream)), 10)
        assert reply.final is final and reply.error is None
        await stream.aclose()  # the relay's way out, whichever way it leaves
        call = stream._call
        if final:
            assert not call.done() and call in forwarder_calls  # open, held, not cancelled
            held.release.set()
            assert await asyncio.wait_for(call.code(), 10) == grpc.StatusCode.OK
            assert call not in forwarder_calls  # nothing holds it after its end
        else:  # cancelled at once (Triton stops generating for nobody)
            assert call.done() and await call.code() == grpc.StatusCode.CANCELLED
    finally:
        held.release.set()
        await fwd.close()
        await server.stop(None)
