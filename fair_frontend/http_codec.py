"""KServe v2 over HTTP: JSON and the binary tensor extension, to and from ``InferRequest``.

Binary extension: the header ``Inference-Header-Content-Length`` gives the length of
the JSON part; raw tensors follow in input order, each input naming its size in
``parameters.binary_data_size``. The tritonclient HTTP client sends and asks for
binary data by default, so both directions matter.
"""

from __future__ import annotations

import json
from typing import Any

from fair_frontend.errors import InvalidArgument
from fair_frontend.protocol import (
    INT64_MAX,
    InferRequest,
    InferResponse,
    ParamValue,
    RequestedOutput,
    check_shape,
    reject_shared_memory,
    split_parameters,
    tensor_from_list,
    tensor_from_raw,
    tensor_to_list,
    tensor_to_raw,
)

HEADER_CONTENT_LENGTH = "Inference-Header-Content-Length"


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
    req.id = rid
    split_parameters(req, _parameters(doc.get("parameters"), "request"))

    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise InvalidArgument("the request must have a non-empty 'inputs' list")
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
            req.inputs.append(tensor_from_raw(name, str(datatype), shape, raw))
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


def encode_infer(resp: InferResponse, req: InferRequest) -> tuple[bytes, int | None]:
    """Encode a response; returns (body, JSON header length or None when all JSON)."""
    binary_flags = {o.name: o.binary for o in req.outputs}
    doc: dict[str, Any] = {"model_name": resp.model, "model_version": resp.version}
    if resp.id:
        doc["id"] = resp.id
    if resp.parameters:
        doc["parameters"] = resp.parameters
    chunks: list[bytes] = []
    outs = []
    for t in resp.outputs:
        flag = binary_flags.get(t.name)
        # Triton: binary_data_output is the default for "all outputs" only; an output
        # named in the request is binary only if its own binary_data says so.
        binary = bool(flag) if req.outputs else req.binary_output
        entry: dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
        if binary or t.datatype == "BF16":
            raw = tensor_to_raw(t)
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = tensor_to_list(t)
        outs.append(entry)
    doc["outputs"] = outs
    header = json.dumps(doc, separators=(",", ":")).encode()
    if not chunks:
        return header, None
    return header + b"".join(chunks), len(header)


def encode_error(message: str) -> bytes:
    return json.dumps({"error": message}).encode()
