"""Fuzz: whatever arrives, the frontend answers it as the client's error or serves it.

HTTP: valid requests of every model, mutated (fields replaced, deleted or added with
random JSON, including the protocol's own names, or with hostile JSON text: numbers no
type holds, nesting deeper than parsers go, lone surrogate escapes, objects where elements
go, thousands of members), with lying or junk
``Inference-Header-Content-Length``, random binary tails, or plain random bytes; bodies
gzip/deflate-encoded (raw deflate too), or labelled with an encoding they do not have or
one nobody knows; random ``Accept-Encoding``. gRPC: ``ModelInferRequest``
messages built from random models, input names, datatypes, shapes, raw contents of random
or right lengths, typed contents, parameters of every kind and requested outputs, sent
with the generated stub.

The rule: never 5xx / INTERNAL / UNKNOWN / UNAVAILABLE (the last would mean Triton
went down), no hang; afterwards a normal request is served and Triton is still up. Two
5xx are the right answers, Triton's own: 501 for a Content-Encoding nobody supports, and
503 / UNAVAILABLE "Request timeout expired" for a random ``timeout`` of a few
microseconds, a request that really expired.
"""

from __future__ import annotations

import gzip
import json
import os
import string
import zlib
from collections.abc import Callable
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
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2

from fair_frontend.backends.triton.embedded import EmbeddedTriton
from fair_frontend.errors import MSG_TIMEOUT_EXPIRED
from fair_frontend.protocol import DTYPES
from tests.support import RunningFrontend

# 200 examples each keeps the suite fast; COMPAT_FUZZ_EXAMPLES=5000 for a deeper run.
FUZZ = settings(
    max_examples=int(os.environ.get("COMPAT_FUZZ_EXAMPLES", "200")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
MODELS = ["simple", "simple_identity", "simple_nobatch", "embed", "generate", "no_such_model"]
# INPUT_LENGTHS and MAX_TOKENS: former inputs of embed/generate, refused as inputs now.
INPUT_NAMES = ["INPUT0", "INPUT1", "INPUT_IDS", "INPUT_LENGTHS", "MAX_TOKENS"]
OUTPUT_NAMES = ["OUTPUT0", "OUTPUT1", "EMBEDDING", "ROW_META", "OUTPUT_IDS", "OUTPUT_LENGTHS"]
# Names with a meaning somewhere in the protocol, so mutations reach the checks behind them.
PROTOCOL_WORDS = [
    "inputs", "outputs", "name", "shape", "datatype", "data", "parameters", "id",
    "binary_data_size", "binary_data", "binary_data_output", "classification", "priority",
    "timeout", "sequence_id", "sequence_start", "headers", "tenant", "triton_x", "fair_rows",
    "shared_memory_region", "triton_enable_empty_final_response", "max_tokens",
]  # fmt: skip
DATATYPES = [*DTYPES, "", "NOPE", "STRING"]
DIMS = st.one_of(st.integers(-2, 5), st.sampled_from([0, 16, 2**31, 2**40, 2**62]))
NASTY_SHAPES = [[0, 2**62], [2**62, 0], [1, 2**40], [0] * 33, [1] * 40, [], [-1], [2**63 - 1]]
SHAPES = st.one_of(st.lists(DIMS, max_size=4), st.sampled_from(NASTY_SHAPES))
# Integers at the edges of the types they travel in.
EDGE_INTS = st.sampled_from(
    [0, 1, -1, 11, 2**31 - 1, 2**31, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64 - 1, 2**64]
)
SAFE_TEXT = st.text(
    alphabet=st.characters(blacklist_categories=["Cs"]), max_size=8
)  # protobuf strings must be valid UTF-8

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | EDGE_INTS
    | st.floats(allow_nan=False)
    | st.sampled_from([*PROTOCOL_WORDS, *INPUT_NAMES, *OUTPUT_NAMES, *DTYPES])
    | SAFE_TEXT,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(PROTOCOL_WORDS) | SAFE_TEXT, inner, max_size=3)
    ),
    max_leaves=10,
)


# JSON text a hostile client writes where a value goes (issue 17): numbers no type holds,
# nesting as deep as a parser allows and deeper, lone surrogate escapes, objects where
# elements go, a thousand members where one is expected, NaN (not JSON).
HOSTILE_JSON = [
    "1" + "0" * 3000,
    "-1e999",
    "NaN",
    '"\\ud800"',
    '"ok \\udc00"',
    '["\\ud83d\\ude00", "\\udbff"]',
    "[" * 900 + "0" + "]" * 900,
    "[" * 3000 + "]" * 3000,
    '[{"a": [1, 2]}, 3]',
    "[" + ",".join(["{}"] * 1100) + "]",
    "{" + ",".join(f'"k{i}": 1' for i in range(1100)) + "}",
    "[4611686018427387904, 2]",
    '[[1, 2], "3", [true]]',
]
HOSTILE_MARK = "@@hostile@@"


def _expired(unavailable: bool, message: str) -> bool:
    return unavailable and message == MSG_TIMEOUT_EXPIRED


# ---- HTTP ---------------------------------------------------------------------------------


def _ids(model: str, binary: bool) -> HttpInfer:
    ids = np.arange(5, dtype=np.int32).reshape(1, 5)
    spec: dict[str, Any] = {"name": "INPUT_IDS", "shape": [1, 5], "datatype": "INT32"}
    if binary:
        spec["parameters"] = {"binary_data_size": ids.nbytes}
        return HttpInfer(model, {"inputs": [spec]}, ids.tobytes())
    spec["data"] = ids.tolist()
    return HttpInfer(model, {"inputs": [spec]})


def _identity() -> HttpInfer:
    payload = bytes_elements(b"ab", b"", "é".encode())
    doc = {
        "inputs": [
            {
                "name": "INPUT0",
                "shape": [1, 3],
                "datatype": "BYTES",
                "parameters": {"binary_data_size": len(payload)},
            }
        ]
    }
    return HttpInfer("simple_identity", doc, payload)


BASES: list[Callable[[], HttpInfer]] = [
    lambda: simple_http(2),
    lambda: simple_http(1, binary=True),
    _identity,
    lambda: _ids("embed", False),
    lambda: _ids("embed", True),
    lambda: _ids("generate", False),
]


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON document that holds a value (the root excluded)."""
    out = []
    items = (
        node.items()
        if isinstance(node, dict)
        else enumerate(node)
        if isinstance(node, list)
        else ()
    )
    for key, child in items:
        out.append((*prefix, key))
        out.extend(_paths(child, (*prefix, key)))
    return out


def _parent(doc: Any, path: tuple[Any, ...]) -> Any:
    for key in path[:-1]:
        doc = doc[key]
    return doc


@st.composite
def _mutate_doc(draw: st.DrawFn, doc: dict[str, Any]) -> None:
    """Replace, delete or add one value anywhere in a request document."""
    paths = _paths(doc)
    if not paths:
        return
    path = draw(st.sampled_from(paths))
    parent = _parent(doc, path)
    action = draw(st.sampled_from(["replace", "replace", "delete", "add"]))
    if action == "replace":
        parent[path[-1]] = draw(JSON_VALUES)
    elif action == "delete":
        del parent[path[-1]]
    elif isinstance(parent, dict):
        parent[draw(st.sampled_from(PROTOCOL_WORDS))] = draw(JSON_VALUES)
    else:
        parent.append(draw(JSON_VALUES))


@st.composite
def http_requests(draw: st.DrawFn) -> tuple[str, bytes, dict[str, str]]:
    """(path, body, headers). Kinds: a request with a few values changed; a valid one
    with odd request parameters (so that they reach every layer behind the codec); one
    with its binary framing tampered with; random bytes."""
    req = draw(st.sampled_from(BASES))()
    kind = draw(
        st.sampled_from(
            ["mutate", "mutate", "parameters", "parameters", "frame", "bytes", "hostile"]
        )
    )
    headers: dict[str, str] = {}
    if kind == "bytes":
        body = draw(st.binary(max_size=300))
    else:
        if kind == "mutate":
            req.model = draw(st.sampled_from([req.model, req.model, *MODELS]))
            for _ in range(draw(st.sampled_from([0, 1, 1, 2, 3]))):
                draw(_mutate_doc(req.doc))
        if kind == "parameters":
            params = req.doc.setdefault("parameters", {})
            for _ in range(draw(st.integers(1, 3))):
                name = draw(st.sampled_from(PROTOCOL_WORDS) | SAFE_TEXT)
                params[name] = draw(EDGE_INTS | JSON_VALUES)
        hostile = None
        if kind == "hostile":  # one value anywhere replaced by hostile JSON text
            paths = _paths(req.doc)
            path = draw(st.sampled_from(paths))
            _parent(req.doc, path)[path[-1]] = HOSTILE_MARK
            hostile = draw(st.sampled_from(HOSTILE_JSON))
        if kind == "frame":
            req.binary = draw(
                st.sampled_from([req.binary[:-3], req.binary + b"\x00" * 4])
                | st.binary(max_size=80)
            )
        text = json.dumps(req.doc)
        if hostile is not None:
            text = text.replace(json.dumps(HOSTILE_MARK), hostile)
        head = text.encode()
        body = head + req.binary
        if req.binary:
            headers[HEADER_LENGTH] = str(len(head))
        if kind == "frame" or (kind == "mutate" and draw(st.booleans())):
            headers[HEADER_LENGTH] = draw(
                st.integers(-3, len(body) + 20).map(str)
                | st.text(alphabet=string.ascii_letters + string.digits + " -+.", max_size=6)
            )
    encoding = draw(
        st.sampled_from([None, None, None, None, "gzip", "gzip", "deflate", "identity", "GZIP"])
        if draw(st.integers(0, 9))
        else st.sampled_from(["br", "zstd"]) | st.text(string.ascii_letters + ", -", max_size=8)
    )
    if draw(st.integers(0, 4)):  # mostly encoded as it says, else left as it is
        if encoding in ("gzip", "GZIP"):
            body = gzip.compress(body)
        elif encoding == "deflate":
            body = draw(st.sampled_from([zlib.compress(body), zlib.compress(body)[2:-4]]))
    if encoding is not None:
        headers["Content-Encoding"] = encoding
    accept = draw(st.sampled_from([None, "gzip", "deflate", "gzip, deflate", "br", "*", "x"]))
    if accept is not None:
        headers["Accept-Encoding"] = accept
    return f"/v2/models/{req.model}/infer", body, headers


@FUZZ
@given(request=http_requests())
def test_http_fuzz_never_a_server_error(
    frontend: RunningFrontend, request: tuple[str, bytes, dict[str, str]]
) -> None:
    path, body, headers = request
    answer = http_request(frontend.http_url, "POST", path, body, {**headers, **KEY_HEADER})
    event(f"HTTP {answer.status}")
    unknown_encoding = answer.status == 501 and "Content-Encoding" in answer.error
    assert (
        answer.status < 500 or unknown_encoding or _expired(answer.status == 503, answer.error)
    ), answer
    if answer.status >= 400:
        assert answer.error, answer  # Triton's {"error": ...} form, with a message


def test_http_served_and_triton_up_after_fuzz(
    triton: EmbeddedTriton, frontend: RunningFrontend
) -> None:
    simple_still_served_http(frontend.http_url)
    assert triton.is_running()


# ---- gRPC ---------------------------------------------------------------------------------


NUMERIC_FIELDS = {
    "BOOL": ("bool_contents", st.booleans()),
    "INT32": ("int_contents", st.integers(-(2**31), 2**31 - 1)),
    "INT8": ("int_contents", st.integers(-(2**31), 2**31 - 1)),
    "INT64": ("int64_contents", st.integers(-(2**63), 2**63 - 1)),
    "UINT8": ("uint_contents", st.integers(0, 2**32 - 1)),
    "UINT64": ("uint64_contents", st.integers(0, 2**64 - 1)),
    "FP32": ("fp32_contents", st.floats(width=32)),
    "FP64": ("fp64_contents", st.floats()),
    "BYTES": ("bytes_contents", st.binary(max_size=6)),
}

PARAMETER_VALUES = st.one_of(
    st.builds(lambda v: service_pb2.InferParameter(bool_param=v), st.booleans()),
    st.builds(
        lambda v: service_pb2.InferParameter(int64_param=v), st.integers(-(2**63), 2**63 - 1)
    ),
    st.builds(lambda v: service_pb2.InferParameter(int64_param=v), st.integers(-2, 12)),
    st.builds(lambda v: service_pb2.InferParameter(uint64_param=v), st.integers(0, 2**64 - 1)),
    st.builds(lambda v: service_pb2.InferParameter(uint64_param=v), st.integers(0, 12)),
    st.builds(
        lambda v: service_pb2.InferParameter(uint64_param=v),
        EDGE_INTS.filter(lambda v: 0 <= v < 2**64),
    ),
    st.builds(lambda v: service_pb2.InferParameter(double_param=v), st.floats()),
    st.builds(lambda v: service_pb2.InferParameter(string_param=v), SAFE_TEXT),
    st.just(service_pb2.InferParameter()),
)


def _element_count(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= max(d, 0)
    return n


@st.composite
def raw_contents(draw: st.DrawFn, datatype: str, shape: list[int]) -> bytes:
    count = _element_count(shape)
    if draw(st.booleans()) and count <= 64:  # the right size (and form, for BYTES)
        if datatype == "BYTES":
            return bytes_elements(
                *draw(st.lists(st.binary(max_size=5), min_size=count, max_size=count))
            )
        width = DTYPES[datatype].itemsize if datatype in DTYPES else 4
        return draw(st.binary(min_size=count * width, max_size=count * width))
    return draw(st.binary(max_size=100))


def _simple(rows: int) -> service_pb2.ModelInferRequest:
    return simple_grpc(rows) if rows else simple_grpc(0, model="simple_nobatch")


GRPC_BASES: list[Callable[[], service_pb2.ModelInferRequest]] = [
    lambda: _simple(1),
    lambda: _simple(3),
    lambda: _simple(0),
    lambda: identity_grpc(bytes_elements(b"ab", b"", "é".encode()), 3),
    lambda: ids_grpc("embed", np.arange(10, dtype=np.int32).reshape(2, 5)),
    lambda: ids_grpc("generate", np.arange(4, dtype=np.int32).reshape(1, 4)),
]


@st.composite
def _mutate(draw: st.DrawFn, msg: service_pb2.ModelInferRequest) -> None:
    """One change to a request: the kind of mistake (or oddity) a client can make."""
    what = draw(
        st.sampled_from(
            [
                "datatype", "shape", "raw", "drop-input", "add-input", "rename-input",
                "output", "parameter", "parameter", "parameter", "input-parameter",
                "to-contents", "model", "version", "extra-raw",
            ]
        )
    )  # fmt: skip
    index = draw(st.integers(0, max(len(msg.inputs) - 1, 0)))
    has_input = index < len(msg.inputs)
    if what == "datatype" and has_input:
        msg.inputs[index].datatype = draw(st.sampled_from(DATATYPES))
    elif what == "shape" and has_input:
        msg.inputs[index].shape[:] = draw(SHAPES)
    elif what == "raw" and has_input and index < len(msg.raw_input_contents):
        tensor = msg.inputs[index]
        msg.raw_input_contents[index] = draw(raw_contents(tensor.datatype, list(tensor.shape)))
    elif what == "drop-input" and has_input:
        del msg.inputs[index]
        if index < len(msg.raw_input_contents):
            del msg.raw_input_contents[index]
    elif what in ("add-input", "extra-raw") or not has_input:
        datatype = draw(st.sampled_from(DATATYPES))
        shape = draw(st.one_of(SHAPES, st.sampled_from([[1, 1], [2, 1], [1, 16]])))
        name = draw(st.sampled_from(INPUT_NAMES) | SAFE_TEXT)
        if what == "add-input":
            msg.inputs.add(name=name, datatype=datatype, shape=shape)
        msg.raw_input_contents.append(draw(raw_contents(datatype, shape)))
    elif what == "rename-input":
        msg.inputs[index].name = draw(st.sampled_from(INPUT_NAMES) | SAFE_TEXT)
    elif what == "output":
        out = msg.outputs.add(name=draw(st.sampled_from(OUTPUT_NAMES) | SAFE_TEXT))
        if draw(st.booleans()):
            out.parameters["classification"].CopyFrom(draw(PARAMETER_VALUES))
    elif what == "parameter":
        name = draw(st.sampled_from(PROTOCOL_WORDS) | SAFE_TEXT)
        msg.parameters[name].CopyFrom(draw(PARAMETER_VALUES))
    elif what == "input-parameter":
        name = draw(st.sampled_from(PROTOCOL_WORDS) | SAFE_TEXT)
        msg.inputs[index].parameters[name].CopyFrom(draw(PARAMETER_VALUES))
    elif what == "to-contents" and msg.inputs[index].datatype in NUMERIC_FIELDS:
        tensor = msg.inputs[index]
        field, values = NUMERIC_FIELDS[tensor.datatype]
        count = _element_count(list(tensor.shape))
        size = count if count <= 64 and draw(st.booleans()) else draw(st.integers(0, 20))
        getattr(tensor.contents, field).extend(draw(st.lists(values, min_size=size, max_size=size)))
        if draw(st.booleans()):
            del msg.raw_input_contents[:]
    elif what == "model":
        msg.model_name = draw(st.sampled_from([*MODELS, ""]) | SAFE_TEXT)
    elif what == "version":
        msg.model_version = draw(st.sampled_from(["1", "7", "0", "-1", "x"]) | SAFE_TEXT)


@st.composite
def infer_requests(draw: st.DrawFn) -> service_pb2.ModelInferRequest:
    """A valid request of some model with 0-3 random changes (0 in about one of 6)."""
    msg = draw(st.sampled_from(GRPC_BASES))()
    msg.id = draw(SAFE_TEXT)
    for _ in range(draw(st.sampled_from([0, 1, 1, 2, 2, 3]))):
        draw(_mutate(msg))
    return msg


ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,  # an unknown version: Triton's own answer, passed on
    grpc.StatusCode.PERMISSION_DENIED,  # a `tenant` parameter naming another tenant
}


@pytest.fixture(scope="module")
def stub(frontend: RunningFrontend) -> Any:
    with grpc_stub(frontend.grpc_url) as s:
        yield s


@FUZZ
@given(msg=infer_requests())
def test_grpc_fuzz_never_a_server_error(stub: Any, msg: service_pb2.ModelInferRequest) -> None:
    answer = grpc_call(stub, msg, metadata=KEY_METADATA)
    event(answer.code.name)
    unavailable = answer.code == grpc.StatusCode.UNAVAILABLE
    assert answer.code in ALLOWED or _expired(unavailable, answer.details), (answer, msg)
    if answer.code != grpc.StatusCode.OK:
        assert answer.details, answer


def test_grpc_served_and_triton_up_after_fuzz(
    triton: EmbeddedTriton, frontend: RunningFrontend
) -> None:
    simple_still_served_grpc(frontend.grpc_url)
    assert triton.is_running()
