"""Triton's generate extension (``/generate``, ``/generate_stream``): JSON to and from
``InferRequest`` / ``InferResponse``, as Triton 2.51's HTTP server does it.

Source: ``src/http_server.cc`` of triton-inference-server/server at v2.51.0
(``HandleGenerate``, ``GenerateRequestClass::ConvertGenerateRequest``,
``ExactMappingInput``, ``FinalizeResponse``, ``ExactMappingOutput``,
``SendChunkResponse``) and ``docs/protocol/extension_generate.md``.

Request: a JSON object. ``id`` (a string) is the request id. Every key, in document
order, is either a model input (by name: its datatype and shape come from the model; a
scalar is one element; the elements fill the model's shape with every fixed dimension
kept and the innermost variable one taking the rest, the others 1), or else a request
parameter (string, integer, boolean or number; anything else is refused). ``parameters``
is an object whose keys follow the same rule (an input named there is an input).

Response: one flat JSON object per response, keys in byte order as Triton's ``std::map``
gives them: ``id`` (when the request had one), ``model_name``, ``model_version``, each
response parameter and each output by name, an output of one element as a scalar.
``/generate_stream`` frames each as a server-sent event ``data: {...}\\n\\n``.

Where the frontend differs on purpose: request parameters keep the meaning they have on
``/infer`` (``priority`` and ``timeout`` steer scheduling, ``tenant`` names the tenant,
names starting ``triton_`` or ``fair_`` are refused). Triton's own generate passes them
to the model untouched, but the frontend forwards over Triton's infer protocol, where
those names are not plain parameters either. A stream whose events the shell passes on
from Triton's own ``generate_stream`` (``triton.sse``) is sent there as the decoded
request, encoded again (``encode_generate_request``): the same inputs and parameters as
over gRPC, those names taken out the same way.
"""

from __future__ import annotations

import json
import math
from decimal import Decimal
from typing import Any

import grpc
import numpy as np

from fair_frontend.errors import InvalidArgument, UnknownModel
from fair_frontend.models import ModelInfo
from fair_frontend.protocol import (
    DTYPES,
    EMPTY_FINAL_RESPONSE,
    FINAL_RESPONSE,
    INT64_MAX,
    INT64_MIN,
    UINT64_MAX,
    InferRequest,
    InferResponse,
    ParamValue,
    Tensor,
    check_id,
    leaves,
    split_parameters,
)

SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
PARAMETERS_KEY = "parameters"
# SendChunkResponse: /generate on a model that sent other than one response.
MSG_NOT_ONE_RESPONSE = (
    "generate expects model to produce exactly 1 response, use generate stream for model "
    "that generates various number of responses"
)
MSG_ENCODING = "Unsupported content-encoding, only 'identity' is supported."
_PARSE_DATA = "Unable to parse 'data'"
_SHAPE_MISMATCH = "Shape does not match true shape of 'data' field"
# TritonJson's accessor errors (common/include/triton/common/triton_json.h).
_NOT_STRING = "attempt to access JSON non-string as string"
_NOT_OBJECT = "attempt to access JSON non-object as object"
_NOT_TYPE = {
    "BOOL": "attempt to access JSON non-boolean as boolean",
    "INT": "attempt to access JSON non-signed-integer as signed-integer",
    "UINT": "attempt to access JSON non-unsigned-integer as unsigned-integer",
    "FP": "attempt to access JSON non-number as double",
}
# rapidjson's messages (error/en.h) for what Python's json module reports.
_RAPIDJSON_MESSAGES = {
    "Expecting value": "Invalid value.",
    "Expecting property name enclosed in double quotes": "Missing a name for object member.",
    "Expecting ':' delimiter": "Missing a colon after a name of object member.",
    "Extra data": "The document root must not be followed by other values.",
    "Unterminated string starting at": "Missing a closing quotation mark in string.",
    "Invalid \\escape": "Invalid escape character in string.",
    "Invalid control character at": "Invalid encoding in string.",
}


class TritonJsonError(InvalidArgument):
    """A body Triton's JSON layer refuses: the client's fault (outcome REJECTED_INVALID),
    but answered as Triton answers it, 500 (its JSON accessors report INTERNAL)."""

    grpc_code = grpc.StatusCode.INTERNAL
    http_status = 500


class ModelNotFound(UnknownModel):
    """Generate looks the model up first (its metadata): Triton answers NOT_FOUND, 404."""

    grpc_code = grpc.StatusCode.NOT_FOUND
    http_status = 404

    def __init__(self, model: str, version: str = "") -> None:
        super().__init__(model)
        if version:
            self.message = f"Request for unknown model: '{model}' version {version} is not found"
            self.args = (self.message,)


def check_model(info: ModelInfo, version: str) -> None:
    """The version must be one the model serves (Triton: ``ModelInputMetadata``)."""
    if version and version not in info.versions:
        raise ModelNotFound(info.name, version)


def check_encoding(content_encoding: str | None) -> None:
    """Triton's generate reads identity bodies only (its ``[FIXME] decompression``)."""
    if content_encoding is not None and content_encoding.strip().lower() not in ("", "identity"):
        raise InvalidArgument(MSG_ENCODING)


def parse_json(body: bytes) -> Any:
    """The body as JSON, with rapidjson's wording where Python's parser has the same case."""
    if not body.strip():
        raise TritonJsonError(
            "failed to parse the request JSON buffer: The document is empty. at 0"
        )
    try:
        return json.loads(body)
    except json.JSONDecodeError as err:
        msg = _RAPIDJSON_MESSAGES.get(err.msg, err.msg)
        raise TritonJsonError(
            f"failed to parse the request JSON buffer: {msg} at {err.pos}"
        ) from None
    except (ValueError, RecursionError) as err:
        raise TritonJsonError(f"failed to parse the request JSON buffer: {err}") from None


def decode_generate(model: str, version: str, body: bytes, info: ModelInfo) -> InferRequest:
    """A generate request body -> ``InferRequest`` for ``info``'s inputs."""
    doc = parse_json(body)
    req = InferRequest(model=model, version=version)
    params: dict[str, ParamValue] = {}
    if isinstance(doc, dict) and "id" in doc:
        if not isinstance(doc["id"], str):
            raise TritonJsonError(f"Unable to parse 'id': {_NOT_STRING}")
        req.id = _unicode(check_id("request id", doc["id"]), "'id'")  # bounded first
    if not isinstance(doc, dict):
        raise TritonJsonError("attempt to get members for non-object")
    for key, value in doc.items():
        if key == PARAMETERS_KEY:
            if key in info.inputs:
                raise InvalidArgument(
                    f"Keyword '{key}' for nested schema also given as input tensor name"
                )
            if not isinstance(value, dict):
                raise TritonJsonError(f"Expected JSON object for keyword: '{key}': {_NOT_OBJECT}")
            try:
                for name, nested in value.items():
                    _map_key(req, params, info, name, nested)
            except InvalidArgument as err:
                err.message = f"Converting keyword: '{key}': {err.message}"
                err.args = (err.message,)
                raise
        else:
            _map_key(req, params, info, key, value)
    _check_inputs(req, info)
    split_parameters(req, params)
    # Generate answers with data only: Triton's empty final response has no place here.
    req.empty_final_response = False
    return req


def _map_key(
    req: InferRequest,
    params: dict[str, ParamValue],
    info: ModelInfo,
    name: str,
    value: Any,
) -> None:
    _unicode(name, "a key of the request")
    spec = info.inputs.get(name)
    if spec is None:
        params[name] = _parameter(name, value)
        return
    if any(t.name == name for t in req.inputs):
        raise InvalidArgument(
            f"input '{name}' already exists in request"
        )  # a key both at the top and in parameters
    dims = (-1, *spec.dims) if info.batching else tuple(spec.dims)
    req.inputs.append(_tensor(name, spec.datatype, dims, value, req.id, model=info.name))


def _parameter(name: str, value: Any) -> ParamValue:
    """SetTritonParameterFromJsonParameter: string, int64, bool, else a number as double."""
    if isinstance(value, str):
        return _unicode(value, f"parameter '{name}'")
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value if INT64_MIN <= value <= INT64_MAX else float(value)
    if isinstance(value, float):
        return value
    raise InvalidArgument(
        f"parameter '{name}' has invalid type. It should be either 'int', 'bool', or 'string'."
    )


def _shape(name: str, dims: tuple[int, ...], count: int) -> tuple[int, ...]:
    """ExactMappingInput's two passes: fixed dimensions divide the element count; the
    innermost variable dimension takes what is left, any other variable one is 1."""
    left = count
    for d in reversed(dims):
        if d != -1:
            if d == 0 or left % d:
                raise InvalidArgument(
                    f"The schema can not convert input '{name}' to tensor with proper shape"
                )
            left //= d
    shape = list(dims)
    for i in reversed(range(len(shape))):
        if shape[i] == -1:
            shape[i] = left
            left = 1
    if left != 1:
        raise InvalidArgument(
            f"The schema can not convert input '{name}' to tensor with proper shape"
        )
    return tuple(shape)


def _tensor(
    name: str, datatype: str, dims: tuple[int, ...], value: Any, rid: str, *, model: str
) -> Tensor:
    # Triton counts the outer array only; nested arrays are read element by element.
    count = len(value) if isinstance(value, list) else 1
    elements = leaves(value)
    if datatype == "BYTES":
        for leaf in elements:
            if not isinstance(leaf, str):
                raise TritonJsonError(f"Unable to parse JSON bytes array: {_NOT_STRING}")
    shape = _shape(name, dims, count)
    if datatype in ("FP16", "BF16"):
        raise InvalidArgument(
            f"receiving {datatype} data via JSON is not supported. Please use the binary "
            f"data format for input {name}"
        )
    if datatype == "BYTES":
        expected = math.prod(shape)
        if len(elements) != expected:
            raise InvalidArgument(
                f"{_request_prefix(rid)}unexpected number of string elements {len(elements)} "
                f"for inference input '{name}' for model '{model}', expecting {expected}"
            )
        arr = np.empty(len(elements), dtype=object)
        for i, leaf in enumerate(elements):
            arr[i] = _utf8(leaf, f"input '{name}'")
        return Tensor(name, datatype, shape, arr.reshape(shape))
    kind = (
        "BOOL"
        if datatype == "BOOL"
        else "FP"
        if datatype.startswith("FP")
        else ("UINT" if datatype.startswith("UINT") else "INT")
    )
    for i, leaf in enumerate(elements):
        if i >= count:
            raise TritonJsonError(f"{_PARSE_DATA}: {_SHAPE_MISMATCH}")
        if not _is_kind(kind, leaf):
            raise TritonJsonError(f"{_PARSE_DATA}: {_NOT_TYPE[kind]}")
    if len(elements) != count:
        raise TritonJsonError(f"{_PARSE_DATA}: {_SHAPE_MISMATCH}")
    dtype = DTYPES[datatype]
    if kind == "INT":
        # Triton stores int64 into the narrower type as C does: wrapping.
        arr = np.array(elements, dtype=np.int64).astype(dtype)
    elif kind == "UINT":
        arr = np.array(elements, dtype=np.uint64).astype(dtype)
    else:
        arr = np.array(elements, dtype=dtype)
    return Tensor(name, datatype, shape, arr.reshape(shape))


def _unicode(text: str, what: str) -> str:
    """``text`` if it is Unicode (``_utf8``)."""
    _utf8(text, what)
    return text


def _utf8(text: str, what: str) -> bytes:
    """``text`` as UTF-8; 400 naming ``what`` for a lone UTF-16 surrogate, which JSON's
    escapes can write (``"\\ud800"``) and Python's parser takes, but no encoding carries
    (it was a 500 with a traceback)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as err:
        surrogate = f"\\u{ord(text[err.start]):04x}"
        raise InvalidArgument(
            f"{what} is not valid Unicode text: a lone UTF-16 surrogate '{surrogate}' at "
            f"character {err.start}"
        ) from None


def _is_kind(kind: str, v: Any) -> bool:
    if kind == "BOOL":
        return isinstance(v, bool)
    if isinstance(v, bool):
        return False
    if kind == "INT":
        return isinstance(v, int) and INT64_MIN <= v <= INT64_MAX
    if kind == "UINT":
        return isinstance(v, int) and 0 <= v <= UINT64_MAX
    return isinstance(v, (int, float))


def _request_prefix(rid: str) -> str:
    """Triton core's prefix on request errors (``InferenceRequest::LogRequest``)."""
    return f"[request id: {rid or '<id_unknown>'}] "


def _check_inputs(req: InferRequest, info: ModelInfo) -> None:
    """Triton core's input count check, with its message (``ValidateRequestInputs``)."""
    given = [t.name for t in req.inputs]
    missing = [n for n, s in info.inputs.items() if not s.optional and n not in given]
    if not missing:
        return
    required = sum(1 for s in info.inputs.values() if not s.optional)
    total = len(info.inputs)
    expected = (
        f"expected {total} inputs"
        if required == total
        else f"expected number of inputs between {required} and {total}"
    )
    quoted = "[" + ",".join(f"'{n}'" for n in given) + "]"
    raise InvalidArgument(
        f"{_request_prefix(req.id)}{expected} but got {len(given)} inputs for model "
        f"'{info.name}'. Got input(s) {quoted}, but missing required input(s) "
        f"[{','.join(repr(n) for n in missing)}]. Please provide all required input(s)."
    )


def encode_generate_request(
    inputs: list[Tensor], parameters: dict[str, ParamValue], request_id: str
) -> bytes | None:
    """A request as generate's JSON object, as the shell sends it on to Triton's own
    ``generate_stream``: ``id``, each input by name (one element as a scalar, more as a
    flat list: Triton fills the model's shape from them, as it did the client's), each
    parameter by name. None where JSON cannot carry it exactly (text that is not UTF-8, a
    number that is not finite, a NUL that Triton's reader stops at): the caller goes over
    gRPC then."""
    doc: dict[str, Any] = {"id": request_id} if request_id else {}
    for name, value in parameters.items():
        if isinstance(value, float) and not math.isfinite(value):
            return None
        doc[name] = value
    for t in inputs:
        values = t.data.reshape(-1).tolist()
        if t.datatype == "BYTES":
            try:
                values = [v.decode() if isinstance(v, bytes) else str(v) for v in values]
            except UnicodeDecodeError:
                return None
        elif t.datatype.startswith("FP") and not all(math.isfinite(v) for v in values):
            return None
        doc[t.name] = values[0] if len(values) == 1 else values
    text = json.dumps(doc, separators=(",", ":"))
    return None if "\\u0000" in text else text.encode()


# ---- responses ----------------------------------------------------------------------------


def encode_generate(resp: InferResponse) -> bytes:
    """One response as Triton's generate object (compact, keys in byte order)."""
    fields: dict[str, Any] = {}
    if resp.id:
        fields["id"] = resp.id
    fields["model_name"] = resp.model
    fields["model_version"] = resp.version
    for name, value in resp.parameters.items():
        if name != FINAL_RESPONSE and name != EMPTY_FINAL_RESPONSE:
            fields.setdefault(name, value)  # std::map::emplace: the first one stays
    for t in resp.outputs:
        if t.name not in fields:
            fields[t.name] = _output_value(t)
    items = sorted(fields.items(), key=lambda kv: kv[0].encode())
    return b"{" + b",".join(_string(k) + b":" + _value(v) for k, v in items) + b"}"


def encode_error(message: str) -> bytes:
    return b'{"error":' + _string(message) + b"}"


def sse_event(payload: bytes) -> bytes:
    """A server-sent event carrying one JSON object, as Triton frames them."""
    return b"data: " + payload + b"\n\n"


def _output_value(t: Tensor) -> Any:
    if t.datatype in ("FP16", "BF16"):
        raise InvalidArgument(
            f"sending {t.datatype} data via JSON is not supported. Please use the binary data "
            "format for output"
        )
    flat = t.data.reshape(-1)
    values: list[Any]
    if t.datatype == "BYTES":
        values = [b if isinstance(b, bytes) else str(b).encode() for b in flat]
    elif t.datatype == "BOOL":
        values = [bool(v) for v in flat]
    elif t.datatype.startswith("FP"):
        values = [float(v) for v in flat]
    else:
        values = [int(v) for v in flat]
    return values[0] if len(values) == 1 else values


# rapidjson's Writer: raw UTF-8, control characters as \uXXXX (uppercase hex) except the
# five short escapes, '"' and '\\' escaped, nothing else.
_ESCAPES = {0x22: b'\\"', 0x5C: b"\\\\", 0x08: b"\\b", 0x0C: b"\\f", 0x0A: b"\\n", 0x0D: b"\\r",
            0x09: b"\\t"}  # fmt: skip


def _string(s: str | bytes) -> bytes:
    raw = s.encode("utf-8", "surrogateescape") if isinstance(s, str) else s
    out = bytearray(b'"')
    for c in raw:
        if c in _ESCAPES:
            out += _ESCAPES[c]
        elif c < 0x20:
            out += b"\\u%04X" % c
        else:
            out.append(c)
    out += b'"'
    return bytes(out)


def _value(v: Any) -> bytes:
    if isinstance(v, list):
        return b"[" + b",".join(_value(x) for x in v) + b"]"
    if isinstance(v, bool):
        return b"true" if v else b"false"
    if isinstance(v, int):
        return str(v).encode()
    if isinstance(v, float):
        return _double(v).encode()
    return _string(v)


def _double(x: float) -> str:
    """A double as rapidjson writes it (shortest digits, its own exponent thresholds)."""
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    sign = "-" if math.copysign(1.0, x) < 0 else ""
    x = abs(x)
    if x == 0.0:
        return sign + "0.0"
    # repr gives the shortest digits that round-trip, as rapidjson's Grisu2 (nearly
    # always) does; then rapidjson's Prettify: value = 0.digits x 10^kk.
    sig = Decimal(repr(x)).as_tuple()
    assert isinstance(sig.exponent, int)
    digits = "".join(map(str, sig.digits)).rstrip("0") or "0"
    exponent = sig.exponent + (len(sig.digits) - len(digits))
    kk = len(digits) + exponent
    n = len(digits)
    k = kk - n
    if k >= 0 and kk <= 21:
        return sign + digits + "0" * k + ".0"
    if 0 < kk <= 21:
        return sign + digits[:kk] + "." + digits[kk:]
    if -6 < kk <= 0:
        return sign + "0." + "0" * (-kk) + digits
    e = kk - 1
    if n == 1:
        return f"{sign}{digits}e{e}"
    return f"{sign}{digits[0]}.{digits[1:]}e{e}"
