"""KServe v2 over gRPC: ``ModelInferRequest``/``ModelInferResponse`` <-> ``InferRequest``.

The messages are tritonclient's generated stubs (``tritonclient.grpc.service_pb2``).
Inputs arrive either as ``raw_input_contents`` (what tritonclient and perf_analyzer
send) or typed ``contents``; responses always use raw contents, as Triton does.

The server takes requests as bytes (``parse_infer_request``), so that it can read the
model name (``peek_model_name``) and check the caller's key and the message's size before
it parses anything. Typed numeric contents become numpy arrays straight from their packed
wire bytes (``packed_array``): never one Python object per element, which for a million
elements would cost seconds of the event loop and tens of megabytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2

from fair_frontend.errors import InvalidArgument
from fair_frontend.protocol import (
    DTYPES,
    MAX_ID_BYTES,
    Batch,
    Declared,
    InferRequest,
    InferResponse,
    ParamValue,
    Precheck,
    RequestedOutput,
    Tensor,
    check_id,
    check_shape,
    declared_nbytes,
    dtype_of,
    element_count,
    reject_shared_memory,
    shaped,
    split_parameters,
    tensor_from_raw,
    tensor_to_raw,
)

# Which typed-contents field carries each datatype (KServe v2 gRPC).
_CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


# InferTensorContents' numeric fields: field number, and how an element is laid out in
# the packed field (a little-endian fixed-width type, or None for a varint).
_PACKED_FIELDS: dict[str, tuple[int, str | None]] = {
    "bool_contents": (1, None),
    "int_contents": (2, None),
    "int64_contents": (3, None),
    "uint_contents": (4, None),
    "uint64_contents": (5, None),
    "fp32_contents": (6, "<f4"),
    "fp64_contents": (7, "<f8"),
}
_MAX_VARINT_BYTES = 10
_VARINT_WINDOW = 1 << 18  # bytes of a packed field decoded at a time
# Fields read past before peek_model_name gives up: serializers write model_name (field
# 1) first, so a real client's is found at once; a message that hides it deep costs its
# sender a full parse before its size is checked against the model's bound, not us a scan.
_PEEK_FIELDS = 8
_MODEL_NAME_TAG = (1 << 3) | 2  # field 1, length-delimited
_ID_TAG = (3 << 3) | 2  # field 3 (id), length-delimited


# Request parameters accepted as uint64_param: Triton's (the clients send priority that
# way), and timeout, harmlessly (Triton wants int64 there). Not sequence_id: Triton refuses.
_UINT64_PARAMETERS = frozenset({"priority", "timeout"})


def param_value(p: service_pb2.InferParameter, name: str = "") -> ParamValue:
    which = p.WhichOneof("parameter_choice")
    if which is None:
        raise InvalidArgument(f"parameter '{name}' has no value")
    value: ParamValue = getattr(p, which)
    return value


def _request_parameters(msg: service_pb2.ModelInferRequest) -> dict[str, ParamValue]:
    out: dict[str, ParamValue] = {}
    for name, p in msg.parameters.items():
        if p.WhichOneof("parameter_choice") == "uint64_param" and name not in _UINT64_PARAMETERS:
            # Triton's own check: custom parameters travel as int64, bool, double or string.
            raise InvalidArgument(
                f"invalid value type for '{name}' parameter, expected int64_param, "
                "bool_param, double_param or string_param"
            )
        out[name] = param_value(p, name)
    return out


def set_param(p: service_pb2.InferParameter, value: ParamValue) -> None:
    if isinstance(value, bool):
        p.bool_param = value
    elif isinstance(value, int):
        if value >= 1 << 63:
            p.uint64_param = value
        else:
            p.int64_param = value
    elif isinstance(value, float):
        p.double_param = value
    else:
        p.string_param = str(value)


def _varint(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
    """One varint of ``buf`` at ``pos``: (value, position after it); ValueError if cut."""
    value = shift = 0
    for i in range(pos, min(pos + _MAX_VARINT_BYTES, len(buf))):
        byte = buf[i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i + 1
        shift += 7
    raise ValueError("truncated or overlong varint")


def _skip(buf: bytes | memoryview, pos: int, wire_type: int) -> int:
    """The position after a field's value of ``wire_type`` at ``pos``."""
    if wire_type == 0:
        return _varint(buf, pos)[1]
    if wire_type == 1:
        return pos + 8
    if wire_type == 2:
        length, pos = _varint(buf, pos)
        return pos + length
    if wire_type == 5:
        return pos + 4
    raise ValueError(f"wire type {wire_type}")


def peek_model_name(raw: bytes) -> str | None:
    """The ``model_name`` of a serialized ``ModelInferRequest``, read from its first few
    top-level fields without parsing the message; None if it is not among them (or the
    bytes are not protobuf). A hint for the checks that come before parsing: the parsed
    message's own ``model_name`` is the one that counts."""
    return peek_header(raw)[0]


def peek_header(raw: bytes) -> tuple[str | None, str]:
    """``(model_name, id)`` of a serialized ``ModelInferRequest`` from its first few
    top-level fields (``peek_model_name``); the id, "" if not among them, is for the log
    line of a request refused before it is parsed, cut to ``MAX_ID_BYTES``."""
    model: str | None = None
    rid = ""
    pos = 0
    try:
        for _ in range(_PEEK_FIELDS):
            if pos >= len(raw) or (model is not None and rid):
                break
            tag, pos = _varint(raw, pos)
            if tag in (_MODEL_NAME_TAG, _ID_TAG):
                length, pos = _varint(raw, pos)
                if pos + length > len(raw):
                    break
                if tag == _MODEL_NAME_TAG:
                    model = raw[pos : pos + length].decode()
                else:
                    rid = raw[pos : pos + min(length, MAX_ID_BYTES)].decode(errors="replace")
                pos += length
                continue
            pos = _skip(raw, pos, tag & 7)
    except (ValueError, UnicodeDecodeError):
        pass
    return model, rid


def parse_infer_request(raw: bytes) -> service_pb2.ModelInferRequest:
    """A ``ModelInferRequest`` from the bytes of a call; INVALID_ARGUMENT if they are not
    one (gRPC's own deserializer would answer INTERNAL)."""
    try:
        return service_pb2.ModelInferRequest.FromString(raw)
    except DecodeError as err:
        raise InvalidArgument(f"the request is not a valid ModelInferRequest: {err}") from None


def decode_infer(
    msg: service_pb2.ModelInferRequest, *, precheck: Precheck | None = None
) -> InferRequest:
    """A parsed ``ModelInferRequest`` as an ``InferRequest``. The inputs' names, datatypes
    and shapes are read first and given to ``precheck`` (the model's checks), so that
    contents no model could take are never turned into tensors (BYTES contents are a
    Python object per element)."""
    req = InferRequest(model=msg.model_name, version=msg.model_version)
    req.id = check_id("request id", msg.id)  # before any error echoes it
    split_parameters(req, _request_parameters(msg))
    # No inputs at all is Triton's to judge against the model (``validate``): a model
    # whose inputs are all optional takes such a request.
    raw = msg.raw_input_contents
    if raw:  # Triton checks this first, input by input (grpc/infer_handler.cc)
        for spec in msg.inputs:
            if spec.HasField("contents"):
                raise InvalidArgument(
                    "contents field must not be specified when using raw_input_contents "
                    f"for '{spec.name}' for model '{msg.model_name}'"
                )
    if raw and len(raw) != len(msg.inputs):
        raise InvalidArgument(
            f"expected {len(msg.inputs)} raw_input_contents (one per input), got {len(raw)}"
        )
    seen: set[str] = set()
    shapes: list[tuple[int, ...]] = []
    declared: list[Declared] = []
    for i, spec in enumerate(msg.inputs):
        name = spec.name
        if not name:
            raise InvalidArgument(f"inputs[{i}]: missing name")
        if name in seen:
            raise InvalidArgument(f"input '{name}' is given more than once")
        seen.add(name)
        reject_shared_memory(f"input '{name}'", spec.parameters)
        shape = check_shape(name, list(spec.shape))
        shapes.append(shape)
        nbytes: int | None
        if raw:
            dtype_of(name, spec.datatype)
            nbytes = len(raw[i])
        else:
            nbytes = _check_contents(name, spec.datatype, shape, spec.contents)
        declared.append(Declared(name, spec.datatype, shape, nbytes))
    _decode_outputs(req, msg)
    if precheck is not None:
        precheck(req, declared)
    for i, (spec, shape) in enumerate(zip(msg.inputs, shapes, strict=True)):
        if raw:
            req.inputs.append(
                tensor_from_raw(
                    spec.name, spec.datatype, shape, raw[i], model=req.model, rid=req.id
                )
            )
        else:
            req.inputs.append(_from_contents(spec.name, spec.datatype, shape, spec.contents))
    return req


def _decode_outputs(req: InferRequest, msg: service_pb2.ModelInferRequest) -> None:
    for out in msg.outputs:
        reject_shared_memory(f"output '{out.name}'", out.parameters)
        cls = 0
        if "classification" in out.parameters:
            p = out.parameters["classification"]
            if p.WhichOneof("parameter_choice") != "int64_param" or p.int64_param < 0:
                # Triton's rule: an int64_param >= 0 (it refuses uint64_param too).
                raise InvalidArgument(
                    f"output '{out.name}': classification must be an int64_param >= 0"
                )
            cls = p.int64_param
        # Named twice: Triton's gRPC server answers it once, as last named.
        req.outputs = [o for o in req.outputs if o.name != out.name]
        req.outputs.append(RequestedOutput(out.name, None, cls))


def _check_contents(name: str, datatype: str, shape: tuple[int, ...], contents: Any) -> int | None:
    """Typed contents checked against the input's datatype and shape, without reading an
    element; the tensor's size where it is known (numeric data)."""
    field = _contents_field(name, datatype)
    count = element_count(shape)
    others = [f.name for f, _ in contents.ListFields() if f.name != field]
    if others:
        raise InvalidArgument(
            f"input '{name}': {datatype} data goes in '{field}', the request has "
            f"{', '.join(others)}"
        )
    values = getattr(contents, field)
    if len(values) != count:
        raise InvalidArgument(
            f"input '{name}': shape {list(shape)} needs {count} elements, contents have "
            f"{len(values)}"
        )
    return declared_nbytes(datatype, shape)


def _contents_field(name: str, datatype: str) -> str:
    field = _CONTENTS_FIELD.get(datatype)
    if field is None:
        if datatype in DTYPES:
            raise InvalidArgument(f"input '{name}': {datatype} must be sent as raw contents")
        raise InvalidArgument(f"input '{name}': unknown datatype {datatype!r}")
    return field


def _from_contents(name: str, datatype: str, shape: tuple[int, ...], contents: Any) -> Tensor:
    _check_contents(name, datatype, shape, contents)
    field = _CONTENTS_FIELD[datatype]
    count = element_count(shape)
    if datatype == "BYTES":
        # Straight into the array: no list of them on the way.
        arr = np.fromiter(getattr(contents, field), dtype=object, count=count)
    else:
        arr = _in_range(name, datatype, packed_array(contents, field))
    return Tensor(name, datatype, shape, shaped(name, arr, shape))


def _in_range(name: str, datatype: str, wide: np.ndarray) -> np.ndarray:
    """``wide`` (the field's own type) as ``datatype``, refusing elements that do not fit:
    INT8/INT16 travel in int_contents, UINT8/UINT16 in uint_contents."""
    dtype = DTYPES[datatype]
    if wide.dtype == dtype:
        return wide
    info = np.iinfo(dtype)
    if wide.size and (wide.min() < info.min or wide.max() > info.max):
        raise InvalidArgument(f"input '{name}': value out of range for {datatype}")
    return wide.astype(dtype)


def packed_array(contents: service_pb2.InferTensorContents, field: str) -> np.ndarray:
    """The elements of one numeric field of ``contents`` as a numpy array of the field's
    type (bool, int32, int64, uint32, uint64, float32, float64), decoded from the field's
    packed wire bytes in bulk: no Python object per element.

    The bytes come from serializing ``contents`` (protobuf writes a repeated scalar field
    as one packed record; a record of any other form falls back to the element-wise
    reading, which is always right)."""
    number, fixed = _PACKED_FIELDS[field]
    wire = memoryview(contents.SerializeToString())
    chunks: list[memoryview] = []
    pos = 0
    while pos < len(wire):
        tag, pos = _varint(wire, pos)
        end = _skip(wire, pos, tag & 7)
        if tag >> 3 == number:
            if tag & 7 != 2:
                return np.array(list(getattr(contents, field)), dtype=_FIELD_DTYPES[field])
            length, start = _varint(wire, pos)
            chunks.append(wire[start : start + length])
        pos = end
    payload = chunks[0] if len(chunks) == 1 else memoryview(b"".join(chunks))
    if fixed is not None:
        return np.frombuffer(payload, dtype=fixed)
    dtype = _FIELD_DTYPES[field]
    if dtype == np.bool_:
        return decode_varints(payload, 1) != 0
    values = decode_varints(payload, dtype.itemsize)
    return values.view(dtype) if values.dtype.itemsize == dtype.itemsize else values.astype(dtype)


_FIELD_DTYPES: dict[str, np.dtype[Any]] = {
    "bool_contents": np.dtype(np.bool_),
    "int_contents": np.dtype("<i4"),
    "int64_contents": np.dtype("<i8"),
    "uint_contents": np.dtype("<u4"),
    "uint64_contents": np.dtype("<u8"),
    "fp32_contents": np.dtype("<f4"),
    "fp64_contents": np.dtype("<f8"),
}


def decode_varints(payload: bytes | memoryview, width: int) -> np.ndarray:
    """The unsigned varints of a packed field, vectorized: the low ``width`` bytes of
    each, as uint32 (width <= 4) or uint64. A negative int32 is a 10-byte varint whose
    low 4 bytes are its two's complement, so a view as int32 reads it back.

    Each varint ends at a byte below 0x80. Pass k (0..9) takes the k-th byte of every
    varint still going on (its start + k) and puts its 7 payload bits at bit 7k. The
    bytes are taken a window at a time, cut after a varint's last byte, so the index
    arrays stay a few megabytes whatever the field's size."""
    data = np.frombuffer(payload, dtype=np.uint8)
    out_type = np.dtype(np.uint32) if width <= 4 else np.dtype(np.uint64)
    passes = min(_MAX_VARINT_BYTES, -(-out_type.itemsize * 8 // 7))
    count = sum(
        int(np.count_nonzero(data[i : i + _VARINT_WINDOW] < 0x80))
        for i in range(0, data.size, _VARINT_WINDOW)
    )
    out = np.empty(count, dtype=out_type)
    done = lo = 0
    while done < out.size:
        window = data[lo : lo + _VARINT_WINDOW]
        ends = np.flatnonzero(window < 0x80)
        # Zero padding: a pass may look up to 9 bytes past the window's last varint.
        padded = np.concatenate([window[: ends[-1] + 1], np.zeros(passes, dtype=np.uint8)])
        values = _varint_passes(padded, ends, out_type, passes)
        out[done : done + values.size] = values
        done += values.size
        lo += int(ends[-1]) + 1
    return out


def _varint_passes(
    data: np.ndarray, ends: np.ndarray, out_type: np.dtype[Any], passes: int
) -> np.ndarray:
    """The varints ending at ``ends`` of ``data`` (which starts at a varint)."""
    pos = np.empty(ends.size, dtype=np.int64)
    pos[0] = 0
    pos[1:] = ends[:-1] + 1
    byte = data[pos]
    acc = (byte & 0x7F).astype(out_type)
    going = byte >= 0x80
    for k in range(1, passes):
        if not going.any():
            break
        pos += 1
        byte = data[pos]
        part = (byte & 0x7F).astype(out_type)
        part *= going
        part <<= out_type.type(7 * k)
        acc |= part
        going &= byte >= 0x80
    return acc


def encode_infer(resp: InferResponse) -> service_pb2.ModelInferResponse:
    msg = service_pb2.ModelInferResponse(
        model_name=resp.model, model_version=resp.version, id=resp.id
    )
    for k, v in resp.parameters.items():
        set_param(msg.parameters[k], v)
    for t in resp.outputs:
        msg.outputs.add(name=t.name, datatype=t.datatype, shape=list(t.shape))
        msg.raw_output_contents.append(tensor_to_raw(t))
    return msg


def encode_request(batch: Batch) -> service_pb2.ModelInferRequest:
    """A ``ModelInferRequest`` with raw contents, for calls made on the generated stub."""
    msg = service_pb2.ModelInferRequest(
        model_name=batch.model, model_version=batch.version, id=batch.request_id
    )
    for t in batch.inputs:
        msg.inputs.add(name=t.name, datatype=t.datatype, shape=list(t.shape))
        msg.raw_input_contents.append(tensor_to_raw(t))
    for o in batch.outputs or ():
        out = msg.outputs.add(name=o.name)
        if o.classification:
            out.parameters["classification"].int64_param = o.classification
    for k, v in batch.all_parameters().items():
        set_param(msg.parameters[k], v)
    return msg


_ONE_INT = {"INT32": 4, "INT64": 8, "UINT32": 4, "UINT64": 8}  # bytes of one element


def output_tokens_said(msg: service_pb2.ModelInferResponse, name: str) -> int | None:
    """The sum of output ``name`` of a response left serialized until now (a count the
    model gives, ``token_count_output``), decoding that output alone; None without it."""
    for i, spec in enumerate(msg.outputs):
        if spec.name == name:
            raw = msg.raw_output_contents
            shape = tuple(spec.shape)
            if (
                i < len(raw)
                and spec.datatype in _ONE_INT
                and len(raw[i]) == _ONE_INT[spec.datatype]
            ):
                # One integer, the usual count: read as it is, no array for it.
                return max(0, int.from_bytes(raw[i], "little", signed=spec.datatype[0] == "I"))
            if i < len(raw):
                t = tensor_from_raw(name, spec.datatype, shape, raw[i])
            else:
                t = _from_contents(name, spec.datatype, shape, spec.contents)
            return max(0, int(t.data.sum())) if t.data.size else None
    return None


def drop_output(msg: service_pb2.ModelInferResponse, name: str) -> None:
    """Output ``name`` taken out of a response, with its raw contents."""
    for i, spec in enumerate(msg.outputs):
        if spec.name == name:
            if i < len(msg.raw_output_contents):
                del msg.raw_output_contents[i]
            del msg.outputs[i]
            return


def decode_outputs(msg: service_pb2.ModelInferResponse) -> list[Tensor]:
    """A response's outputs (raw contents, as Triton sends them)."""
    raw = msg.raw_output_contents
    out = []
    for i, spec in enumerate(msg.outputs):
        shape = tuple(spec.shape)
        if i < len(raw):
            out.append(tensor_from_raw(spec.name, spec.datatype, shape, raw[i]))
        else:
            out.append(_from_contents(spec.name, spec.datatype, shape, spec.contents))
    return out
