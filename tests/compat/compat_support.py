"""Helpers of the drop-in compatibility suite: the same request, to Triton and through us.

Each test sends one request twice, once straight to the session's Triton and once through
the session's frontend with a tenant key, and compares what comes back. The helpers here
only speak the wire: raw HTTP (``http.client``, so that malformed bodies and lying headers
reach the server as written) and the generated gRPC stub (so that any ``ModelInferRequest``
can be sent, however wrong).
"""

from __future__ import annotations

import gzip
import http.client
import json
import struct
import zlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tests.support import KEYS

TENANT = "acme"
KEY_HEADER = {"authorization": f"Bearer {KEYS[TENANT]}"}
KEY_METADATA = (("authorization", f"Bearer {KEYS[TENANT]}"),)
HEADER_LENGTH = "Inference-Header-Content-Length"

# The models every compatibility test knows about (model_repository/ and tests/model_repository/).
SIMPLE_VALUES = np.arange(16, dtype=np.int32)


@dataclass(frozen=True)
class HttpAnswer:
    status: int
    headers: Mapping[str, str]
    body: bytes

    @property
    def error(self) -> str:
        """The ``{"error": ...}`` message ('' when the body is not Triton's error form)."""
        try:
            doc = json.loads(self.body)
        except ValueError:
            return ""
        return str(doc.get("error", "")) if isinstance(doc, dict) else ""

    def json(self) -> Any:
        """The JSON part of an infer response (binary tensors after it ignored)."""
        length = self.headers.get(HEADER_LENGTH.lower())
        body = self.body if length is None else self.body[: int(length)]
        return json.loads(body)


def http_request(
    host_port: str,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: Mapping[str, str] | None = None,
    timeout: float = 30.0,
) -> HttpAnswer:
    """One raw HTTP request; the body and headers go out exactly as given."""
    host, port = host_port.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=dict(headers or {}))
        response = conn.getresponse()
        data = response.read()
        return HttpAnswer(response.status, {k.lower(): v for k, v in response.getheaders()}, data)
    finally:
        conn.close()


def decompress(body: bytes, encoding: str | None) -> bytes:
    if encoding == "gzip":
        return gzip.decompress(body)
    if encoding == "deflate":
        return zlib.decompress(body)
    return body


@dataclass(frozen=True)
class GrpcAnswer:
    code: grpc.StatusCode
    details: str
    response: Any = None


@contextmanager
def grpc_stub(url: str) -> Iterator[service_pb2_grpc.GRPCInferenceServiceStub]:
    channel = grpc.insecure_channel(url)
    try:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)
    finally:
        channel.close()


def grpc_call(
    stub: service_pb2_grpc.GRPCInferenceServiceStub,
    request: Any,
    method: str = "ModelInfer",
    metadata: Sequence[tuple[str, str]] = (),
    timeout: float = 30.0,
) -> GrpcAnswer:
    try:
        response = getattr(stub, method)(request, metadata=metadata, timeout=timeout)
    except grpc.RpcError as err:
        return GrpcAnswer(err.code(), err.details() or "")
    return GrpcAnswer(grpc.StatusCode.OK, "", response)


# ---- request builders ---------------------------------------------------------------------


def bytes_elements(*items: bytes) -> bytes:
    """Triton's BYTES wire form: a 4-byte little-endian length before each element."""
    return b"".join(struct.pack("<I", len(b)) + b for b in items)


@dataclass
class HttpInfer:
    """An HTTP infer request as it goes on the wire (JSON, then any binary tensors)."""

    model: str
    doc: dict[str, Any]
    binary: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    raw_json: bytes | None = None  # sent instead of ``doc`` (malformed JSON)

    @property
    def path(self) -> str:
        return f"/v2/models/{self.model}/infer"

    def body(self) -> bytes:
        head = self.raw_json if self.raw_json is not None else json.dumps(self.doc).encode()
        return head + self.binary

    def wire_headers(self) -> dict[str, str]:
        out = {"Content-Type": "application/json"}
        if self.binary and HEADER_LENGTH not in self.headers:
            head = self.raw_json if self.raw_json is not None else json.dumps(self.doc).encode()
            out[HEADER_LENGTH] = str(len(head))
        out.update(self.headers)
        return out


def simple_http(rows: int = 1, *, binary: bool = False) -> HttpInfer:
    """`simple`: INPUT0 = 0..15 and INPUT1 = 1 per row, JSON or binary tensors."""
    a = np.tile(SIMPLE_VALUES, (rows, 1))
    b = np.ones((rows, 16), dtype=np.int32)
    if not binary:
        doc = {
            "inputs": [
                {"name": "INPUT0", "shape": [rows, 16], "datatype": "INT32", "data": a.tolist()},
                {"name": "INPUT1", "shape": [rows, 16], "datatype": "INT32", "data": b.tolist()},
            ]
        }
        return HttpInfer("simple", doc)
    doc = {
        "inputs": [
            {
                "name": name,
                "shape": [rows, 16],
                "datatype": "INT32",
                "parameters": {"binary_data_size": arr.nbytes},
            }
            for name, arr in (("INPUT0", a), ("INPUT1", b))
        ]
    }
    return HttpInfer("simple", doc, a.tobytes() + b.tobytes())


def simple_grpc(rows: int = 1, model: str = "simple") -> service_pb2.ModelInferRequest:
    """`simple` (or `simple_nobatch` with ``rows=0``: no batch dimension) as raw contents."""
    shape = [16] if rows == 0 else [rows, 16]
    msg = service_pb2.ModelInferRequest(model_name=model)
    for name, arr in (
        ("INPUT0", np.tile(SIMPLE_VALUES, (max(rows, 1), 1))),
        ("INPUT1", np.ones((max(rows, 1), 16), dtype=np.int32)),
    ):
        msg.inputs.add(name=name, datatype="INT32", shape=shape)
        msg.raw_input_contents.append(arr.tobytes())
    return msg


def identity_grpc(payload: bytes, count: int) -> service_pb2.ModelInferRequest:
    msg = service_pb2.ModelInferRequest(model_name="simple_identity")
    msg.inputs.add(name="INPUT0", datatype="BYTES", shape=[1, count])
    msg.raw_input_contents.append(payload)
    return msg


def ids_grpc(model: str, ids: np.ndarray) -> service_pb2.ModelInferRequest:
    msg = service_pb2.ModelInferRequest(model_name=model)
    msg.inputs.add(name="INPUT_IDS", datatype="INT32", shape=list(ids.shape))
    msg.raw_input_contents.append(np.ascontiguousarray(ids, dtype=np.int32).tobytes())
    return msg


def simple_still_served_http(url: str) -> None:
    """A normal request succeeds with the right answer (the server kept serving)."""
    answer = http_request(url, "POST", "/v2/models/simple/infer", simple_http().body(), KEY_HEADER)
    assert answer.status == 200, answer
    out = {o["name"]: o["data"] for o in answer.json()["outputs"]}
    assert out["OUTPUT0"] == (SIMPLE_VALUES + 1).tolist()


def simple_still_served_grpc(url: str) -> None:
    with grpc_stub(url) as stub:
        answer = grpc_call(stub, simple_grpc(), metadata=KEY_METADATA)
    assert answer.code == grpc.StatusCode.OK, answer
    sums = np.frombuffer(answer.response.raw_output_contents[0], dtype=np.int32)
    assert sums.tolist() == (SIMPLE_VALUES + 1).tolist()
