"""Batches to Triton over its HTTP endpoint: KServe v2 with binary tensors, on the loop's own
transports.

Why not gRPC for this one call: a unary gRPC call costs this Python process about 400 us
of CPU (grpc.aio's completion-queue thread, its wake-ups of the loop, the call objects),
an HTTP/1.1 request on a kept-alive connection about 150 us (measured against the same
Triton, the same batch). The core sends one call per batch, so this is the core's largest
cost per batch after the model's own answer. Everything else that goes to Triton
(metadata, configs, readiness, decoupled streams) stays on gRPC (``TritonForwarder``).

The wire: ``POST /v2/models/<m>[/versions/<v>]/infer`` with a JSON header (inputs with
``binary_data_size``, outputs asking for ``binary_data``, the request parameters) and the
raw tensors after it (``Inference-Header-Content-Length``); the answer likewise. Triton
answers errors as ``{"error": ...}`` with the status its HTTP server maps from the same
error its gRPC server would send: the message is the same, and the status maps back to
that gRPC code (``_GRPC_CODE``), so clients of the frontend see what they saw before.

Connections: a small pool of kept-alive connections, one request at a time on each (the
core has only a few batches in Triton at once); one the server closed while idle is not
used again. A request whose connection fails after it was written is answered UNAVAILABLE
and never sent again (it may have run: as a gRPC call that fails mid-way), one that could
not connect is held for Triton's return (``Unavailable.never_sent``).

Requests HTTP's JSON header cannot carry faithfully (a NUL character in a parameter's name
or value, or in the request id: Triton's JSON reader stops there) go over gRPC instead
(``carries``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar
from urllib.parse import quote, urlsplit

import grpc
from tritonclient.utils import InferenceServerException

from fair_frontend.backends.triton.upstream import upstream_error
from fair_frontend.errors import DeadlineExceeded, FrontendError, Unavailable
from fair_frontend.protocol import (
    Batch,
    ParamValue,
    Tensor,
    tensor_from_list,
    tensor_from_raw,
    tensor_to_raw,
)

log = logging.getLogger(__name__)
P = TypeVar("P", bound=asyncio.Protocol)

HEADER_LENGTH = "inference-header-content-length"
MAX_IDLE_CONNECTIONS = 16

# Triton's HTTP status for each of its error codes (HttpCodeFromError), read backwards.
_GRPC_CODE = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    500: grpc.StatusCode.INTERNAL,
    501: grpc.StatusCode.UNIMPLEMENTED,
    503: grpc.StatusCode.UNAVAILABLE,
}


class _Dropped(Exception):
    """The connection ended before a whole answer came."""


class _Connection(asyncio.Protocol):
    """One kept-alive HTTP/1.1 connection: one request, then its answer, at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._answer: asyncio.Future[tuple[int, dict[str, str], bytes]] | None = None
        # The answer's status, headers, and where its body starts and ends in the buffer.
        self._head: tuple[int, dict[str, str], int, int] | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        answer = self._answer
        if answer is None or answer.done():
            return
        buf = self._buffer
        if self._head is None:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            if "chunked" in headers.get("transfer-encoding", ""):
                answer.set_exception(RuntimeError("Triton answered with a chunked body"))
                return
            status = int(lines[0].split(" ", 2)[1])
            start = end + 4
            self._head = (status, headers, start, start + int(headers.get("content-length", "0")))
        status, headers, start, total = self._head
        if len(buf) < total:
            return
        body = bytes(buf[start:total])
        del buf[:total]
        self._head = None
        answer.set_result((status, headers, body))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        answer = self._answer
        if answer is not None and not answer.done():
            answer.set_exception(_Dropped())

    async def request(self, data: bytes) -> tuple[int, dict[str, str], bytes]:
        if self.closed or self.transport is None or self.transport.is_closing():
            raise _Dropped()
        self._buffer.clear()
        self._head = None
        self._answer = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return await self._answer

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()


def address(url: str) -> tuple[str, int]:
    """(host, port) of Triton's HTTP endpoint, given as ``host:port`` or ``http://host:port``."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.hostname is None or parts.port is None:
        raise ValueError(f"Triton's HTTP address must be host:port, got {url!r}")
    return parts.hostname, parts.port


async def dial(factory: Callable[[], P], host: str, port: int) -> P:
    """A new connection's protocol; ``Unavailable(never_sent=True)`` where none was made."""
    loop = asyncio.get_running_loop()
    try:
        _, conn = await loop.create_connection(factory, host, port)
    except OSError as err:
        raise Unavailable(
            f"Triton is unavailable: failed to connect to {host}:{port}: {err.strerror or err}",
            never_sent=True,
        ) from None
    return conn


class TritonHttp:
    """``infer`` over Triton's HTTP endpoint (``http://host:port``)."""

    def __init__(self, url: str, *, request_timeout_s: float = 60.0) -> None:
        self.host, self.port = address(url)
        self.request_timeout_s = request_timeout_s
        self._idle: list[_Connection] = []

    async def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()

    async def _connect(self) -> _Connection:
        return await dial(_Connection, self.host, self.port)

    async def infer(self, batch: Batch) -> tuple[str, list[Tensor]]:
        """One inference request; returns (the model version that ran, its outputs);
        ``batch.traceparent``: the W3C trace context Triton's spans join."""
        data = encode_request(batch)
        try:
            # asyncio.timeout, not wait_for: no task of its own per call (wait_for's costs
            # a task and a loop iteration at each end, on every batch's path).
            async with asyncio.timeout(self.request_timeout_s):
                status, headers, body = await self._send(data)
        except TimeoutError:
            raise DeadlineExceeded("Triton is unavailable: Deadline Exceeded") from None
        if status != 200:
            raise error_of(status, body)
        return decode_answer(headers, body)

    async def _send(self, data: bytes) -> tuple[int, dict[str, str], bytes]:
        while self._idle and self._idle[-1].closed:
            self._idle.pop()  # closed by the server while idle
        conn = self._idle.pop() if self._idle else await self._connect()
        try:
            answer = await conn.request(data)
        except _Dropped:
            conn.close()
            raise Unavailable(
                "Triton is unavailable: the connection closed before the answer",
                never_sent=False,
            ) from None
        except BaseException:
            conn.close()  # cancelled or failed mid-request: the connection is unusable
            raise
        if answer[1].get("connection", "").lower() == "close" or conn.closed:
            conn.close()
        elif len(self._idle) < MAX_IDLE_CONNECTIONS:
            self._idle.append(conn)
        else:
            conn.close()
        return answer


def carries(parameters: Mapping[str, ParamValue], request_id: str) -> bool:
    """Whether the JSON header carries these exactly (no NUL in a name, value or the id)."""
    if "\x00" in request_id:
        return False
    return not any(
        "\x00" in k or (isinstance(v, str) and "\x00" in v) for k, v in parameters.items()
    )


def encode_request(batch: Batch) -> bytes:
    """The HTTP request: head, JSON header, raw input tensors."""
    inputs, outputs, model, version = batch.inputs, batch.outputs, batch.model, batch.version
    request_id, traceparent = batch.request_id, batch.traceparent
    raws = [tensor_to_raw(t) for t in inputs]
    doc: dict[str, Any] = {
        "inputs": [
            {
                "name": t.name,
                "shape": list(t.shape),
                "datatype": t.datatype,
                "parameters": {"binary_data_size": len(raw)},
            }
            for t, raw in zip(inputs, raws, strict=True)
        ]
    }
    if request_id:
        doc["id"] = request_id
    params: dict[str, Any] = batch.all_parameters()
    if outputs:
        doc["outputs"] = [
            {
                "name": o.name,
                "parameters": {
                    "binary_data": True,
                    **({"classification": o.classification} if o.classification else {}),
                },
            }
            for o in outputs
        ]
    else:
        params["binary_data_output"] = True
    doc["parameters"] = params
    header = json.dumps(doc, separators=(",", ":")).encode()
    path = f"/v2/models/{quote(model, safe='')}"
    if version:
        path += f"/versions/{quote(version, safe='')}"
    size = len(header) + sum(len(r) for r in raws)
    trace_head = f"traceparent: {traceparent}\r\n" if traceparent else ""
    head = (
        f"POST {path}/infer HTTP/1.1\r\nHost: triton\r\n"
        f"Content-Type: application/octet-stream\r\n"
        f"{trace_head}"
        f"Inference-Header-Content-Length: {len(header)}\r\nContent-Length: {size}\r\n\r\n"
    ).encode()
    return b"".join((head, header, *raws))


def decode_answer(headers: Mapping[str, str], body: bytes) -> tuple[str, list[Tensor]]:
    """(model version, outputs) of a 200 answer with binary outputs."""
    length = int(headers.get(HEADER_LENGTH, len(body)))
    doc = json.loads(body[:length])
    view = memoryview(body)
    offset = length
    out = []
    for spec in doc.get("outputs", ()):
        shape = tuple(spec["shape"])
        size = (spec.get("parameters") or {}).get("binary_data_size")
        if size is None:  # JSON data (Triton sends binary when asked; kept for safety)
            out.append(tensor_from_list(spec["name"], spec["datatype"], shape, spec["data"]))
            continue
        raw = view[offset : offset + size]
        offset += size
        out.append(tensor_from_raw(spec["name"], spec["datatype"], shape, raw))
    return str(doc.get("model_version", "")), out


def error_of(status: int, body: bytes) -> FrontendError:
    """Triton's error answer, as the gRPC forwarder would have raised it."""
    message = body.decode("utf-8", errors="replace")
    with contextlib.suppress(ValueError, AttributeError):
        message = str(json.loads(body)["error"])
    code = _GRPC_CODE.get(status, grpc.StatusCode.UNKNOWN)
    return upstream_error(InferenceServerException(message, str(code)))
