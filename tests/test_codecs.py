"""The KServe v2 codecs against tritonclient's own request builders and response parsers."""

from __future__ import annotations

import gzip
import json
import tracemalloc
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2
from tritonclient.grpc._utils import _get_inference_request
from tritonclient.utils import np_to_triton_dtype

from fair_frontend import grpc_codec
from fair_frontend.errors import InvalidArgument
from fair_frontend.models import ModelInfo, TensorSpec
from fair_frontend.protocol import (
    Declared,
    InferRequest,
    InferResponse,
    Tensor,
    leaves,
    tensor_from_list,
)
from fair_frontend.shell import http_codec
from fair_frontend.shell.generate_codec import decode_generate

ARRAYS: dict[str, np.ndarray] = {
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
def test_grpc_bad_requests(mutate, message) -> None:
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


# ---- JSON tensor data without a Python object per element (fair_frontend.shell.json_tensor) -----

JSON_DATATYPES = ["BOOL", "INT8", "UINT8", "INT32", "UINT32", "INT64", "UINT64", "FP32", "FP64"]
JSON_DATATYPES += ["BYTES", "FP16"]
# Strings that look like the separators and escapes the scanner must see through.
NASTY_TEXT = st.sampled_from(["a,b]", '"', "\\", '\\"', "[[", "]", "", " , ", "é", "\u2028"])
LEAVES = st.one_of(
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 127, 128, 255, 256, 2**31 - 1, -(2**31), 2**63 - 1, 2**64 - 1]),
    st.floats(),  # NaN and Infinity too: JSON extensions Triton (and json.loads) take
    st.floats(width=32),
    st.text(max_size=6),
    NASTY_TEXT,
    st.none(),
)
NESTED = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=4), max_leaves=24)


def _reference(datatype: str, shape: list[int], data: Any) -> Tensor:
    """The decode the frontend made before json_tensor: the whole document as Python
    objects, then a flat list, then an array (``protocol.tensor_from_list``)."""
    return tensor_from_list("X", datatype, tuple(shape), data)


def _body(datatype: str, shape: list[int], data_json: str) -> bytes:
    head = json.dumps({"inputs": [{"name": "X", "datatype": datatype, "shape": shape}]})
    return (head[:-3] + ', "data": ' + data_json + "}]}").encode()


@settings(max_examples=250, deadline=None)
@given(
    datatype=st.sampled_from(JSON_DATATYPES),
    data=st.lists(NESTED, max_size=8),
    lie=st.sampled_from([0, 0, 0, 1, -1]),
    indent=st.sampled_from([None, 0, 2]),
)
def test_json_data_decodes_as_the_plain_json_decode_did(
    datatype: str, data: list[Any], lie: int, indent: int | None
) -> None:
    """Same tensor, or refused alike (which check refuses may differ only where the
    document holds a surrogate, which the plain parser took), for any nesting, kinds,
    strings holding brackets, commas, quotes and backslashes, and shapes that lie."""
    flat = leaves(data)
    shape = [max(len(flat) + lie, 0)]
    text = json.dumps(data, indent=indent)
    try:
        expected: Tensor | str = _reference(datatype, shape, json.loads(text))
    except InvalidArgument as err:
        expected = err.message
    except UnicodeEncodeError:
        expected = "surrogate"
    try:
        got: Tensor | str = http_codec.decode_infer(
            "m", "", _body(datatype, shape, text), None
        ).inputs[0]
    except InvalidArgument as err:
        got = err.message
    if isinstance(expected, Tensor):
        assert isinstance(got, Tensor), got
        assert got.shape == expected.shape and got.data.dtype == expected.data.dtype
        if got.data.dtype.kind == "f":
            assert np.array_equal(got.data, expected.data, equal_nan=True)
        else:
            assert got.data.tolist() == expected.data.tolist()
    else:
        assert isinstance(got, str), (expected, got)
        if expected != "surrogate":
            assert got == expected


def test_nan_and_infinity_are_taken_as_triton_takes_them() -> None:
    """Not JSON, but Triton's parser (and Python's) takes NaN, Infinity and -Infinity:
    in FP data, in a parameter; an integer tensor holding one is refused as before."""
    body = b'{"inputs": [{"name": "X", "datatype": "FP32", "shape": [2, 2], '
    body += b'"data": [[NaN, Infinity], [-Infinity, 0.5]]}], "parameters": {"p": NaN}}'
    req = http_codec.decode_infer("m", "", body, None)
    assert np.array_equal(
        req.inputs[0].data, np.array([[np.nan, np.inf], [-np.inf, 0.5]], np.float32), equal_nan=True
    )
    assert np.isnan(req.parameters["p"])
    with pytest.raises(InvalidArgument, match="not INT32"):
        http_codec.decode_infer("m", "", _body("INT32", [1], "[NaN]"), None)
    with pytest.raises(InvalidArgument, match="failed to parse"):
        http_codec.decode_infer("m", "", _body("FP32", [1], "[Nan]"), None)


def test_json_data_holding_an_object_is_refused_before_its_count() -> None:
    """An object's members would pass for elements: refused at once, as the wrong kind."""
    for datatype, says in (("INT32", "not INT32"), ("BYTES", "BYTES element 1 is not a string")):
        body = _body(datatype, [5], '["a", {"b": [1, 2]}]')
        with pytest.raises(InvalidArgument, match=says):
            http_codec.decode_infer("m", "", body, None)


# Bodies a hostile client writes: huge numbers, nesting as deep as it gets, lone surrogates,
# wrong types anywhere, shapes that lie, a thousand members where one is expected.
HOSTILE_VALUES = st.one_of(
    st.sampled_from(["10" * 3000, "1e999", "-0.0e-400", "NaN", '"\\ud800"', '"\\udc00x"']),
    st.sampled_from(['"\\ud83d\\ude00"', "[" * 3000 + "]" * 3000, "[" * 40 + "1" + "]" * 40]),
    st.sampled_from(["{}", "null", "true", '"x"', "[]", "[[]]", '[{"a": 1}]', "1.5"]),
    st.sampled_from(["[" + ",".join(["{}"] * 1100) + "]", "[" + ",".join(["1"] * 3000) + "]"]),
    st.sampled_from(['{"' + '": 1, "'.join(f"k{i}" for i in range(1100)) + '": 1}']),
)
FIELDS = ["id", "parameters", "inputs", "outputs", "name", "datatype", "shape", "data"]


@st.composite
def hostile_bodies(draw: st.DrawFn) -> bytes:
    shape = draw(st.sampled_from([[2], [1, 2], [0], [2**40], [2**63 - 1], [-1]]))
    spec = {"name": "X", "datatype": draw(st.sampled_from(JSON_DATATYPES)), "shape": shape}
    text = json.dumps({"id": "r", "inputs": [{**spec, "data": [1, 2]}], "outputs": [{"name": "Y"}]})
    for _ in range(draw(st.integers(1, 3))):
        field = draw(st.sampled_from(FIELDS))
        value = draw(HOSTILE_VALUES)
        key = f'"{field}": '
        at = text.find(key)
        if at < 0:
            continue
        end = _value_end(text, at + len(key))
        text = text[: at + len(key)] + value + text[end:]
    return text.encode()


def _value_end(text: str, start: int) -> int:
    """Where the JSON value starting at ``start`` ends (the next top-level , or } or ])."""
    depth = 0
    in_string = False
    i = start
    while i < len(text):
        c = text[i]
        if in_string:
            if c == "\\":
                i += 1
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
        elif c in "]}":
            if depth == 0:
                return i
            depth -= 1
        elif c == "," and depth == 0:
            return i
        i += 1
    return i


# Found by the test: NaN (which takes a second parse, without it) and arrays nested too deep
# for either parse raised RecursionError from the second, a 500.
NAN_AND_DEEP = b'{"id": NaN, "inputs": ' + b"[" * 5000 + b"]" * 5000 + b', "outputs": []}'


@settings(max_examples=200, deadline=None)
@given(body=hostile_bodies())
@example(body=NAN_AND_DEEP)
def test_hostile_json_bodies_are_answered_within_the_memory_bound(body: bytes) -> None:
    """Every body is decoded or refused as the client's error (never another exception,
    which the server would answer 500), at most a few times its size in memory."""
    tracemalloc.start()
    try:
        http_codec.decode_infer("m", "", body, None)
    except InvalidArgument as err:
        assert err.message
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak <= DECODE_MEMORY_FACTOR * len(body) + DECODE_MEMORY_SLACK, peak


# One decode's peak memory (tracemalloc: Python and numpy allocations) is at most this
# many times the body, plus a constant (the scanner's windows, the interpreter's own).
DECODE_MEMORY_FACTOR = 6
DECODE_MEMORY_SLACK = 8 << 20
BYTES_MEMORY_FACTOR = 10  # BYTES: a Python bytes object per element is the tensor's form


@pytest.mark.parametrize(
    ("datatype", "element", "factor"),
    [
        ("INT64", "0", DECODE_MEMORY_FACTOR),  # 2 bytes of text, 8 of tensor: the worst
        ("INT32", "-2147483648", DECODE_MEMORY_FACTOR),
        ("FP32", "0.25", DECODE_MEMORY_FACTOR),
        ("BOOL", "true", DECODE_MEMORY_FACTOR),
        ("BYTES", '"ab"', BYTES_MEMORY_FACTOR),
    ],
)
def test_large_json_tensor_decodes_within_a_few_times_its_body(
    datatype: str, element: str, factor: int
) -> None:
    """Measured by tracemalloc: before json_tensor, [0,0,...] as INT64 took about 13 times
    its body (a Python int per element in two lists, then the array)."""
    count = (12 << 20) // (len(element) + 1)
    body = _body(datatype, [1, count], "[" + ",".join([element] * count) + "]")
    tracemalloc.start()
    try:
        req = http_codec.decode_infer("m", "", body, None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert req.inputs[0].data.size == count
    assert peak <= factor * len(body), f"{peak / len(body):.1f} x the body"


def test_precheck_refuses_before_any_element_is_converted() -> None:
    """The model's checks run on the declared inputs first: a tensor no model could take
    is never built (HTTP JSON and binary, gRPC raw and typed)."""
    seen: list[list[Declared]] = []

    def refuse(req: InferRequest, declared: list[Declared]) -> None:
        seen.append(declared)
        raise InvalidArgument("refused by the model's checks")

    count = 4 << 20
    body = _body("BYTES", [1, count], "[" + ",".join(['"ab"'] * count) + "]")
    tracemalloc.start()
    try:
        with pytest.raises(InvalidArgument, match="model's checks"):
            http_codec.decode_infer("m", "", body, None, precheck=refuse)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < len(body) // 4  # no element: the scan's windows only
    assert seen[-1] == [Declared("X", "BYTES", (1, count), None)]

    msg = service_pb2.ModelInferRequest(model_name="m")
    typed = msg.inputs.add(name="T", datatype="BYTES", shape=[count])
    typed.contents.bytes_contents.extend([b"ab"] * count)
    tracemalloc.start()
    try:
        with pytest.raises(InvalidArgument, match="model's checks"):
            grpc_codec.decode_infer(msg, precheck=refuse)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    assert seen[-1] == [Declared("T", "BYTES", (count,), None)]
    raw = service_pb2.ModelInferRequest(model_name="m")
    raw.inputs.add(name="R", datatype="INT32", shape=[3])
    raw.raw_input_contents.append(b"\x00" * 12)
    with pytest.raises(InvalidArgument, match="model's checks"):
        grpc_codec.decode_infer(raw, precheck=refuse)
    assert seen[-1] == [Declared("R", "INT32", (3,), 12)]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (_body("BYTES", [1], '["\\ud800"]'), "input 'X': a BYTES element is not valid Unicode"),
        (_body("BYTES", [1], '["ok\\udfff"]'), "a lone UTF-16 surrogate '\\udfff'"),
        (b'{"id": "\\ud800", "inputs": []}', "'id' is not valid Unicode"),
        (b'{"inputs": [], "parameters": {"p": "\\udbff"}}', "a request parameter is not"),
        (b'{"inputs": [{"name": "\\ud800"}]}', "inputs[0]: 'name' is not valid Unicode"),
    ],
)
def test_a_lone_surrogate_is_refused_naming_the_field(body: bytes, says: str) -> None:
    """JSON can escape half a UTF-16 pair; no text encoding carries it on: the client's
    error (it was a 500 with a traceback), naming where it is."""
    with pytest.raises(InvalidArgument) as err:
        http_codec.decode_infer("m", "", body, None)
    assert says in err.value.message


def test_an_escaped_backslash_before_u_is_not_a_surrogate() -> None:
    body = _body("BYTES", [2], '["\\\\ud800", "\\ud83d\\ude00"]')
    data = http_codec.decode_infer("m", "", body, None).inputs[0].data
    assert data.tolist() == [b"\\ud800", "\U0001f600".encode()]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b'{"text_input": "\\ud800"}', "input 'text_input' is not valid Unicode"),
        (b'{"text_input": "ok", "p": "a\\udc00"}', "parameter 'p' is not valid Unicode"),
        (b'{"id": "\\udbff", "text_input": "ok"}', "'id' is not valid Unicode"),
        (b'{"text_input": "ok", "\\ud800": 1}', "a key of the request is not valid"),
    ],
)
def test_generate_refuses_a_lone_surrogate_naming_the_field(body: bytes, says: str) -> None:
    """Python's JSON parser takes a lone surrogate escape; it was a 500 when encoded."""
    info = ModelInfo("llm", 0, {"text_input": TensorSpec("text_input", "BYTES", (1,))}, {})
    with pytest.raises(InvalidArgument) as err:
        decode_generate("llm", "", body, info)
    assert err.value.http_status == 400 and says in err.value.message
    pair = decode_generate("llm", "", b'{"text_input": "\\ud83d\\ude00"}', info)
    assert pair.inputs[0].data.tolist() == ["\U0001f600".encode()]
