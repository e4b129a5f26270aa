"""KServe v2 over HTTP: JSON and the binary tensor extension, to and from ``InferRequest``.

Binary extension: the header ``Inference-Header-Content-Length`` gives the length of
the JSON part; raw tensors follow in input order, each input naming its size in
``parameters.binary_data_size``. The tritonclient HTTP client sends and asks for
binary data by default, so both directions matter.

Raw binary requests (Triton's ``EVBufferToRawInput``): a header length of 0 (or no header
and an empty body, where Triton takes the body's length for it) means the whole body is
the model's one input, deduced from the model's configuration (``decode_raw_infer``); every
output then comes back binary.

BYTES outputs asked for as JSON are written as Triton writes them (rapidjson, no encoding
validation): each element's bytes go into the JSON string unchanged, only ``"``, ``\\``
and control characters escaped, so non-UTF-8 bytes reach the client as they left the
model (``json_string_bytes``).
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from fair_frontend.errors import InvalidArgument
from fair_frontend.models import ModelInfo
from fair_frontend.protocol import (
    DTYPES,
    INT64_MAX,
    InferRequest,
    InferResponse,
    ParamValue,
    RequestedOutput,
    Tensor,
    byte_size_mismatch,
    check_id,
    check_shape,
    element_count,
    reject_shared_memory,
    request_prefix,
    split_parameters,
    tensor_from_list,
    tensor_from_raw,
    tensor_to_list,
    tensor_to_raw,
)

HEADER_CONTENT_LENGTH = "Inference-Header-Content-Length"
# The name Triton's HTTP server gives a raw binary request's input until the model's
# configuration renames it (``EVBufferToRawInput``); some of its errors say it.
RAW_INPUT = "raw_input"


def parse_header_length(value: str | None, body_length: int) -> int | None:
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        raise InvalidArgument(
            f"{HEADER_CONTENT_LENGTH} must be an integer, got {value!r}"
        ) from None
    if n < 0 or n > body_length:
        raise InvalidArgument(
            f"{HEADER_CONTENT_LENGTH} is {n}, but the request body has {body_length} bytes"
        )
    return n


def _parameters(raw: Any, where: str) -> dict[str, ParamValue]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise InvalidArgument(f"{where}: 'parameters' must be an object")
    for k, v in raw.items():
        if not isinstance(v, (bool, int, float, str)) and k != "headers":
            raise InvalidArgument(f"{where}: parameter '{k}' must be a string, number or boolean")
    return raw


def decode_infer(model: str, version: str, body: bytes, header_length: int | None) -> InferRequest:
    """Decode an HTTP infer body (JSON, optionally followed by binary tensors)."""
    json_part = body if header_length is None else body[:header_length]
    binary = memoryview(body)[len(json_part) :] if header_length is not None else memoryview(b"")
    try:
        doc = json.loads(json_part)
    except (ValueError, RecursionError) as err:
        # ValueError covers JSONDecodeError, bad UTF-8 and integers too long to convert;
        # RecursionError, arrays nested thousands deep.
        where = (
            ""
            if header_length is None
            else f" (the first {header_length} bytes, as {HEADER_CONTENT_LENGTH} says)"
        )
        raise InvalidArgument(f"failed to parse the request JSON{where}: {err}") from None
    if not isinstance(doc, dict):
        raise InvalidArgument("the request JSON must be an object")
    req = InferRequest(model=model, version=version)
    rid = doc.get("id", "")
    if not isinstance(rid, str):
        raise InvalidArgument("'id' must be a string")
    req.id = check_id("request id", rid)  # before any error echoes it
    split_parameters(req, _parameters(doc.get("parameters"), "request"), http=True)

    inputs = doc.get("inputs")
    # An empty list is Triton's to judge against the model (``validate``): a model whose
    # inputs are all optional takes a request without any.
    if not isinstance(inputs, list):
        raise InvalidArgument("the request must have an 'inputs' list")
    offset = 0
    seen: set[str] = set()
    for i, spec in enumerate(inputs):
        if not isinstance(spec, dict):
            raise InvalidArgument(f"inputs[{i}] must be an object")
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"inputs[{i}]: 'name' must be a non-empty string")
        if name in seen:
            raise InvalidArgument(f"input '{name}' is given more than once")
        seen.add(name)
        datatype = spec.get("datatype")
        shape = check_shape(name, spec.get("shape"))
        params = _parameters(spec.get("parameters"), f"input '{name}'")
        reject_shared_memory(f"input '{name}'", params)
        size = params.get("binary_data_size")
        if size is not None:
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise InvalidArgument(f"input '{name}': binary_data_size must be an integer >= 0")
            if "data" in spec:
                raise InvalidArgument(f"input '{name}' has both 'data' and binary_data_size")
            if offset + size > len(binary):
                raise InvalidArgument(
                    f"input '{name}': binary_data_size {size} runs past the end of the "
                    f"binary data ({len(binary) - offset} bytes left)"
                )
            raw = binary[offset : offset + size]  # a view: frombuffer reads it in place
            offset += size
            req.inputs.append(
                tensor_from_raw(name, str(datatype), shape, raw, model=model, rid=req.id)
            )
        else:
            if "data" not in spec:
                raise InvalidArgument(f"input '{name}' has neither 'data' nor binary_data_size")
            if not isinstance(datatype, str):
                raise InvalidArgument(f"input '{name}': 'datatype' must be a string")
            req.inputs.append(tensor_from_list(name, datatype, shape, spec["data"]))
    if offset != len(binary):
        raise InvalidArgument(
            f"{len(binary) - offset} bytes of binary data follow the inputs unclaimed "
            f"(check {HEADER_CONTENT_LENGTH} and binary_data_size)"
        )

    outputs = doc.get("outputs", [])
    if not isinstance(outputs, list):
        raise InvalidArgument("'outputs' must be a list")
    for i, spec in enumerate(outputs):
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise InvalidArgument(f"outputs[{i}] must be an object with a string 'name'")
        params = _parameters(spec.get("parameters"), f"output '{spec['name']}'")
        reject_shared_memory(f"output '{spec['name']}'", params)
        binary_flag = params.get("binary_data")
        if binary_flag is not None and not isinstance(binary_flag, bool):
            raise InvalidArgument(f"output '{spec['name']}': binary_data must be a boolean")
        cls = params.get("classification", 0)
        if isinstance(cls, bool) or not isinstance(cls, int) or not 0 <= cls <= INT64_MAX:
            raise InvalidArgument(
                f"output '{spec['name']}': classification must be an integer >= 0 that fits "
                "in a signed 64-bit integer"
            )
        if all(o.name != spec["name"] for o in req.outputs):
            # Named twice: Triton's HTTP server answers it once, as first named.
            req.outputs.append(RequestedOutput(spec["name"], binary_flag, cls))
    return req


def is_raw_binary(header_length: int | None, body_length: int) -> bool:
    """Whether Triton reads this body as one raw input: its header length is 0, given or
    taken from the body's length when the header is absent (``GetInferenceHeaderLength``)."""
    return (body_length if header_length is None else header_length) == 0


def decode_raw_infer(model: str, version: str, body: bytes, info: ModelInfo) -> InferRequest:
    """A raw binary request: the whole body is the model's one input, as Triton core's
    ``InferenceRequest::Normalize`` deduces it. Name and datatype come from the model's
    configuration; the shape is its dims (after a batch dimension of 1 where the model
    batches), with the one variable-sized dimension, if any, taken from the byte count.
    BYTES only for a one-element input, the body then that element. Errors carry
    Triton's own text: clients and Triton's QA tests match on it."""
    prefix = request_prefix("")
    if len(info.inputs) != 1:
        raise InvalidArgument(
            f"{prefix}Raw request must only have 1 input (found 1) to be deduced but got "
            f"{len(info.inputs)} inputs in '{model}' model configuration"
        )
    spec = next(iter(info.inputs.values()))
    shape = [1] if info.max_batch_size != 0 else []
    dynamic_axis = -1
    elements = 1
    for dim in spec.dims:
        if dim == -1:
            if dynamic_axis != -1:
                raise InvalidArgument(
                    f"{prefix}The shape of the raw input '{spec.name}' can not be deduced "
                    "because there are more than one variable-sized dimension"
                )
            dynamic_axis = len(shape)
        else:
            elements *= dim
        shape.append(dim)
    if spec.datatype == "BYTES":
        if dynamic_axis != -1 or elements != 1:
            raise InvalidArgument(
                f"{prefix}For BYTE datatype raw input '{spec.name}', the model must have "
                "input shape [1]"
            )
        # Triton prepends the body's length: one element, the whole body.
        data = np.empty(1, dtype=object)
        data[0] = bytes(body)
        tensor = Tensor(spec.name, spec.datatype, tuple(shape), data.reshape(shape))
    else:
        itemsize = DTYPES[spec.datatype].itemsize
        if dynamic_axis != -1:
            # Triton's integer division: a body that is no whole number of elements gets
            # the shape rounded down, then the byte size mismatch below. A fixed zero
            # dimension would divide by zero there; the shape is then all zeros here.
            shape[dynamic_axis] = len(body) // elements // itemsize if elements else 0
        expected = element_count(tuple(shape)) * itemsize
        if len(body) != expected:
            # Triton checks the size while the input still has its raw name.
            raise InvalidArgument(byte_size_mismatch("", RAW_INPUT, model, expected, len(body)))
        tensor = tensor_from_raw(spec.name, spec.datatype, tuple(shape), memoryview(body))
    req = InferRequest(model=model, version=version, inputs=[tensor])
    req.binary_output = True  # Triton answers a raw request's outputs in binary
    return req


def encode_infer(resp: InferResponse, req: InferRequest) -> tuple[bytes, int | None]:
    """Encode a response; returns (body, JSON header length or None when all JSON)."""
    binary_flags = {o.name: o.binary for o in req.outputs}
    doc: dict[str, Any] = {"model_name": resp.model, "model_version": resp.version}
    if resp.id:
        doc["id"] = resp.id
    if resp.parameters:
        doc["parameters"] = resp.parameters
    chunks: list[bytes] = []
    outs: list[bytes] = []
    for t in resp.outputs:
        flag = binary_flags.get(t.name)
        # Triton: binary_data_output is the default for "all outputs" only; an output
        # named in the request is binary only if its own binary_data says so.
        binary = bool(flag) if req.outputs else req.binary_output
        entry: dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
        if binary or t.datatype == "BF16":
            raw = tensor_to_raw(t)
            entry["parameters"] = {"binary_data_size": len(raw)}
            if raw:
                # Triton sends its header length only with binary data after the JSON:
                # outputs of no bytes alone leave the answer all JSON.
                chunks.append(raw)
            outs.append(_compact(entry))
        elif t.datatype == "BYTES":
            # Spliced in as bytes: json.dumps would have to decode the elements first.
            data = b",".join(json_string_bytes(_element_bytes(b)) for b in t.data.flat)
            outs.append(_compact(entry)[:-1] + b',"data":[' + data + b"]}")
        else:
            entry["data"] = tensor_to_list(t)
            outs.append(_compact(entry))
    header = _compact(doc)[:-1] + b',"outputs":[' + b",".join(outs) + b"]}"
    if not chunks:
        return header, None
    return header + b"".join(chunks), len(header)


def _compact(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


def _element_bytes(item: Any) -> bytes:
    return item if isinstance(item, bytes) else str(item).encode()


# rapidjson's escapes (``Writer::WriteString``): the two-character ones where JSON has them,
# ``\u00XX`` (upper-case hex) for the other control characters; every other byte as is.
_JSON_ESCAPES = {
    **{c: b"\\u%04X" % c for c in range(0x20)},
    0x08: b"\\b",
    0x09: b"\\t",
    0x0A: b"\\n",
    0x0C: b"\\f",
    0x0D: b"\\r",
    0x22: b'\\"',
    0x5C: b"\\\\",
}
_NEEDS_ESCAPE = re.compile(rb'[\x00-\x1f"\\]')


def json_string_bytes(value: bytes) -> bytes:
    """``value`` as a JSON string, written as Triton writes a BYTES element (rapidjson
    without encoding validation): the bytes unchanged, valid UTF-8 or not, but for the
    escapes JSON requires. A client reading the body as Latin-1 or bytes (as Triton's QA
    ``L0_string_io`` does) gets back exactly what the model produced."""
    body = _NEEDS_ESCAPE.sub(lambda m: _JSON_ESCAPES[m.group()[0]], value)
    return b'"' + body + b'"'


def encode_error(message: str) -> bytes:
    return json.dumps({"error": message}).encode()
