"""The KServe v2 codecs against tritonclient's own request builders and response parsers."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2
from tritonclient.grpc._utils import _get_inference_request
from tritonclient.utils import np_to_triton_dtype

from fair_frontend import grpc_codec, http_codec
from fair_frontend.errors import InvalidArgument
from fair_frontend.protocol import InferResponse, Tensor

ARRAYS = {
    "I32": np.arange(12, dtype=np.int32).reshape(3, 4),
    "F32": np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3),
    "F16": np.array([[1.5, -2.25]], dtype=np.float16),
    "U64": np.array([[2**63 + 5]], dtype=np.uint64),
    "B": np.array([[True, False, True]]),
    "S": np.array([[b"hello", "wörld".encode(), b""]], dtype=object),
}


def http_inputs(binary: bool) -> list[httpclient.InferInput]:
    out = []
    for name, arr in ARRAYS.items():
        if not binary and arr.dtype == np.float16:
            continue  # FP16 has no JSON form in tritonclient
        inp = httpclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        inp.set_data_from_numpy(arr, binary_data=binary)
        out.append(inp)
    return out


@pytest.mark.parametrize("binary", [True, False])
def test_http_request_from_tritonclient(binary: bool) -> None:
    outputs = [httpclient.InferRequestedOutput("OUT", binary_data=False, class_count=2)]
    body, json_size = httpclient.InferenceServerClient.generate_request_body(
        http_inputs(binary),
        outputs=outputs,
        request_id="r1",
        priority=2,
        timeout=5000,
        parameters={"custom": "x", "tenant": "acme"},
    )
    req = http_codec.decode_infer("m", "", body, json_size)
    assert req.id == "r1" and req.priority == 2 and req.timeout_us == 5000
    assert req.parameters == {"custom": "x"} and req.tenant_claim == "acme"
    assert [(o.name, o.binary, o.classification) for o in req.outputs] == [("OUT", False, 2)]
    for t in req.inputs:
        expected = ARRAYS[t.name]
        assert t.shape == expected.shape
        assert np.array_equal(t.data, expected)


def test_http_response_parsed_by_tritonclient() -> None:
    resp = InferResponse(
        "m",
        "1",
        "r1",
        [
            Tensor("A", "INT32", (2, 2), np.array([[1, 2], [3, 4]], dtype=np.int32)),
            Tensor("S", "BYTES", (1,), np.array([b"x\x00y"], dtype=object)),
            Tensor("F", "FP32", (1, 2), np.array([[0.5, 1.5]], dtype=np.float32)),
        ],
    )
    body, json_size = httpclient.InferenceServerClient.generate_request_body(
        [httpclient.InferInput("X", [1], "INT32").set_data_from_numpy(np.zeros(1, np.int32))],
        outputs=[
            httpclient.InferRequestedOutput("A", binary_data=True),
            httpclient.InferRequestedOutput("S", binary_data=True),
            httpclient.InferRequestedOutput("F", binary_data=False),
        ],
    )
    req = http_codec.decode_infer("m", "", body, json_size)
    payload, header_len = http_codec.encode_infer(resp, req)
    result = httpclient.InferenceServerClient.parse_response_body(payload, header_length=header_len)
    assert np.array_equal(result.as_numpy("A"), resp.outputs[0].data)
    assert result.as_numpy("S")[0] == b"x\x00y"
    assert np.allclose(result.as_numpy("F"), resp.outputs[2].data)
    assert result.get_response()["id"] == "r1"


def test_http_request_level_binary_output_default() -> None:
    req = http_codec.decode_infer(
        "m",
        "",
        json.dumps(
            {
                "inputs": [{"name": "X", "shape": [1], "datatype": "INT32", "data": [1]}],
                "parameters": {"binary_data_output": True},
            }
        ).encode(),
        None,
    )
    resp = InferResponse("m", "1", "", [Tensor("Y", "INT32", (1,), np.array([7], np.int32))])
    payload, header_len = http_codec.encode_infer(resp, req)
    assert header_len is not None
    header = json.loads(payload[:header_len])
    assert header["outputs"][0]["parameters"]["binary_data_size"] == 4


LYING_SIZE = (
    b'{"inputs": [{"name": "X", "shape": [1], "datatype": "INT32", '
    b'"parameters": {"binary_data_size": 8}}]}'
)


@pytest.mark.parametrize(
    ("body", "header_length", "message"),
    [
        (b"{not json", None, "failed to parse"),
        (b"[]", None, "must be an object"),
        (b'{"inputs": {}}', None, "an 'inputs' list"),
        (
            b'{"inputs": [{"name": "X", "shape": [2], "datatype": "INT32", "data": [1]}]}',
            None,
            "needs 2 elements",
        ),
        (
            b'{"inputs": [{"name": "X", "shape": [1], "datatype": "INT32", "data": ["a"]}]}',
            None,
            "not INT32",
        ),
        (
            b'{"inputs": [{"name": "X", "shape": [1], "datatype": "INT8", "data": [300]}]}',
            None,
            "out of range",
        ),
        (
            b'{"inputs": [{"name": "X", "shape": [1], "datatype": "NOPE", "data": [1]}]}',
            None,
            "unknown datatype",
        ),
        (
            b'{"inputs": [{"name": "X", "shape": [-1], "datatype": "INT32", "data": []}]}',
            None,
            "negative dimension",
        ),
        (LYING_SIZE + b"\x01\x00\x00\x00", len(LYING_SIZE), "runs past the end"),
        (
            b'{"inputs": [{"name": "X", "shape": [1], "datatype": "INT32", "data": [1]}], '
            b'"parameters": {"priority": -1}}',
            None,
            "'priority' must be >= 0",
        ),
        (
            b'{"inputs": [{"name": "X", "shape": [1], "datatype": "INT32", "data": [1]}], '
            b'"parameters": {"triton_x": 1}}',
            None,
            "reserved",
        ),
        (
            b'{"inputs": [{"name": "X", "shape": [1], "datatype": "INT32", "data": [1]}], '
            b'"parameters": {"fair_rows": "{}"}}',
            None,
            "reserved",
        ),
    ],
)
def test_http_bad_requests(body: bytes, header_length: int | None, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        http_codec.decode_infer("m", "", body, header_length)


def test_http_header_length_that_lies() -> None:
    with pytest.raises(InvalidArgument, match="Inference-Header-Content-Length"):
        http_codec.parse_header_length("500", 100)
    with pytest.raises(InvalidArgument, match="must be an integer"):
        http_codec.parse_header_length("abc", 100)
    # A header length shorter than the JSON leaves trailing JSON as "binary data".
    body = b'{"inputs": [{"name": "X", "shape": [1], "datatype": "INT32", "data": [1]}]}'
    with pytest.raises(InvalidArgument):
        http_codec.decode_infer("m", "", body, len(body) - 5)


def test_grpc_request_from_tritonclient_round_trips() -> None:
    inputs = []
    for name, arr in ARRAYS.items():
        inp = grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    msg = _get_inference_request(
        model_name="m",
        inputs=inputs,
        model_version="2",
        request_id="r",
        outputs=[grpcclient.InferRequestedOutput("OUT", class_count=3)],
        sequence_id=0,
        sequence_start=False,
        sequence_end=False,
        priority=1,  # tritonclient sends uint64_param
        timeout=100,
        parameters={"k": 1.5},
    )
    req = grpc_codec.decode_infer(msg)
    assert (req.model, req.version, req.id, req.priority, req.timeout_us) == ("m", "2", "r", 1, 100)
    assert req.parameters == {"k": 1.5}
    assert req.outputs[0].classification == 3
    for t in req.inputs:
        assert np.array_equal(t.data, ARRAYS[t.name])

    resp = grpc_codec.encode_infer(InferResponse("m", "2", "r", req.inputs))
    result = grpcclient.InferResult(resp)
    for name, arr in ARRAYS.items():
        assert np.array_equal(result.as_numpy(name), arr)


def test_grpc_typed_contents_and_int64_priority() -> None:
    msg = service_pb2.ModelInferRequest(model_name="m")
    t = msg.inputs.add(name="X", datatype="INT32", shape=[2])
    t.contents.int_contents.extend([5, 6])
    msg.parameters["priority"].int64_param = 3
    req = grpc_codec.decode_infer(msg)
    assert req.priority == 3
    assert req.inputs[0].data.tolist() == [5, 6]


P = service_pb2.InferParameter


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda m: m.raw_input_contents.append(b"\x00" * 4), "raw_input_contents"),
        (lambda m: m.parameters["priority"].MergeFrom(P(int64_param=-2)), "must be >= 0"),
        (lambda m: m.parameters["timeout"].MergeFrom(P(string_param="x")), "must be an integer"),
        (
            lambda m: (
                m.inputs.add(name="X", datatype="INT32", shape=[1]),
                m.raw_input_contents.append(b"\x00" * 4),
            ),
            "more than once",
        ),
    ],
)
def test_grpc_bad_requests(mutate, message) -> None:  # type: ignore[no-untyped-def]
    msg = service_pb2.ModelInferRequest(model_name="m")
    msg.inputs.add(name="X", datatype="INT32", shape=[1])
    msg.raw_input_contents.append(b"\x01\x00\x00\x00")
    mutate(msg)
    with pytest.raises(InvalidArgument, match=message):
        grpc_codec.decode_infer(msg)


def test_gzip_is_the_servers_business() -> None:
    # aiohttp inflates request bodies before the codec sees them; this pins the contract
    # that the codec itself takes plain bytes.
    body = b'{"inputs": [{"name": "X", "shape": [1], "datatype": "INT32", "data": [1]}]}'
    with pytest.raises(InvalidArgument):
        http_codec.decode_infer("m", "", gzip.compress(body), None)
