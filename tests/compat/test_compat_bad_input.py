"""Bad input, table-driven, over HTTP and gRPC: 400 / INVALID_ARGUMENT that names the problem.

Every case goes through the frontend (with a valid key) and must be answered 400 /
INVALID_ARGUMENT, never 500, with a message naming the input, parameter or header at
fault; a normal request is served right after it. The same request is also sent to
Triton directly and the status it gives is recorded in the table's ``triton`` column:
equal to ours where Triton has the same check (wording differs: Triton prefixes
"[request id: <id_unknown>]", lists all inputs where we name the one at fault, and so
on), and different where the frontend is deliberately stricter or Triton answers 500 for
what is the client's error. ``triton=None``: not sent to Triton, because it would crash
it (classification of a BYTES output kills tritonserver 2.51).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import pytest
from compat_support import (
    HEADER_LENGTH,
    KEY_HEADER,
    KEY_METADATA,
    HttpInfer,
    bytes_elements,
    grpc_call,
    grpc_stub,
    http_request,
    identity_grpc,
    ids_grpc,
    simple_grpc,
    simple_http,
    simple_still_served_grpc,
    simple_still_served_http,
)
from tritonclient.grpc import service_pb2

from fair_frontend.backends.triton.embedded import EmbeddedTriton
from fair_frontend.config import parse_config
from tests.support import RunningFrontend, config_dict, running_frontend

IA = grpc.StatusCode.INVALID_ARGUMENT
OK = grpc.StatusCode.OK
NOT_FOUND = grpc.StatusCode.NOT_FOUND


@dataclass(frozen=True)
class HttpBad:
    id: str
    build: Callable[[], HttpInfer]
    names: str  # the frontend's message must contain this (what is wrong, by name)
    triton: int | None  # Triton 2.51's status for the same request (None: not sent)


@dataclass(frozen=True)
class GrpcBad:
    id: str
    build: Callable[[], service_pb2.ModelInferRequest]
    names: str
    triton: grpc.StatusCode | None


# ---- HTTP ---------------------------------------------------------------------------------


def edit(binary: bool = False, rows: int = 1, **what: Any) -> Callable[[], HttpInfer]:
    """A `simple` request with ``what`` applied: input fields by ``inputN_field``,
    top-level ``parameters``/``outputs``, or whole-request edits."""

    def build() -> HttpInfer:
        req = simple_http(rows, binary=binary)
        for key, value in what.items():
            if key.startswith("input"):
                index, field = key[len("input")], key[len("input") + 2 :]
                req.doc["inputs"][int(index)][field] = value
            elif key == "headers":
                req.headers.update(value)
            elif key == "raw_json":
                req.raw_json = value
            elif key == "binary":
                req.binary = value
            elif key == "model":
                req.model = value
            elif key == "call":
                value(req)
            else:
                req.doc[key] = value
        return req

    return build


def params(**p: Any) -> Callable[[], HttpInfer]:
    return edit(parameters=p)


def identity_http(payload: bytes, count: int, outputs: Any = None) -> Callable[[], HttpInfer]:
    def build() -> HttpInfer:
        doc: dict[str, Any] = {
            "inputs": [
                {
                    "name": "INPUT0",
                    "shape": [1, count],
                    "datatype": "BYTES",
                    "parameters": {"binary_data_size": len(payload)},
                }
            ]
        }
        if outputs is not None:
            doc["outputs"] = outputs
        return HttpInfer("simple_identity", doc, payload)

    return build


def ids_http(
    model: str, parameters: dict[str, Any] | None = None, **extra: list[int]
) -> Callable[[], HttpInfer]:
    """INPUT_IDS [1, 4], any ``extra`` [1, 1] inputs, any request ``parameters``."""

    def build() -> HttpInfer:
        inputs = [{"name": "INPUT_IDS", "shape": [1, 4], "datatype": "INT32", "data": [1, 2, 3, 4]}]
        for name, values in extra.items():
            inputs.append({"name": name, "shape": [1, 1], "datatype": "INT32", "data": values})
        doc: dict[str, Any] = {"inputs": inputs}
        if parameters is not None:
            doc["parameters"] = parameters
        return HttpInfer(model, doc)

    return build


def _drop_input1(req: HttpInfer) -> None:
    del req.doc["inputs"][1]


def _extra_input(req: HttpInfer) -> None:
    req.doc["inputs"].append({"name": "EXTRA", "shape": [1, 1], "datatype": "INT32", "data": [1]})


def _duplicate_input(req: HttpInfer) -> None:
    req.doc["inputs"][1]["name"] = "INPUT0"


def _empty_batch(req: HttpInfer) -> None:
    for spec in req.doc["inputs"]:
        spec["shape"], spec["data"] = [0, 16], []


def _batch_of(rows: int) -> Callable[[HttpInfer], None]:
    def apply(req: HttpInfer) -> None:
        for spec in req.doc["inputs"]:
            spec["shape"], spec["data"] = [rows, 16], [list(range(16))] * rows

    return apply


def _binary_sizes(first: int, second: int) -> Callable[[HttpInfer], None]:
    def apply(req: HttpInfer) -> None:
        req.doc["inputs"][0]["parameters"]["binary_data_size"] = first
        req.doc["inputs"][1]["parameters"]["binary_data_size"] = second

    return apply


def _header_length(delta: int) -> Callable[[HttpInfer], None]:
    def apply(req: HttpInfer) -> None:
        req.headers[HEADER_LENGTH] = str(len(json.dumps(req.doc)) + delta)

    return apply


def _deeply_nested(req: HttpInfer) -> None:
    doc = json.dumps(req.doc)
    req.raw_json = (
        doc.replace('"data": [[0', '"data": ' + "[" * 5000 + "[0", 1)
        .replace("]]", "]]" + "]" * 5000, 1)
        .encode()
    )


S16 = list(range(16))
HTTP_CASES = [
    HttpBad("wrong-dtype", edit(input0_datatype="FP32"), "INPUT0", 400),
    HttpBad("unknown-dtype", edit(input0_datatype="NOPE"), "INPUT0", 400),
    HttpBad("wrong-shape", edit(input0_shape=[1, 8], input0_data=S16[:8]), "INPUT0", 400),
    HttpBad("negative-dim", edit(input0_shape=[1, -16]), "INPUT0", 500),
    HttpBad("shape-not-ints", edit(input0_shape=[1, 16.0]), "INPUT0", 500),
    HttpBad("shape-unusable", edit(input0_shape=[0, 2**62], input0_data=[]), "INPUT0", 400),
    HttpBad("missing-input", edit(call=_drop_input1), "INPUT1", 400),
    HttpBad("extra-input", edit(call=_extra_input), "EXTRA", 400),
    HttpBad("duplicate-input", edit(call=_duplicate_input), "INPUT0", 400),
    HttpBad("unknown-output", edit(outputs=[{"name": "NOPE"}]), "NOPE", 400),
    HttpBad("empty-batch", edit(call=_empty_batch), "batch", 400),
    HttpBad("batch-too-large", edit(call=_batch_of(9)), "batch-size", 400),
    HttpBad("data-count", edit(input0_data=S16[:15]), "INPUT0", 500),
    HttpBad("data-not-int", edit(input0_data=[1.5, *S16[1:]]), "INPUT0", 500),
    HttpBad("data-overflows-int32", edit(input0_data=[2**31, *S16[1:]]), "INPUT0", 200),
    HttpBad("json-malformed", edit(raw_json=b'{"inputs": ['), "JSON", 500),
    HttpBad("json-not-object", edit(raw_json=b"[]"), "JSON", 500),
    HttpBad("json-bad-utf8", edit(raw_json=b'{"inputs": "\xff\xfe"}'), "JSON", 500),
    HttpBad("json-nested-5000", edit(call=_deeply_nested), "JSON", 500),
    HttpBad("json-empty-body", edit(raw_json=b""), "Raw request", 400),
    HttpBad("header-too-big", edit(True, call=_header_length(10)), HEADER_LENGTH, 400),
    HttpBad("header-past-body", edit(True, call=_header_length(10_000)), HEADER_LENGTH, 400),
    HttpBad("header-too-small", edit(True, call=_header_length(-5)), HEADER_LENGTH, 500),
    HttpBad("header-not-number", edit(True, headers={HEADER_LENGTH: "abc"}), HEADER_LENGTH, 400),
    HttpBad("header-negative", edit(True, headers={HEADER_LENGTH: "-1"}), HEADER_LENGTH, 400),
    HttpBad("binary-size-lies", edit(True, call=_binary_sizes(60, 68)), "INPUT0", 400),
    HttpBad("binary-size-past-end", edit(True, call=_binary_sizes(64, 80)), "INPUT1", 400),
    HttpBad(
        "binary-size-negative", edit(True, call=_binary_sizes(-4, 64)), "binary_data_size", 500
    ),
    HttpBad(
        "binary-trailing-bytes",
        edit(True, call=lambda r: setattr(r, "binary", r.binary + b"1234")),
        "binary_data_size",
        400,
    ),
    HttpBad("priority-negative", params(priority=-1), "priority", 500),
    HttpBad("priority-not-integer", params(priority=1.5), "priority", 500),
    HttpBad("priority-out-of-range", params(priority=11), "priority", 200),
    HttpBad("timeout-negative", params(timeout=-1), "timeout", 500),
    HttpBad("timeout-not-integer", params(timeout="soon"), "timeout", 500),
    HttpBad("timeout-too-wide", params(timeout=2**64), "timeout", 500),
    HttpBad("sequence-id-too-wide", params(sequence_id=2**63), "sequence_id", 200),
    HttpBad("sequence-id-negative", params(sequence_id=-1), "sequence_id", 500),
    HttpBad("sequence-start-not-bool", params(sequence_start="yes"), "sequence_start", 500),
    HttpBad("reserved-triton", params(triton_x=1), "'triton_'", 400),
    HttpBad("reserved-fair", params(fair_rows="{}"), "fair_rows", 200),
    HttpBad("parameter-object", params(nested={"a": 1}), "nested", 400),
    HttpBad("parameter-int-too-wide", params(wide=2**64), "wide", 200),
    HttpBad(
        "binary-data-output-not-bool", params(binary_data_output="yes"), "binary_data_output", 500
    ),
    HttpBad("unknown-model", edit(model="no_such_model"), "no_such_model", 404),
    HttpBad("bytes-prefix-past-end", identity_http(b"\x64\x00\x00\x00ab", 1), "INPUT0", 400),
    HttpBad("bytes-too-few", identity_http(bytes_elements(b"ab"), 2), "INPUT0", 400),
    HttpBad("bytes-leftover", identity_http(bytes_elements(b"ab", b"c") + b"z", 2), "INPUT0", 400),
    HttpBad("bytes-huge-count", identity_http(bytes_elements(b"a"), 2**40), "INPUT0", 400),
    HttpBad(
        "shared-memory",
        edit(input0_parameters={"shared_memory_region": "r", "shared_memory_byte_size": 64}),
        "shared_memory_region",
        400,
    ),
    HttpBad(
        "classification-negative",
        edit(outputs=[{"name": "OUTPUT0", "parameters": {"classification": -1}}]),
        "classification",
        500,
    ),
    HttpBad(
        "classification-too-wide",
        edit(outputs=[{"name": "OUTPUT0", "parameters": {"classification": 2**63}}]),
        "classification",
        200,  # Triton answers plain OUTPUT0, as if no classification were asked
    ),
    HttpBad(
        "classification-of-bytes",
        identity_http(
            bytes_elements(b"a"), 1, [{"name": "OUTPUT0", "parameters": {"classification": 1}}]
        ),
        "classification",
        None,
    ),
    # Former model inputs (now request parameters): unexpected, to Triton and to us.
    HttpBad("former-max-tokens-input", ids_http("generate", MAX_TOKENS=[4]), "MAX_TOKENS", 400),
    HttpBad("former-lengths-input", ids_http("embed", INPUT_LENGTHS=[4]), "INPUT_LENGTHS", 400),
    # max_tokens, the request parameter: the model's range (1..256), an integer.
    HttpBad("max-tokens-negative", ids_http("generate", {"max_tokens": -5}), "max_tokens", 400),
    HttpBad("max-tokens-zero", ids_http("generate", {"max_tokens": 0}), "max_tokens", 400),
    HttpBad("max-tokens-too-many", ids_http("generate", {"max_tokens": 257}), "max_tokens", 400),
    HttpBad("max-tokens-fraction", ids_http("generate", {"max_tokens": 2.5}), "max_tokens", 400),
    HttpBad("max-tokens-word", ids_http("generate", {"max_tokens": "many"}), "max_tokens", 400),
    HttpBad("max-tokens-bool", ids_http("generate", {"max_tokens": True}), "max_tokens", 400),
]


def _send_http(url: str, req: HttpInfer, key: bool) -> Any:
    headers = {**req.wire_headers(), **(KEY_HEADER if key else {})}
    return http_request(url, "POST", req.path, req.body(), headers)


@pytest.mark.parametrize("case", HTTP_CASES, ids=[c.id for c in HTTP_CASES])
def test_http_bad_input(triton: EmbeddedTriton, frontend: RunningFrontend, case: HttpBad) -> None:
    through = _send_http(frontend.http_url, case.build(), key=True)
    assert (through.status, case.names in through.error) == (400, True), through
    if case.triton is not None:
        direct = _send_http(triton.http_url, case.build(), key=False)
        assert direct.status == case.triton, direct
    simple_still_served_http(frontend.http_url)


# ---- gRPC ---------------------------------------------------------------------------------


def gedit(fn: Callable[[service_pb2.ModelInferRequest], Any], rows: int = 1) -> Callable[[], Any]:
    def build() -> service_pb2.ModelInferRequest:
        msg = simple_grpc(rows)
        fn(msg)
        return msg

    return build


def gparam(name: str, **value: Any) -> Callable[[], Any]:
    return gedit(lambda m: m.parameters[name].MergeFrom(service_pb2.InferParameter(**value)))


def _typed(field: str, count: int) -> Callable[[service_pb2.ModelInferRequest], None]:
    def apply(msg: service_pb2.ModelInferRequest) -> None:
        del msg.raw_input_contents[:]
        getattr(msg.inputs[0].contents, field).extend(range(count))
        msg.inputs[1].contents.int_contents.extend(range(16))

    return apply


def _set_shape(*shape: int) -> Callable[[service_pb2.ModelInferRequest], None]:
    def apply(msg: service_pb2.ModelInferRequest) -> None:
        msg.inputs[0].shape[:] = list(shape)

    return apply


def _both_shapes(*shape: int) -> Callable[[service_pb2.ModelInferRequest], None]:
    def apply(msg: service_pb2.ModelInferRequest) -> None:
        for i, spec in enumerate(msg.inputs):
            spec.shape[:] = list(shape)
            msg.raw_input_contents[i] = np.zeros(shape, dtype=np.int32).tobytes()

    return apply


def _output(name: str, classification: int | None = None) -> Callable[[Any], None]:
    def apply(msg: service_pb2.ModelInferRequest) -> None:
        out = msg.outputs.add(name=name)
        if classification is not None:
            out.parameters["classification"].int64_param = classification

    return apply


def _uint64_class(value: int) -> Callable[[service_pb2.ModelInferRequest], None]:
    def apply(msg: service_pb2.ModelInferRequest) -> None:
        msg.outputs.add(name="OUTPUT0").parameters["classification"].uint64_param = value

    return apply


def _with_input(model: str, name: str) -> Callable[[], Any]:
    """INPUT_IDS [1, 4] and an INT32 [1, 1] input ``name``."""

    def build() -> service_pb2.ModelInferRequest:
        msg = ids_grpc(model, np.arange(4, dtype=np.int32).reshape(1, 4))
        msg.inputs.add(name=name, datatype="INT32", shape=[1, 1])
        msg.raw_input_contents.append(np.array([4], dtype=np.int32).tobytes())
        return msg

    return build


def _with_max_tokens(**value: Any) -> Callable[[], Any]:
    """generate with the ``max_tokens`` request parameter set as ``value`` says."""

    def build() -> service_pb2.ModelInferRequest:
        msg = ids_grpc("generate", np.arange(4, dtype=np.int32).reshape(1, 4))
        msg.parameters["max_tokens"].MergeFrom(service_pb2.InferParameter(**value))
        return msg

    return build


def _bytes_classified() -> service_pb2.ModelInferRequest:
    msg = identity_grpc(bytes_elements(b"a"), 1)
    msg.outputs.add(name="OUTPUT0").parameters["classification"].int64_param = 1
    return msg


def _unknown_model(msg: service_pb2.ModelInferRequest) -> None:
    msg.model_name = "no_such_model"


RAW = np.arange(16, dtype=np.int32).tobytes()
GRPC_CASES = [
    GrpcBad("wrong-dtype", gedit(lambda m: setattr(m.inputs[0], "datatype", "FP32")), "INPUT0", IA),
    GrpcBad(
        "unknown-dtype", gedit(lambda m: setattr(m.inputs[0], "datatype", "NOPE")), "INPUT0", IA
    ),
    GrpcBad("wrong-shape", gedit(_set_shape(1, 4)), "INPUT0", IA),
    GrpcBad("negative-dim", gedit(_set_shape(1, -16)), "INPUT0", IA),
    GrpcBad("shape-unusable", gedit(_set_shape(0, 2**62)), "INPUT0", IA),
    GrpcBad(
        "missing-input", gedit(lambda m: (m.inputs.pop(), m.raw_input_contents.pop())), "INPUT1", IA
    ),
    GrpcBad(
        "extra-input",
        gedit(
            lambda m: (
                m.inputs.add(name="EXTRA", datatype="INT32", shape=[1, 1]),
                m.raw_input_contents.append(b"\0" * 4),
            )
        ),
        "EXTRA",
        IA,
    ),
    GrpcBad(
        "duplicate-input", gedit(lambda m: setattr(m.inputs[1], "name", "INPUT0")), "INPUT0", IA
    ),
    GrpcBad("no-inputs", lambda: service_pb2.ModelInferRequest(model_name="simple"), "input", IA),
    GrpcBad("empty-input-name", gedit(lambda m: setattr(m.inputs[0], "name", "")), "inputs[0]", IA),
    GrpcBad("unknown-output", gedit(_output("NOPE")), "NOPE", IA),
    GrpcBad("empty-batch", gedit(_both_shapes(0, 16)), "batch", IA),
    GrpcBad("batch-too-large", gedit(_both_shapes(9, 16)), "batch-size", IA),
    GrpcBad(
        "raw-too-short",
        gedit(lambda m: m.raw_input_contents.__setitem__(0, RAW[:60])),
        "INPUT0",
        IA,
    ),
    GrpcBad(
        "raw-too-long",
        gedit(lambda m: m.raw_input_contents.__setitem__(0, RAW + b"1234")),
        "INPUT0",
        IA,
    ),
    GrpcBad(
        "raw-one-missing", gedit(lambda m: m.raw_input_contents.pop()), "raw_input_contents", IA
    ),
    GrpcBad(
        "raw-one-extra", gedit(lambda m: m.raw_input_contents.append(RAW)), "raw_input_contents", OK
    ),
    GrpcBad(
        "no-data", gedit(lambda m: m.raw_input_contents.__delitem__(slice(None))), "INPUT0", IA
    ),
    GrpcBad("contents-short", gedit(_typed("int_contents", 15)), "INPUT0", IA),
    GrpcBad("contents-wrong-field", gedit(_typed("fp32_contents", 16)), "int_contents", IA),
    GrpcBad("priority-negative", gparam("priority", int64_param=-1), "priority", IA),
    GrpcBad("priority-out-of-range", gparam("priority", uint64_param=11), "priority", OK),
    GrpcBad("priority-string", gparam("priority", string_param="2"), "priority", IA),
    GrpcBad("timeout-negative", gparam("timeout", int64_param=-1), "timeout", OK),
    GrpcBad("timeout-double", gparam("timeout", double_param=1.5), "timeout", IA),
    GrpcBad("sequence-id-double", gparam("sequence_id", double_param=1.0), "sequence_id", IA),
    GrpcBad("sequence-id-too-wide", gparam("sequence_id", uint64_param=2**63), "sequence_id", IA),
    GrpcBad("sequence-end-int", gparam("sequence_end", int64_param=1), "sequence_end", IA),
    GrpcBad("reserved-triton", gparam("triton_x", string_param="x"), "'triton_'", IA),
    GrpcBad("reserved-fair", gparam("fair_rows", string_param="{}"), "fair_rows", OK),
    GrpcBad("parameter-uint64", gparam("big", uint64_param=2**64 - 1), "big", IA),
    GrpcBad("parameter-empty", gparam("empty"), "empty", IA),
    GrpcBad("unknown-model", gedit(_unknown_model), "no_such_model", NOT_FOUND),
    GrpcBad("bytes-prefix-past-end", lambda: identity_grpc(b"\x64\x00\x00\x00ab", 1), "INPUT0", IA),
    GrpcBad("bytes-too-few", lambda: identity_grpc(bytes_elements(b"ab"), 2), "INPUT0", IA),
    GrpcBad(
        "bytes-leftover", lambda: identity_grpc(bytes_elements(b"ab", b"c") + b"z", 2), "INPUT0", IA
    ),
    GrpcBad("bytes-huge-count", lambda: identity_grpc(bytes_elements(b"a"), 2**40), "INPUT0", IA),
    GrpcBad(
        "shared-memory",
        gedit(
            lambda m: (
                m.inputs[0]
                .parameters["shared_memory_region"]
                .MergeFrom(service_pb2.InferParameter(string_param="r"))
            )
        ),
        "shared_memory_region",
        IA,
    ),
    GrpcBad("classification-negative", gedit(_output("OUTPUT0", -1)), "classification", IA),
    GrpcBad("classification-uint64", gedit(_uint64_class(2**63)), "classification", IA),
    GrpcBad("classification-of-bytes", _bytes_classified, "classification", None),
    GrpcBad("former-max-tokens-input", _with_input("generate", "MAX_TOKENS"), "MAX_TOKENS", IA),
    GrpcBad("former-lengths-input", _with_input("embed", "INPUT_LENGTHS"), "INPUT_LENGTHS", IA),
    GrpcBad("max-tokens-negative", _with_max_tokens(int64_param=-5), "max_tokens", IA),
    GrpcBad("max-tokens-too-many", _with_max_tokens(int64_param=300), "max_tokens", IA),
    GrpcBad("max-tokens-double", _with_max_tokens(double_param=4.0), "max_tokens", IA),
    GrpcBad("max-tokens-word", _with_max_tokens(string_param="four"), "max_tokens", IA),
]


@pytest.mark.parametrize("case", GRPC_CASES, ids=[c.id for c in GRPC_CASES])
def test_grpc_bad_input(triton: EmbeddedTriton, frontend: RunningFrontend, case: GrpcBad) -> None:
    with grpc_stub(frontend.grpc_url) as stub:
        through = grpc_call(stub, case.build(), metadata=KEY_METADATA)
    assert (through.code, case.names in through.details) == (IA, True), through
    if case.triton is not None:
        with grpc_stub(triton.grpc_url) as stub:
            direct = grpc_call(stub, case.build())
        assert direct.code == case.triton, direct
    simple_still_served_grpc(frontend.grpc_url)


# ---- too large: per-endpoint limits, on a frontend of its own -----------------------------

MAX_BYTES = 2000  # embed: 500 INT32 tokens
MAX_TOKENS = 300


@pytest.fixture(scope="module")
def small(triton: EmbeddedTriton, workers: int) -> Iterator[RunningFrontend]:
    """Small per-endpoint limits; the default endpoint's too, so the transport limits
    (2 x the largest max_request_bytes + 1 MiB) are small enough to reach."""
    data = config_dict()
    for endpoint in data["endpoints"].values():
        endpoint["max_request_bytes"] = MAX_BYTES
    data["endpoints"]["embed"]["max_request_tokens"] = MAX_TOKENS
    data["default_endpoint"] = {"max_request_bytes": MAX_BYTES}
    with running_frontend(parse_config(data), triton, workers=workers) as running:
        yield running


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize(
    ("tokens", "says"),
    [(600, "2400 bytes"), (400, "400 tokens"), (200, None)],
    ids=["bytes", "tokens", "within"],
)
def test_request_too_large(
    small: RunningFrontend, protocol: str, tokens: int, says: str | None
) -> None:
    ids = np.arange(tokens, dtype=np.int32).reshape(1, tokens) % 4096
    if protocol == "http":
        doc = {
            "inputs": [
                {
                    "name": "INPUT_IDS",
                    "shape": [1, tokens],
                    "datatype": "INT32",
                    "data": ids.tolist(),
                }
            ]
        }
        req = HttpInfer("embed", doc)
        answer = _send_http(small.http_url, req, key=True)
        status, message = answer.status, answer.error
        expected: Any = 400 if says else 200
    else:
        with grpc_stub(small.grpc_url) as stub:
            reply = grpc_call(stub, ids_grpc("embed", ids), metadata=KEY_METADATA)
        status, message, expected = reply.code, reply.details, IA if says else OK
    assert status == expected, message
    if says is not None:
        assert says in message and "embed" in message
        simple_still_served_http(small.http_url)


def test_http_body_over_the_transport_limit(small: RunningFrontend) -> None:
    """Larger than any endpoint allows: refused by the HTTP server before decoding."""
    body = b'{"inputs": [], "pad": "' + b"x" * (2 * MAX_BYTES + (1 << 20)) + b'"}'
    answer = http_request(small.http_url, "POST", "/v2/models/embed/infer", body, KEY_HEADER)
    assert answer.status == 400
    assert "too large" in answer.error
    simple_still_served_http(small.http_url)


def test_grpc_message_over_the_transport_limit(small: RunningFrontend) -> None:
    """Larger than any endpoint allows: gRPC itself refuses it, before it is buffered
    whole (its own RESOURCE_EXHAUSTED, as Triton's at its 2 GiB limit). Below that limit,
    a message over its model's bound is INVALID_ARGUMENT (test_grpc_door)."""
    tokens = (2 * MAX_BYTES + (1 << 20)) // 4 + 1
    ids = np.zeros((1, tokens), dtype=np.int32)
    with grpc_stub(small.grpc_url) as stub:
        reply = grpc_call(stub, ids_grpc("embed", ids), metadata=KEY_METADATA)
    simple_still_served_grpc(small.grpc_url)
    assert reply.code == grpc.StatusCode.RESOURCE_EXHAUSTED, reply
    assert "larger than max" in reply.details


# ---- Content-Encoding the server cannot decode ----------------------------------------------

UNDECODABLE = [
    ("gzip", b"not gzip at all"),
    ("deflate", b"not deflate at all"),
    ("br", b"not brotli at all"),
    ("zstd", json.dumps(simple_http().doc).encode()),
]
UNDECODABLE_IDS = [encoding for encoding, _ in UNDECODABLE]


@pytest.mark.parametrize(("encoding", "body"), UNDECODABLE, ids=UNDECODABLE_IDS)
def test_http_undecodable_body_is_answered_as_triton_does(
    triton: EmbeddedTriton, frontend: RunningFrontend, encoding: str, body: bytes
) -> None:
    """Triton: 400 for a broken gzip/deflate body, 501 for an encoding it does not know;
    the frontend's message names the Content-Encoding."""
    path = "/v2/models/simple/infer"
    direct = http_request(triton.http_url, "POST", path, body, {"Content-Encoding": encoding})
    headers = {**KEY_HEADER, "Content-Encoding": encoding}
    through = http_request(frontend.http_url, "POST", path, body, headers)
    assert through.status == direct.status == (400 if encoding in ("gzip", "deflate") else 501)
    assert "Content-Encoding" in through.error and encoding in through.error, through


@pytest.mark.parametrize(("encoding", "body"), UNDECODABLE, ids=UNDECODABLE_IDS)
def test_http_undecodable_body_leaves_the_server_serving(
    frontend: RunningFrontend, encoding: str, body: bytes
) -> None:
    headers = {**KEY_HEADER, "Content-Encoding": encoding}
    answer = http_request(frontend.http_url, "POST", "/v2/models/simple/infer", body, headers)
    assert answer.status != 200
    simple_still_served_http(frontend.http_url)
