"""Triton's own HTTP QA tests, side by side: what ``qa/L0_http`` and ``qa/L0_string_io`` send,
to Triton and through the frontend (with the tenant's key and nothing else changed).

- Raw binary requests (``qa/L0_http/http_test.py``: ``test_raw_binary``,
  ``test_byte_too_many_elements``, ``test_multi_inputs``,
  ``test_content_encoding_chunked_manually``...): ``Inference-Header-Content-Length: 0`` and
  the whole body as the model's one input. The answer's bytes must be Triton's, errors
  included (the QA tests match on the text).
- BYTES outputs asked for as JSON: Triton writes each element's bytes into the JSON string
  unchanged, valid UTF-8 or not (``qa/L0_string_io``); the frontend's body must be Triton's,
  byte for byte.
- Wording: a ``triton_`` request parameter gets Triton's own refusal, over HTTP and gRPC.
"""

from __future__ import annotations

import gzip
import json
from typing import Any

import grpc
import numpy as np
import pytest
from compat_support import (
    HEADER_LENGTH,
    KEY_HEADER,
    KEY_METADATA,
    HttpAnswer,
    bytes_elements,
    grpc_call,
    grpc_stub,
    http_request,
    simple_grpc,
    simple_http,
)
from tritonclient.grpc import service_pb2

from fair_frontend.backends.triton.embedded import EmbeddedTriton
from fair_frontend.errors import InvalidArgument
from fair_frontend.models import ModelInfo, TensorSpec
from fair_frontend.shell.http_codec import decode_raw_infer, json_string_bytes
from tests.support import RunningFrontend

RAW = {HEADER_LENGTH: "0"}


def both(
    triton: EmbeddedTriton,
    frontend: RunningFrontend,
    model: str,
    body: bytes,
    headers: dict[str, str],
) -> tuple[HttpAnswer, HttpAnswer]:
    """The same infer request, straight to Triton and through the frontend."""
    path = f"/v2/models/{model}/infer"
    direct = http_request(triton.http_url, "POST", path, body, headers)
    through = http_request(frontend.http_url, "POST", path, body, {**headers, **KEY_HEADER})
    return direct, through


def assert_same_answer(direct: HttpAnswer, through: HttpAnswer) -> None:
    """Status, header length and body identical (byte for byte)."""
    assert through.status == direct.status, (direct, through)
    assert through.headers.get(HEADER_LENGTH.lower()) == direct.headers.get(
        HEADER_LENGTH.lower()
    ), (direct.headers, through.headers)
    assert through.body == direct.body, (direct.body, through.body)


def binary_tail(answer: HttpAnswer) -> bytes:
    return answer.body[int(answer.headers[HEADER_LENGTH.lower()]) :]


# ---- raw binary requests (qa/L0_http/http_test.py) ------------------------------------------


@pytest.mark.parametrize("count", [8, 32], ids=["raw_binary", "raw_binary_longer"])
def test_raw_binary(triton: EmbeddedTriton, frontend: RunningFrontend, count: int) -> None:
    """``raiser`` (one INT32 input, dims [-1], batching): the body is input X of shape
    [1, count]; the output comes back binary, equal to the input, as from Triton."""
    values = np.arange(100, 100 + count, dtype=np.int32)  # raiser refuses 13
    direct, through = both(triton, frontend, "raiser", values.tobytes(), RAW)
    assert direct.status == 200, direct
    assert_same_answer(direct, through)
    assert binary_tail(through) == values.tobytes()
    assert through.json()["outputs"][0]["shape"] == [1, count]


def test_raw_binary_chunked(triton: EmbeddedTriton, frontend: RunningFrontend) -> None:
    """``test_content_encoding_chunked_manually``: the raw body chunk-encoded by the caller."""
    values = np.arange(8, dtype=np.int32).tobytes()
    chunked = f"{len(values):X}\r\n".encode() + values + b"\r\n0\r\n\r\n"
    headers = {**RAW, "Transfer-Encoding": "chunked"}
    direct, through = both(triton, frontend, "raiser", chunked, headers)
    assert direct.status == 200, direct
    assert_same_answer(direct, through)
    assert binary_tail(through) == values


def test_raw_binary_gzip(triton: EmbeddedTriton, frontend: RunningFrontend) -> None:
    """A compressed raw body is the input once inflated (Triton decompresses first)."""
    values = np.arange(12, dtype=np.int32).tobytes()
    headers = {**RAW, "Content-Encoding": "gzip"}
    direct, through = both(triton, frontend, "raiser", gzip.compress(values), headers)
    assert direct.status == 200, direct
    assert_same_answer(direct, through)


def test_raw_binary_empty_body_without_header(
    triton: EmbeddedTriton, frontend: RunningFrontend
) -> None:
    """No header and no body: Triton takes the body's length (0) as the header length, so
    the request is raw, with an empty input ([1, 0])."""
    direct, through = both(triton, frontend, "raiser", b"", {})
    assert direct.status == 200, direct
    assert_same_answer(direct, through)


@pytest.mark.parametrize(
    ("model", "body", "says"),
    [
        # test_multi_inputs
        ("simple", np.arange(32, dtype=np.int32).tobytes(), "Raw request must only have 1 input"),
        # test_byte_too_many_elements: BYTES with a variable-sized dimension
        ("simple_identity", b"427", "For BYTE datatype raw input 'INPUT0'"),
        # 9 bytes: Triton rounds the deduced shape down to [1, 2], then 8 != 9
        ("raiser", b"\x01" * 9, "input byte size mismatch"),
        # the empty body, no header, to a model of two inputs
        ("simple", b"", "Raw request must only have 1 input"),
    ],
    ids=["multi-inputs", "bytes-variable-shape", "byte-size-mismatch", "empty-two-inputs"],
)
def test_raw_binary_refused_as_triton(
    triton: EmbeddedTriton, frontend: RunningFrontend, model: str, body: bytes, says: str
) -> None:
    """Triton's status and error text, exactly: its QA tests match on the text."""
    headers = RAW if body else {}
    direct, through = both(triton, frontend, model, body, headers)
    assert direct.status == 400 and says in direct.error, direct
    assert (through.status, through.error) == (direct.status, direct.error)


def _info(dims: tuple[int, ...], datatype: str = "FP32", batch: int = 8) -> ModelInfo:
    spec = TensorSpec("INPUT0", datatype, dims)
    return ModelInfo("m", batch, {"INPUT0": spec}, {"OUTPUT0": spec})


def test_raw_binary_deduction_rules() -> None:
    """Triton core's rules (``InferenceRequest::Normalize``) where no test model has the
    shape: two variable-sized dimensions (``test_multi_variable_dimensions``), a BYTES
    input of one element (``test_byte``: the body is that element), no batch dimension."""
    body = np.ones(4, dtype=np.float16).tobytes()
    with pytest.raises(InvalidArgument) as err:
        decode_raw_infer("m", "", body, _info((-1, -1), "FP16"))
    assert err.value.message == (
        "[request id: <id_unknown>] The shape of the raw input 'INPUT0' can not be deduced "
        "because there are more than one variable-sized dimension"
    )
    req = decode_raw_infer("m", "", b"427", _info((1,), "BYTES"))
    (tensor,) = req.inputs
    assert (tensor.shape, tensor.data.tolist(), req.binary_output) == ((1, 1), [[b"427"]], True)
    req = decode_raw_infer("m", "", np.arange(6, dtype="<f4").tobytes(), _info((2, -1), batch=0))
    assert req.inputs[0].shape == (2, 3)
    assert req.inputs[0].data.tolist() == [[0, 1, 2], [3, 4, 5]]


# ---- BYTES outputs as JSON (qa/L0_string_io) ----------------------------------------------

ELEMENTS = [
    b"\xff\xfe",  # not UTF-8 at all
    b"caf\xc3\xa9",  # UTF-8, not ASCII
    b"\xe2\x82",  # UTF-8 cut short
    b'q"b\\s/',  # what JSON escapes, and '/' that it may
    b"\x00\x01\x08\t\n\x0c\r\x1f\x7f",  # control characters, DEL
    b"",
]


def _identity_json_output(elements: list[bytes]) -> tuple[bytes, dict[str, str]]:
    doc: dict[str, Any] = {
        "inputs": [
            {
                "name": "INPUT0",
                "shape": [1, len(elements)],
                "datatype": "BYTES",
                "parameters": {"binary_data_size": len(bytes_elements(*elements))},
            }
        ],
        "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": False}}],
    }
    head = json.dumps(doc).encode()
    return head + bytes_elements(*elements), {HEADER_LENGTH: str(len(head))}


def test_bytes_output_as_json_is_tritons_byte_for_byte(
    triton: EmbeddedTriton, frontend: RunningFrontend
) -> None:
    """Non-UTF-8 bytes come back as they left the model, not as U+FFFD: the whole body is
    Triton's, byte for byte."""
    body, headers = _identity_json_output(ELEMENTS)
    direct, through = both(triton, frontend, "simple_identity", body, headers)
    assert direct.status == 200, direct
    assert b'"\xff\xfe"' in direct.body  # the premise: Triton writes the raw bytes
    assert_same_answer(direct, through)


def test_json_string_bytes_escapes_as_rapidjson() -> None:
    """Each byte either as is or escaped as rapidjson escapes it (upper-case hex)."""
    assert json_string_bytes(b'\xff\x1f\x7f"\\\n') == b'"\xff\\u001F\x7f\\"\\\\\\n"'


# ---- wording: triton_ parameters ----------------------------------------------------------


def test_http_triton_parameter_refused_in_tritons_words(
    triton: EmbeddedTriton, frontend: RunningFrontend
) -> None:
    """Over HTTP every ``triton_`` name is refused, the one Triton knows over gRPC too."""
    for name in ("triton_x", "triton_enable_empty_final_response"):
        req = simple_http()
        req.doc["parameters"] = {name: True}
        direct, through = both(triton, frontend, "simple", req.body(), req.wire_headers())
        assert direct.status == 400 and "reserved for Triton" in direct.error, direct
        assert (through.status, through.error) == (direct.status, direct.error)


def test_grpc_triton_parameter_refused_in_tritons_words(
    triton: EmbeddedTriton, frontend: RunningFrontend
) -> None:
    msg = simple_grpc()
    msg.parameters["triton_x"].MergeFrom(service_pb2.InferParameter(string_param="x"))
    with grpc_stub(triton.grpc_url) as stub:
        direct = grpc_call(stub, msg)
    with grpc_stub(frontend.grpc_url) as stub:
        through = grpc_call(stub, msg, metadata=KEY_METADATA)
    assert "reserved for Triton" in direct.details, direct
    assert (through.code, through.details) == (direct.code, direct.details)


# ---- wording: shapes and sizes ------------------------------------------------------------


def _http_simple_wrong_shape() -> tuple[bytes, dict[str, str]]:
    req = simple_http()
    req.doc["inputs"][0]["shape"], req.doc["inputs"][0]["data"] = [1, 8], list(range(8))
    return req.body(), req.wire_headers()


def _http_simple_short_binary() -> tuple[bytes, dict[str, str]]:
    """INPUT0 binary, 4 bytes short of its shape; INPUT1 right (as JSON), so that only
    INPUT0 is wrong."""
    req = simple_http()
    data = np.arange(15, dtype=np.int32).tobytes()
    req.doc["inputs"][0] = {
        "name": "INPUT0",
        "shape": [1, 16],
        "datatype": "INT32",
        "parameters": {"binary_data_size": len(data)},
    }
    req.binary = data
    return req.body(), req.wire_headers()


@pytest.mark.parametrize(
    "build",
    [_http_simple_wrong_shape, _http_simple_short_binary],
    ids=["unexpected-shape", "byte-size-mismatch"],
)
def test_http_shape_errors_in_tritons_words(
    triton: EmbeddedTriton, frontend: RunningFrontend, build: Any
) -> None:
    body, headers = build()
    direct, through = both(triton, frontend, "simple", body, headers)
    assert direct.status == 400, direct
    assert (through.status, through.error) == (direct.status, direct.error)


def _grpc_wrong_shape(msg: service_pb2.ModelInferRequest) -> None:
    msg.inputs[0].shape[:] = [1, 8]
    msg.raw_input_contents[0] = msg.raw_input_contents[0][:32]


def _grpc_short_raw(msg: service_pb2.ModelInferRequest) -> None:
    msg.raw_input_contents[0] = msg.raw_input_contents[0][:60]


@pytest.mark.parametrize(
    ("model", "edit"),
    [
        ("simple", _grpc_wrong_shape),
        ("simple_nobatch", _grpc_wrong_shape),  # no batch dimension: no NOTE
        ("simple", _grpc_short_raw),
    ],
    ids=["unexpected-shape", "unexpected-shape-nobatch", "byte-size-mismatch"],
)
def test_grpc_shape_errors_in_tritons_words(
    triton: EmbeddedTriton, frontend: RunningFrontend, model: str, edit: Any
) -> None:
    msg = simple_grpc(0 if model == "simple_nobatch" else 1, model)
    edit(msg)
    with grpc_stub(triton.grpc_url) as stub:
        direct = grpc_call(stub, msg)
    with grpc_stub(frontend.grpc_url) as stub:
        through = grpc_call(stub, msg, metadata=KEY_METADATA)
    assert direct.code == grpc.StatusCode.INVALID_ARGUMENT, direct
    assert (through.code, through.details) == (direct.code, direct.details)


def test_nan_and_infinity_in_json_as_triton_takes_them(
    triton: EmbeddedTriton, frontend: RunningFrontend
) -> None:
    """Not JSON, but Triton's parser takes NaN, Infinity, -Infinity: so does the frontend,
    the answer byte for byte Triton's."""
    doc = b'{"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1], "data": [%s]}]}'
    for value in (b"NaN", b"Infinity", b"-Infinity"):
        body = doc % value
        direct, through = both(triton, frontend, "identity", body, {})
        assert direct.status == 200, direct
        assert (through.status, through.body) == (direct.status, direct.body)
